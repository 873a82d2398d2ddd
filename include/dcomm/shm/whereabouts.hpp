// Each rank's whereabouts on a board in its host's segment: the oldest
// collective it is in and the last one it left. Written at every
// collective's start and end (a few stores to the rank's own cache lines);
// read by a rank of the same host whose collective timed out, for a member
// that did not answer its probe: a stopped process, or one whose thread is
// blocked outside dcomm, cannot answer, but what it last wrote is still
// there. The channel does not depend on the data path (a full ring, a
// stuck socket) nor on the rank's cooperation.
//
// A seqlock across processes: `version` is odd while the owner writes; a
// reader retries a few times and gives up if the owner stopped mid-write.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

#include "dcomm/shm/arena.hpp"

namespace dcomm::shm {

// One collective as a board tells it: group, sequence number + 1 (0: none),
// the operation (opaque here: a dcomm::operation), and a time on the
// host's steady clock (when it was made, or when it ended).
struct board_call {
  std::uint64_t group = 0;
  std::uint64_t seq_plus_one = 0;
  std::uint8_t op = 0;
  std::int64_t ns = 0;

  bool any() const { return seq_plus_one != 0; }
};

struct board_reading {
  board_call in;    // the oldest collective it is in (none: in no collective)
  board_call left;  // the last it left, and when
};

class alignas(cache_line) rank_board {
 public:
  // The owner: its oldest collective in progress (`in`; none: in none),
  // and, when one has just ended, that one.
  void post(const board_call& in, const board_call* left) {
    const std::uint64_t v = version_.load(std::memory_order_relaxed);
    version_.store(v + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    store(in_, in);
    if (left) store(left_, *left);
    version_.store(v + 2, std::memory_order_release);
  }

  // Another rank: a consistent reading, or none (being written: the owner
  // stopped mid-write, or kept writing through every try).
  std::optional<board_reading> read() const {
    for (int tries = 0; tries < 64; ++tries) {
      const std::uint64_t v = version_.load(std::memory_order_acquire);
      if (v & 1) continue;
      board_reading r{load(in_), load(left_)};
      std::atomic_thread_fence(std::memory_order_acquire);
      if (version_.load(std::memory_order_relaxed) == v) return r;
    }
    return std::nullopt;
  }

 private:
  struct fields {
    std::atomic<std::uint64_t> group{0}, seq_plus_one{0};
    std::atomic<std::int64_t> ns{0};
    std::atomic<std::uint8_t> op{0};
  };
  static void store(fields& f, const board_call& c) {
    f.group.store(c.group, std::memory_order_relaxed);
    f.seq_plus_one.store(c.seq_plus_one, std::memory_order_relaxed);
    f.ns.store(c.ns, std::memory_order_relaxed);
    f.op.store(c.op, std::memory_order_relaxed);
  }
  static board_call load(const fields& f) {
    return {f.group.load(std::memory_order_relaxed), f.seq_plus_one.load(std::memory_order_relaxed),
            f.op.load(std::memory_order_relaxed), f.ns.load(std::memory_order_relaxed)};
  }

  std::atomic<std::uint64_t> version_{0};
  fields in_, left_;
};

}  // namespace dcomm::shm
