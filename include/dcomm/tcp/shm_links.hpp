// The transport's links to peers on the same host (tcp/connect.hpp decides
// which): the same frames as on a socket, written to and read from a pair
// of shared memory rings (shm/channel.hpp), so that matching, mismatch
// detection, probes, failure forwarding and goodbyes work unchanged. The
// socket to such a peer carries nothing; it stays open so that the kernel
// tells when the peer is gone (closed, killed, crashed) at once.
//
// Waiting: an operation that waits polls the rings for up to `shm_spin`
// (the readers run between polls); then this rank says in its doorbell
// word that it sleeps, and a peer that writes to it wakes its executor
// through the eventfd, which listen_bell watches. Part of tcp/transport.hpp.
#pragma once

#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>

#include "dcomm/tcp/transport.hpp"

namespace dcomm::tcp {

// Links to the ranks of shm.local go through the segment.
inline void transport::use_shm(shm_links shm) {
  const auto me = std::find(shm.local.begin(), shm.local.end(), rank_);
  shm_me_ = static_cast<int>(me - shm.local.begin());
  for (std::size_t i = 0; i < shm.local.size(); ++i) {
    const int p = shm.local[i];
    if (p == rank_) continue;
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    l.shm = std::make_unique<shm::channel>(*shm.segment, static_cast<std::size_t>(shm_me_), i);
    shm_peers_.push_back(p);
  }
  shm_ = std::move(shm.segment);
  // Every rank on this host: the world group meets in the arena.
  if (static_cast<int>(shm.local.size()) == world_) arena_.emplace(shm_->arena());
}

// Writing: the link's frames in order, as far as the ring has room; the
// rest once the reader made some (poll_shm). A send is done once its
// frame is in the ring: the buffer is free again.
inline void transport::shm_write(int peer) {
  peer_link& l = *links_[static_cast<std::size_t>(peer)];
  if (l.shm_writer_blocked || l.lost || !l.socket.is_open()) return;
  while (!l.frames.empty()) {
    outgoing_frame& f = l.frames.front();
    std::size_t& done = l.shm_frame_written;
    if (done == 0 && f.cancelled) {
      l.frames.pop_front();
      continue;
    }
    constexpr std::size_t header_bytes = sizeof(wire_header);
    const std::size_t total = header_bytes + f.bytes;
    if (done < header_bytes)
      done +=
          l.shm->write_some(reinterpret_cast<const char*>(&f.header) + done, header_bytes - done);
    if (done >= header_bytes && done < total)
      done += l.shm->write_some(static_cast<const char*>(f.payload) + (done - header_bytes),
                                total - done);
    if (done < total) {
      // The ring is full: the frame goes on once the peer has read. It is
      // in progress (batch 1): a failed call's cancel leaves it be.
      l.batch = 1;
      if (f.item) f.item->in_flight = true;
      l.shm->flush();
      if (l.shm->writable()) continue;
      l.shm_writer_blocked = true;
      return;
    }
    done = 0;
    l.batch = 0;
    l.bytes_written += total;
    io_item* it = f.item;
    const std::size_t bytes = f.bytes;
    l.frames.pop_front();
    if (!it) continue;
    it->in_flight = false;
    it->written += bytes;
    if (!it->finished() && (!it->staged || it->written == it->bytes)) complete(*it);
    it->op->wake();  // also when its op is draining
  }
  l.shm->flush();
}

// Reading: waits until the ring from the peer holds bytes; throws once
// the link is closed here (operation_aborted) or the peer is gone and
// everything it wrote has been read (eof), as a socket read would.
inline detail::task<void> transport::shm_readable(peer_link& l) {
  asio::steady_timer wake(l.socket.get_executor(), detail::clock::time_point::max());
  struct forget {
    peer_link& l;
    ~forget() {
      l.shm_wake = nullptr;
      l.shm_reader_waiting = false;
    }
  } guard{l};
  for (;;) {
    if (!l.socket.is_open()) throw asio::system_error(asio::error::operation_aborted);
    if (l.shm->readable()) co_return;
    if (l.shm_peer_gone) throw asio::system_error(asio::error::eof);
    // Every frame read so far is handled: the arena's holder may go on.
    if (arena_reading_rings_) wake_arena_holder();
    l.shm_wake = &wake;
    l.shm_reader_waiting = true;
    co_await wake.async_wait(detail::use_task);
    l.shm_wake = nullptr;
    l.shm_reader_waiting = false;
    wake.expires_at(detail::clock::time_point::max());
  }
}

// Wakes the readers whose rings have bytes (or whose peer is gone) and
// resumes writers that have room again.
// Whether any was.
inline bool transport::poll_shm() {
  bool any = false;
  for (int p : shm_peers_) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (l.shm_reader_waiting && (l.shm->readable() || l.shm_peer_gone)) {
      l.shm_reader_waiting = false;
      if (l.shm_wake) l.shm_wake->cancel();
      any = true;
    }
    if (l.shm_writer_blocked && l.socket.is_open() && l.shm->writable()) {
      l.shm_writer_blocked = false;
      shm_write(p);
      any = true;
    }
  }
  return any;
}

