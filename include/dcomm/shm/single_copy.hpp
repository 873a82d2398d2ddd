// Large messages between ranks of one host in one copy: the receiver reads
// the sender's buffer with process_vm_readv (Linux's cross memory attach)
// instead of both copying through the ring. OpenMPI's vader BTL (its
// "cma" single-copy mechanism) does the same.
//
// Two things can make such a read wrong, and this guards against both:
//   - the peer's pid as published is not the peer in this rank's pid
//     namespace (ranks in different containers that share a host's
//     network and IPC): a rank publishes its pid, where it mapped the
//     segment and a random nonce; a peer reads the nonce through
//     process_vm_readv at that address and trusts the pid only if it
//     finds the same nonce the segment holds;
//   - the sender gave its buffer back (its call failed, the link closed)
//     while the receiver read it: the sender bumps a `withdrawn` counter
//     in the segment first; the receiver checks it after the read and
//     takes the data through the ring instead when it moved.
// Where the kernel refuses (ptrace not permitted: Yama, seccomp, another
// user), the message goes through the ring as before.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>

#include "dcomm/shm/arena.hpp"

namespace dcomm::shm {

// What a rank publishes of itself in the segment (its own cache line).
struct alignas(cache_line) process_identity {
  std::atomic<std::uint64_t> pid{0};  // 0: not published (yet)
  std::uint64_t base = 0;             // where it mapped the segment
  std::uint64_t nonce = 0;            // random, per segment and rank
};

// Why a read failed: refused (never try that peer again) or not (this
// message goes through the ring; the next may try again).
enum class read_result { done, refused, failed };

// Reads n bytes at `from` in process `pid` into `to`.
inline read_result read_process(std::uint64_t pid, void* to, std::uint64_t from, std::size_t n) {
  auto* dst = static_cast<char*>(to);
  while (n) {
    iovec local{dst, n};
    iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(from)), n};
    const ssize_t got = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno == EPERM || errno == EACCES || errno == ENOSYS ? read_result::refused
                                                                  : read_result::failed;
    }
    if (got == 0) return read_result::failed;
    dst += got;
    from += static_cast<std::uint64_t>(got);
    n -= static_cast<std::size_t>(got);
  }
  return read_result::done;
}

// Whether `id` (a peer's published identity, in a segment this process
// mapped at `segment_base`) is that peer as this process sees it: its
// pid's memory holds the nonce where that peer mapped the segment.
inline bool is_reachable(const process_identity& id, const char* segment_base) {
  const std::uint64_t pid = id.pid.load(std::memory_order_acquire);
  if (pid == 0) return false;
  const auto offset =
      static_cast<std::uint64_t>(reinterpret_cast<const char*>(&id.nonce) - segment_base);
  std::uint64_t seen = 0;
  return read_process(pid, &seen, id.base + offset, sizeof seen) == read_result::done &&
         seen == id.nonce;
}

// What a rank puts in its arena slot at the first step of an all_reduce
// in one copy (cpu/algorithms/shared_memory.hpp): where its buffers are,
// and whether it takes that path (it may read every other member's
// memory, and the path is the faster one for it): the ranks take it only
// where all of them do.
struct buffer_offer {
  std::uint64_t in = 0;
  std::uint64_t out = 0;
  std::uint64_t direct = 0;
};

}  // namespace dcomm::shm
