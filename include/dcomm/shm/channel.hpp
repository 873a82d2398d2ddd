// A rank's two rings with one peer on its host, seen as a byte stream each
// way: what the TCP transport writes to a socket it writes here, and reads
// from here what it would read from one (cpu/transport/impl/shm_links.hpp). Single
// producer, single consumer, no locks: the writer owns `head`, the reader
// `tail`, and a byte is the reader's once `head` says so (release/acquire).
//
// Waking follows OpenMPI's sm BTL and UCC's tl/shm in spirit (poll a ring,
// no locks) but not in their way of waiting (they spin, or yield, for as
// long as a call lasts): a rank that stops polling says so in its
// doorbell word and is woken through its eventfd, which the transport's
// executor watches like any socket.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dcomm/shm/segment.hpp"

namespace dcomm::shm {

// What a polling loop does between looks: tells the core it spins.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class channel {
 public:
  // This rank is `me` and the peer `peer`, as local ranks of `seg`.
  channel(segment& seg, std::size_t me, std::size_t peer)
      : out_(seg.control(me, peer)),
        in_(seg.control(peer, me)),
        out_data_(seg.data(me, peer)),
        in_data_(seg.data(peer, me)),
        mask_(seg.layout().ring_bytes - 1),
        peer_bell_(seg.bell(peer)),
        peer_bell_fd_(seg.bell_fds()[peer]) {
    written_ = published_ = tail_seen_ = out_.head.load(std::memory_order_relaxed);
    read_ = head_seen_ = in_.tail.load(std::memory_order_relaxed);
  }
  channel(const channel&) = delete;
  channel& operator=(const channel&) = delete;

  std::size_t capacity() const { return mask_ + 1; }

  // Copies up to n bytes in; returns how many fit. Not visible to the peer
  // before flush().
  std::size_t write_some(const void* src, std::size_t n) {
    std::size_t room = capacity() - static_cast<std::size_t>(written_ - tail_seen_);
    if (room < n) {
      tail_seen_ = out_.tail.load(std::memory_order_acquire);
      room = capacity() - static_cast<std::size_t>(written_ - tail_seen_);
    }
    const std::size_t take = std::min(n, room);
    copy_in(src, take);
    written_ += take;
    return take;
  }
  // Publishes what was written and wakes the peer if it sleeps.
  void flush() {
    if (written_ == published_) return;
    published_ = written_;
    out_.head.store(written_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    ring(peer_bell_, peer_bell_fd_);
  }
  // Whether a write would find room; if not, asks the reader to ring this
  // rank's doorbell once it has made some (and checks again, so that a
  // read made meanwhile is not missed).
  bool writable() {
    if (room() > 0) return true;
    out_.writer_waiting.store(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (room() > 0) {
      out_.writer_waiting.store(0, std::memory_order_relaxed);
      return true;
    }
    return false;
  }
  // Bytes written that the peer has not read yet.
  std::size_t unread_by_peer() const {
    return static_cast<std::size_t>(written_ - out_.tail.load(std::memory_order_acquire));
  }

  // Copies up to n bytes out (dst == nullptr: drops them); returns how many
  // there were. Makes their room free at once.
  std::size_t read_some(void* dst, std::size_t n) {
    std::size_t ready = static_cast<std::size_t>(head_seen_ - read_);
    if (ready < n) {
      head_seen_ = in_.head.load(std::memory_order_acquire);
      ready = static_cast<std::size_t>(head_seen_ - read_);
    }
    const std::size_t take = std::min(n, ready);
    if (take == 0) return 0;
    if (dst) copy_out(dst, take);
    read_ += take;
    in_.tail.store(read_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (in_.writer_waiting.load(std::memory_order_relaxed) &&
        in_.writer_waiting.exchange(0, std::memory_order_relaxed))
      ring(peer_bell_, peer_bell_fd_);
    return take;
  }
  // Bytes the peer has published and this side has not read.
  std::size_t readable_bytes() {
    head_seen_ = in_.head.load(std::memory_order_acquire);
    return static_cast<std::size_t>(head_seen_ - read_);
  }
  // Copies the next n bytes out without reading them: false if fewer are
  // there.
  bool peek(void* dst, std::size_t n) {
    if (static_cast<std::size_t>(head_seen_ - read_) < n && readable_bytes() < n) return false;
    copy_out(dst, n);
    return true;
  }
  // What the peer has published so far (acquire: after a store of its
  // that this rank acquired, it covers every byte written before it).
  std::uint64_t peer_written() const { return in_.head.load(std::memory_order_acquire); }
  // Bytes read so far, in the peer_written() count.
  std::uint64_t consumed() const { return read_; }

  // Large sends offered for a single copy and taken back (shm/single_copy.hpp):
  // the writer counts one before it gives such a buffer back; the reader
  // compares after reading one.
  std::uint32_t withdrawn_here() const { return out_.withdrawn.load(std::memory_order_relaxed); }
  void withdraw() { out_.withdrawn.fetch_add(1, std::memory_order_seq_cst); }
  std::uint32_t withdrawn_by_peer() const { return in_.withdrawn.load(std::memory_order_seq_cst); }
  bool readable() {
    if (head_seen_ != read_) return true;
    head_seen_ = in_.head.load(std::memory_order_acquire);
    return head_seen_ != read_;
  }

 private:
  std::size_t room() {
    tail_seen_ = out_.tail.load(std::memory_order_acquire);
    return capacity() - static_cast<std::size_t>(written_ - tail_seen_);
  }
  void copy_in(const void* src, std::size_t n) {
    const std::size_t at = static_cast<std::size_t>(written_) & mask_;
    const std::size_t first = std::min(n, capacity() - at);
    std::memcpy(out_data_ + at, src, first);
    std::memcpy(out_data_, static_cast<const std::byte*>(src) + first, n - first);
  }
  void copy_out(void* dst, std::size_t n) {
    const std::size_t at = static_cast<std::size_t>(read_) & mask_;
    const std::size_t first = std::min(n, capacity() - at);
    std::memcpy(dst, in_data_ + at, first);
    std::memcpy(static_cast<std::byte*>(dst) + first, in_data_, n - first);
  }

  ring_control& out_;
  ring_control& in_;
  std::byte* out_data_;
  std::byte* in_data_;
  std::size_t mask_;
  doorbell_word& peer_bell_;
  int peer_bell_fd_;
  // This side's view: bytes written (published_ of them made visible), the
  // peer's tail last seen; bytes read, the peer's head last seen.
  std::uint64_t written_ = 0, published_ = 0, tail_seen_ = 0;
  std::uint64_t read_ = 0, head_seen_ = 0;
};

}  // namespace dcomm::shm
