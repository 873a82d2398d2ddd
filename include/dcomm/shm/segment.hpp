// The shared memory of the ranks on one host: one segment per communicator
// and host, made by the host's lowest rank (shm/handover.hpp) and mapped by
// every rank there. It holds, for each ordered pair of local ranks, a
// byte ring (shm/channel.hpp), for each local rank a doorbell: a word
// saying whether the rank sleeps, and an eventfd that wakes it, and the
// arenas where the collectives meet (shm/arena.hpp): the host's and
// group_arenas that groups claim, what each rank says of itself for
// reads of its memory by the others (shm/single_copy.hpp), and each
// rank's whereabouts (shm/whereabouts.hpp).
//
// The segment is a memfd: it has no name anywhere, so nothing is left
// behind when the job ends, even by SIGKILL (the kernel frees it with the
// last mapping). OpenMPI's vader BTL and UCC's tl/shm name their segments
// in /dev/shm and unlink them once mapped; a rank killed in between leaves
// one behind, which a memfd cannot.
#pragma once

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "dcomm/shm/arena.hpp"
#include "dcomm/shm/single_copy.hpp"
#include "dcomm/shm/whereabouts.hpp"

namespace dcomm::shm {

// A rank's doorbell word. Its owner says `asleep` before it waits on its
// eventfd and `awake` while it polls; a writer that finds it `asleep`
// turns it to `rung` and writes the eventfd once, so a burst of messages
// to a sleeping rank costs one system call, and messages to a polling rank
// none.
struct alignas(cache_line) doorbell_word {
  static constexpr std::uint32_t awake = 0, asleep = 1, rung = 2;
  std::atomic<std::uint32_t> state{asleep};
};

// One direction between two ranks: `head` counts the bytes ever written
// (the writer's), `tail` the bytes ever read (the reader's), each on a
// cache line of its own; `writer_waiting` asks the reader to ring the
// writer's doorbell once it has made room; `withdrawn` counts the large
// sends the writer took back after offering the reader its buffer
// (shm/single_copy.hpp).
struct ring_control {
  alignas(cache_line) std::atomic<std::uint64_t> head{0};
  alignas(cache_line) std::atomic<std::uint64_t> tail{0};
  alignas(cache_line) std::atomic<std::uint32_t> writer_waiting{0};
  std::atomic<std::uint32_t> withdrawn{0};
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free &&
                  std::atomic<std::uint32_t>::is_always_lock_free,
              "shared memory needs lock-free atomics: they live in another process's mapping too");

struct segment_header {
  static constexpr std::uint64_t expected_magic = 0x64636f6d6d73686dull;  // "dcommshm"
  std::uint64_t magic = 0;
  std::uint32_t ranks = 0;
  std::uint32_t reserved = 0;
  std::uint64_t ring_bytes = 0;
  std::uint64_t slot_bytes = 0;
};

// The sizes a segment is made with.
struct segment_sizes {
  std::size_t ring_bytes = 1 << 20;  // per direction and pair; a power of two
  std::size_t slot_bytes = 1 << 18;  // each of a rank's two arena slots; a multiple of 4096
};

// Where everything is in a segment of `ranks` local ranks with rings of
// `ring_bytes` (a power of two) and arena slots of `slot_bytes`.
struct segment_layout {
  std::size_t ranks = 0;
  std::size_t ring_bytes = 0;
  std::size_t slot_bytes = 0;

  std::size_t pairs() const { return ranks * (ranks - 1); }
  // Ring (from -> to), from != to, numbered without the diagonal.
  std::size_t pair(std::size_t from, std::size_t to) const {
    return from * (ranks - 1) + (to < from ? to : to - 1);
  }
  std::size_t bells_at() const { return cache_line; }
  std::size_t controls_at() const { return bells_at() + ranks * sizeof(doorbell_word); }
  std::size_t claims_at() const { return controls_at() + pairs() * sizeof(ring_control); }
  std::size_t identities_at() const { return claims_at() + group_arenas * sizeof(arena_claim); }
  std::size_t boards_at() const {
    const std::size_t end = identities_at() + ranks * sizeof(process_identity);
    return (end + cache_line - 1) / cache_line * cache_line;
  }
  std::size_t data_at() const {
    const std::size_t end = boards_at() + ranks * sizeof(rank_board);
    return (end + 4095) / 4096 * 4096;  // ring data starts on a page
  }
  // Arena 0 is the host's; 1 to group_arenas the groups' (each laid out
  // for every local rank; a group uses the places of its group ranks).
  // Pages nobody touches cost no memory: a memfd is allocated as written.
  std::size_t arena_at(std::size_t which) const {
    return data_at() + pairs() * ring_bytes + which * arena().bytes();
  }
  arena_layout arena() const { return {ranks, slot_bytes}; }
  std::size_t bytes() const { return arena_at(1 + group_arenas); }
};

[[noreturn]] inline void throw_errno(const char* what) {
  throw std::system_error(errno, std::system_category(), what);
}

// A mapped segment and its file descriptors (the memfd, one eventfd per
// local rank), owned: unmapped and closed on destruction.
class segment {
 public:
  // Makes a new segment (the host's lowest rank does).
  static segment create(std::size_t ranks, segment_sizes sizes) {
    segment s;
    s.layout_ = {ranks, sizes.ring_bytes, sizes.slot_bytes};
    s.memfd_ = ::memfd_create("dcomm-shm", MFD_CLOEXEC);
    if (s.memfd_ < 0) throw_errno("memfd_create");
    if (::ftruncate(s.memfd_, static_cast<off_t>(s.layout_.bytes())) != 0)
      throw_errno("ftruncate of the shared memory segment");
    for (std::size_t i = 0; i < ranks; ++i) {
      const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (fd < 0) throw_errno("eventfd");
      s.bells_.push_back(fd);
    }
    s.map();
    // A fresh memfd reads as zeros; the objects still need constructing.
    auto* h = new (s.base_) segment_header{};
    for (std::size_t i = 0; i < ranks; ++i) new (&s.bell(i)) doorbell_word{};
    for (std::size_t i = 0; i < s.layout_.pairs(); ++i)
      new (s.base_ + s.layout_.controls_at() + i * sizeof(ring_control)) ring_control{};
    for (std::size_t i = 0; i < group_arenas; ++i)
      new (s.base_ + s.layout_.claims_at() + i * sizeof(arena_claim)) arena_claim{};
    for (std::size_t i = 0; i < ranks; ++i) new (&s.identity(i)) process_identity{};
    for (std::size_t i = 0; i < ranks; ++i) new (&s.board(i)) rank_board{};
    const arena_layout a = s.layout_.arena();
    for (std::size_t which_arena = 0; which_arena <= group_arenas; ++which_arena) {
      char* at = s.base_ + s.layout_.arena_at(which_arena);
      for (std::size_t i = 0; i < ranks; ++i) {
        for (std::size_t which = 0; which < 2; ++which)
          new (at + a.record_at(i, which)) arena_record{};
        new (at + a.state_at(i)) arena_rank_state{};
      }
    }
    h->ranks = static_cast<std::uint32_t>(ranks);
    h->ring_bytes = sizes.ring_bytes;
    h->slot_bytes = sizes.slot_bytes;
    // Others map it only after the handover, a message later.
    h->magic = segment_header::expected_magic;
    return s;
  }

