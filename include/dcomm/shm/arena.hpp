// An arena: a part of the shared memory segment (shm/segment.hpp) where the
// collectives of a group whose ranks all live on this host meet
// (cpu/algorithms/shared_memory.hpp), instead of passing messages.
//
// Each local rank owns two records, used in turn, one per step of an
// operation. A record is a header and a data slot: the rank copies its
// part of a step into its slot, then publishes the step's stamp in
// `arrived` (release); the others read the slot once they see that stamp
// (acquire). A step that also reduces publishes `reduced` once this
// rank's share of the reduction is in its slot. A rank reuses a record
// two steps later, by which time every other rank has published the step
// in between, so has finished reading it: one synchronisation per step
// and no separate "done" flags (DeepSpeed's shm all_reduce has one flag
// per rank and step in the same spirit; UCC's tl/shm a control word and a
// data slot per rank).
//
// A stamp names the call and its step, so a rank looks for the record
// that carries the stamp it waits for rather than counting steps: ranks
// that failed a call at different steps meet again at the next one. A
// failed call breaks the rule above (a rank left a step without seeing the
// others there), so each rank also says which calls it has left: the next
// call's first write waits until the others are done with what it
// overwrites (cpu/algorithms/shm_arena.hpp).
//
// The segment has the host's arena, where the world group meets when every
// rank is on this host, and group_arenas more, each a group's own: a group
// whose ranks all share this host claims one by its id (claim_arena) the
// first time it needs it, and keeps it while the segment lives. Two groups
// never share an arena: a call of one would take the other's records.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "dcomm/detail/arrivals.hpp"

namespace dcomm::shm {

inline constexpr std::size_t cache_line = 64;

// A call's step: its sequence number and the step within it. Never 0 (a
// fresh record's value), however the sequence numbers start.
inline std::uint64_t arena_stamp(std::uint64_t seq, std::uint32_t step) {
  return ((seq + 1) << 20) | step;
}
inline constexpr std::uint32_t max_arena_steps = (1u << 20) - 1;

struct alignas(cache_line) arena_record {
  std::atomic<std::uint64_t> arrived{0};  // the stamp whose data the slot holds
  std::atomic<std::uint64_t> reduced{0};  // the stamp whose share this rank reduced
  std::uint64_t group = 0;                // the call that wrote them (checked
  std::byte call[24] = {};                // by the others: opaque here)
  // When the call's ranks called it, as far as the writer knew at this
  // step (the host's one steady clock): how stragglers are found.
  detail::arrival_stamp arrivals{};
};
static_assert(sizeof(arena_record) == cache_line);

// What a rank says of itself: the stamp of the last call it left (with
// max_arena_steps: every step of it).
struct alignas(cache_line) arena_rank_state {
  std::atomic<std::uint64_t> left{0};
};

// Where a rank's records and slots are in the arena.
struct arena_layout {
  std::size_t ranks = 0;
  std::size_t slot_bytes = 0;  // a multiple of the cache line

  static constexpr std::size_t records_bytes = 4096;  // keeps the slots on pages
  std::size_t stride() const { return records_bytes + 2 * slot_bytes; }
  std::size_t bytes() const { return ranks * stride(); }
  std::size_t record_at(std::size_t rank, std::size_t which) const {
    return rank * stride() + which * sizeof(arena_record);
  }
  std::size_t state_at(std::size_t rank) const {
    return rank * stride() + 2 * sizeof(arena_record);
  }
  std::size_t slot_at(std::size_t rank, std::size_t which) const {
    return rank * stride() + records_bytes + which * slot_bytes;
  }
};

// Arenas for groups other than the world, per segment; a group that finds
// them all taken keeps its messages.
inline constexpr std::size_t group_arenas = 8;

// Which group holds one of those arenas (0: none yet). Claimed once, never
// given back, so every member that looks finds the same arena: the first
// one whose claim says its group, or, where none does, the same "none".
struct alignas(cache_line) arena_claim {
  std::atomic<std::uint64_t> group{0};
};

// The arena that group `key` (not 0) holds, claiming a free one if it holds
// none: its index in `claims`, or group_arenas when every one is taken.
// Members scan in the same order: one that finds a free claim taken by
// another member of its group sees the key there and takes the same.
inline std::size_t claim_arena(arena_claim* claims, std::uint64_t key) {
  for (std::size_t i = 0; i < group_arenas; ++i) {
    std::uint64_t held = claims[i].group.load(std::memory_order_acquire);
    if (held == 0 && claims[i].group.compare_exchange_strong(held, key, std::memory_order_acq_rel))
      return i;
    if (held == key) return i;
  }
  return group_arenas;
}

// One rank's view of the arena of a mapped segment.
class arena {
 public:
  arena(std::byte* base, arena_layout layout) : base_(base), layout_(layout) {}

  std::size_t ranks() const { return layout_.ranks; }
  std::size_t slot_bytes() const { return layout_.slot_bytes; }
  arena_record& record(std::size_t rank, std::size_t which) {
    return *reinterpret_cast<arena_record*>(base_ + layout_.record_at(rank, which));
  }
  arena_rank_state& state(std::size_t rank) {
    return *reinterpret_cast<arena_rank_state*>(base_ + layout_.state_at(rank));
  }
  std::byte* slot(std::size_t rank, std::size_t which) {
    return base_ + layout_.slot_at(rank, which);
  }
  // Rank `rank`'s record that carries `stamp` (nullptr: it has not got
  // there yet, or went another way).
  arena_record* find(std::size_t rank, std::uint64_t stamp) {
    for (std::size_t which = 0; which < 2; ++which) {
      arena_record& r = record(rank, which);
      if (r.arrived.load(std::memory_order_acquire) == stamp) return &r;
    }
    return nullptr;
  }
  std::size_t index_of(std::size_t rank, const arena_record& r) {
    return &r == &record(rank, 0) ? 0 : 1;
  }
  // Whether rank `rank` is done with `stamp`: it left that call or a
  // later one, or arrived at a later step (it leaves a step's reads
  // before it arrives at the next).
  bool done_with(std::size_t rank, std::uint64_t stamp) {
    if (state(rank).left.load(std::memory_order_acquire) >= stamp) return true;
    for (std::size_t which = 0; which < 2; ++which)
      if (record(rank, which).arrived.load(std::memory_order_acquire) > stamp) return true;
    return false;
  }

 private:
  std::byte* base_;
  arena_layout layout_;
};

}  // namespace dcomm::shm