// Nothing is written to the socket of a shared memory link: it becomes
// readable only when the peer closes it or dies.
inline detail::task<void> transport::watch_shm_peer(std::shared_ptr<transport> self, int peer) {
  peer_link& l = *self->links_[static_cast<std::size_t>(peer)];
  auto [ec] = co_await l.socket.async_wait(asio::socket_base::wait_read, detail::use_task);
  // A peer that left start-up before its transport ran said why on the
  // socket (mesh_detail::say_goodbye, transport::leave_start_up): its
  // goodbye names the culprit, as one through the ring would.
  if (!ec && !l.said_bye) {
    wire_header h;
    const auto n = ::recv(l.socket.native_handle(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(sizeof h) && h.magic == wire_magic && h.kind == msg_kind::bye) {
      l.said_bye = true;
      std::tie(l.bye_reason, l.bye_culprit) = read_goodbye(h, self->world_);
    }
  }
  l.shm_peer_gone = true;
  if (l.shm_reader_waiting) {
    l.shm_reader_waiting = false;
    if (l.shm_wake) l.shm_wake->cancel();
  }
  // A writer waiting for room that a gone peer will never make.
  if (l.shm_writer_blocked && !l.lost && !ec)
    self->lose_link(peer, "writing to it failed: it closed the connection");
}

// Start-up failed here after the transport started: goodbyes name the
// rank `failure` blames. Peers still in their own start-up watch only the
// socket (mesh_detail::watch), so a shared memory link's goodbye also goes
// there; nothing else is ever sent on that socket, so it goes out at once.
inline void transport::leave_start_up(const std::exception_ptr& failure) {
  auto [reason, culprit] = mesh_detail::cause_of(failure);
  note_cause(reason, culprit);
  const wire_header bye = goodbye(first_reason_, first_culprit_);
  for (int p : shm_peers_) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (!l.socket.is_open()) continue;
    [[maybe_unused]] auto sent =
        ::send(l.socket.native_handle(), &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
}

// This rank's doorbell: while no operation polls, a peer that writes to
// it finds it asleep and writes its eventfd, which wakes this coroutine.
// The descriptor lives in this frame (an I/O object must not outlive its
// io_context, and the transport may); close_bell_if_unused closes it.
inline detail::task<void> transport::listen_bell(std::shared_ptr<transport> self) {
  const auto me = static_cast<std::size_t>(self->shm_me_);
  const int fd = ::dup(self->shm_->bell_fds()[me]);
  if (fd < 0) co_return;  // out of descriptors: peers' writes are still seen when polling
  asio::posix::stream_descriptor descriptor(self->ex_, fd);
  struct forget {
    transport& t;
    ~forget() { t.bell_ = nullptr; }
  } guard{*self};
  self->bell_ = &descriptor;
  shm::doorbell_word& bell = self->shm_->bell(me);
  std::uint64_t count = 0;
  for (;;) {
    // Asleep first, then a last look: a write made before this store is
    // seen by the poll, one made after rings the bell.
    bell.state.store(shm::doorbell_word::asleep, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    self->poll_shm();
    self->wake_arena_holder();
    // A read, not a wait for readability: the reactor registers the
    // descriptor edge-triggered, and a wait started after the ring's edge
    // would sleep through it (a read is tried at once, and drains).
    auto [ec, n] =
        co_await descriptor.async_read_some(asio::buffer(&count, sizeof count), detail::use_task);
    if (ec || !descriptor.is_open()) co_return;
  }
}

// Polls the links for up to shm_spin, without leaving the executor (a
// yield through a strand would allocate; where the ranks outnumber the
// cores, sched_yield lends the core between looks): true as soon as a reader was
// woken or a writer went on, whose handlers run once the caller waits.
// Peers that write meanwhile find this rank awake and ring no bell.
// `pred` (the waiting op's condition) is polled too: a call in the arena
// waits for stores, not for messages. Once the bell says asleep again,
// the arena's holder is woken for a last look (a peer that arrived while
// this rank polled for another call rang no bell).
template <class Pred>
bool transport::spin_shm(Pred pred) {
  shm::doorbell_word& bell = shm_->bell(static_cast<std::size_t>(shm_me_));
  bell.state.store(shm::doorbell_word::awake, std::memory_order_relaxed);
  const auto until = detail::clock::now() + options_.shm_spin;
  bool found = false;
  for (int i = 0; !(found = poll_shm() || pred()); ++i) {
    if (options_.shm_yield)
      ::sched_yield();
    else
      shm::cpu_relax();
    if (((i & 15) == 15 || options_.shm_yield) && detail::clock::now() >= until) break;
  }
  bell.state.store(shm::doorbell_word::asleep, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  wake_arena_holder();
  return poll_shm() || found || pred();
}

// Once no shared memory link is open, the doorbell closes too (its
// listener holds the transport).
inline void transport::close_bell_if_unused() {
  if (!bell_ || !bell_->is_open()) return;
  for (int p : shm_peers_)
    if (links_[static_cast<std::size_t>(p)]->socket.is_open()) return;
  asio::error_code ignored;
  bell_->close(ignored);
}

// --- the host's arena (tcp/shm_arena.hpp) ---

inline shm::arena* transport::host_arena() {
  return arena_ ? &*arena_ : nullptr;
}

// Only the world group, when every rank is on this host: another group
// keeps its messages (its arena would have to be its own).
inline bool transport::arena_serves(const group_state& g) const {
  return arena_ && g.id == 0 && g.size() == world_ && world_ > 1;
}

// Calls take the arena in the order they queued (the order they started).
inline void transport::queue_for_arena(op_state& op) {
  (arena_last_ ? arena_last_->next_on_arena : arena_first_) = &op;
  arena_last_ = &op;
}

inline void transport::leave_arena(op_state& op) {
  op_state* before = nullptr;
  for (op_state* i = arena_first_; i && i != &op; i = i->next_on_arena) before = i;
  (before ? before->next_on_arena : arena_first_) = op.next_on_arena;
  if (arena_last_ == &op) arena_last_ = before;
  op.next_on_arena = nullptr;
  op.on_arena = false;
  arena_reading_rings_ = false;
  if (!before && arena_first_) arena_first_->wake();  // its turn
}

inline void transport::wake_arena_holder() {
  if (arena_first_) arena_first_->wake();
}

inline std::size_t transport::next_arena_record() {
  const std::size_t r = arena_record_;
  arena_record_ ^= 1;
  return r;
}

// After a release store that a sleeping peer must see: either its last
// look sees the store or this sees it asleep (shm::ring).
inline void transport::ring_local_peers() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const auto& fds = shm_->bell_fds();
  for (std::size_t i = 0; i < fds.size(); ++i)
    if (static_cast<int>(i) != shm_me_) shm::ring(shm_->bell(i), fds[i]);
}

inline bool transport::arena_peer_gone(op_state& op, int peer) {
  if (!links_[static_cast<std::size_t>(peer)]->lost) return false;
  fail_op(op, lost_error(op, peer));
  return true;
}

// Every peer has arrived at the step (its stamp was acquired): what its
// ring to this rank holds now includes every frame it wrote before (a
// report of a send of ours it refused, above all), which must fail this
// call, not the next one.
inline void transport::note_arena_rings() {
  for (int p : shm_peers_) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    l.shm_read_before_step = l.shm->peer_written();
  }
}

// Whether the readers have read that far. A reader handles what it read
// before it waits again (it waits only in shm_readable), and it runs on
// this executor: once the bytes are read, their frames are handled.
inline bool transport::arena_rings_read() {
  for (int p : shm_peers_) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (l.lost || l.shm_peer_gone || !l.socket.is_open()) continue;
    if (l.shm->consumed() < l.shm_read_before_step) {
      arena_reading_rings_ = true;
      return false;
    }
  }
  arena_reading_rings_ = false;
  return true;
}

inline void transport::arena_mismatch(op_state& op, int peer, const call_signature& theirs) {
  mismatched_call(op, peer, theirs);
}

}  // namespace dcomm::tcp