  // Maps a segment handed over by the lowest rank (taking the descriptors).
  static segment attach(int memfd, std::vector<int> bells) {
    segment s;
    s.memfd_ = memfd;
    s.bells_ = std::move(bells);
    segment_header h;
    if (::pread(memfd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h) ||
        h.magic != segment_header::expected_magic || h.ranks != s.bells_.size() || h.ranks < 2 ||
        h.ring_bytes == 0 || (h.ring_bytes & (h.ring_bytes - 1)) != 0 || h.slot_bytes == 0 ||
        h.slot_bytes % 4096 != 0)
      throw std::system_error(EPROTO, std::system_category(),
                              "the shared memory segment handed over is not dcomm's");
    s.layout_ = {h.ranks, h.ring_bytes, h.slot_bytes};
    s.map();
    return s;
  }

  segment() = default;
  segment(segment&& o) noexcept { swap(o); }
  segment& operator=(segment&& o) noexcept {
    segment(std::move(o)).swap(*this);
    return *this;
  }
  ~segment() {
    if (base_) ::munmap(base_, layout_.bytes());
    if (memfd_ >= 0) ::close(memfd_);
    for (int fd : bells_) ::close(fd);
  }

  const segment_layout& layout() const { return layout_; }
  std::size_t ranks() const { return layout_.ranks; }
  int memfd() const { return memfd_; }
  const std::vector<int>& bell_fds() const { return bells_; }
  doorbell_word& bell(std::size_t local) {
    return *reinterpret_cast<doorbell_word*>(base_ + layout_.bells_at() +
                                             local * sizeof(doorbell_word));
  }
  ring_control& control(std::size_t from, std::size_t to) {
    return *reinterpret_cast<ring_control*>(base_ + layout_.controls_at() +
                                            layout_.pair(from, to) * sizeof(ring_control));
  }
  // Arena 0: the host's; 1 + i: the one of claims()[i].
  shm::arena arena(std::size_t which = 0) {
    return {reinterpret_cast<std::byte*>(base_ + layout_.arena_at(which)), layout_.arena()};
  }
  arena_claim* claims() { return reinterpret_cast<arena_claim*>(base_ + layout_.claims_at()); }
  process_identity& identity(std::size_t local) {
    return *reinterpret_cast<process_identity*>(base_ + layout_.identities_at() +
                                                local * sizeof(process_identity));
  }
  rank_board& board(std::size_t local) {
    return *reinterpret_cast<rank_board*>(base_ + layout_.boards_at() + local * sizeof(rank_board));
  }
  const char* base() const { return base_; }
  std::byte* data(std::size_t from, std::size_t to) {
    return reinterpret_cast<std::byte*>(base_ + layout_.data_at() +
                                        layout_.pair(from, to) * layout_.ring_bytes);
  }

 private:
  void map() {
    void* p = ::mmap(nullptr, layout_.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
    if (p == MAP_FAILED) throw_errno("mmap of the shared memory segment");
    base_ = static_cast<char*>(p);
  }
  void swap(segment& o) noexcept {
    std::swap(layout_, o.layout_);
    std::swap(base_, o.base_);
    std::swap(memfd_, o.memfd_);
    std::swap(bells_, o.bells_);
  }

  segment_layout layout_{};
  char* base_ = nullptr;
  int memfd_ = -1;
  std::vector<int> bells_;
};

// Rings a doorbell if its owner sleeps. The caller has published what the
// owner should find (a seq_cst fence after the release store), so that
// either the owner's last poll sees it or this sees the owner asleep.
inline void ring(doorbell_word& bell, int fd) {
  std::uint32_t s = bell.state.load(std::memory_order_relaxed);
  if (s != doorbell_word::asleep) return;
  if (!bell.state.compare_exchange_strong(s, doorbell_word::rung, std::memory_order_relaxed))
    return;
  const std::uint64_t one = 1;
  // Fails only when the counter would overflow: the owner is woken anyway.
  [[maybe_unused]] const ssize_t ignored = ::write(fd, &one, sizeof one);
}

}  // namespace dcomm::shm
