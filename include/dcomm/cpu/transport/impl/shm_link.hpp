// shm_link's bodies (cpu/transport/shm_link.hpp).
#pragma once

#include "dcomm/cpu/transport/shm_link.hpp"

namespace dcomm::cpu {

// Writing: the queue's frames in order, as far as the ring has room; the
// rest once the reader made some (the host machinery's poll calls write
// again). A send is done once its frame is in the ring: the buffer is free
// again.
DCOMM_DECL void shm_link::write() {
  if (writer_blocked || !socket_.is_open()) return;
  send_queue& q = *queue_;
  while (!q.frames.empty()) {
    outgoing_frame& f = q.frames.front();
    std::size_t& done = frame_written_;
    if (done == 0 && f.cancelled) {
      q.frames.pop_front();
      continue;
    }
    constexpr std::size_t header_bytes = sizeof(wire_header);
    const std::size_t total = header_bytes + f.bytes;
    if (done < header_bytes)
      done += ring.write_some(reinterpret_cast<const char*>(&f.header) + done, header_bytes - done);
    if (done >= header_bytes && done < total)
      done += ring.write_some(static_cast<const char*>(f.payload) + (done - header_bytes),
                              total - done);
    if (done < total) {
      // The ring is full: the frame goes on once the peer has read. It is
      // in progress (batch 1): a failed call's cancel leaves it be.
      q.batch = 1;
      if (f.item) f.item->in_flight = true;
      ring.flush();
      if (ring.writable()) continue;
      writer_blocked = true;
      return;
    }
    done = 0;
    q.batch = 1;
    owner_->written(peer_, 1, total, {});
  }
  ring.flush();
}

// Reads from the ring, waiting in `readable` while it is empty.
DCOMM_EMIT_ON_USE_DEFINITION detail::task<std::size_t> shm_link::read_ring(char* dst, std::size_t n,
                                                                           bool all) {
  std::size_t got = 0;
  for (;;) {
    got += ring.read_some(dst ? dst + got : nullptr, n - got);
    if (got == n || (got > 0 && !all)) co_return got;
    co_await readable();
  }
}

// Waits until the ring from the peer holds bytes; throws once the link is
// closed here (operation_aborted) or the peer is gone and everything it
// wrote has been read (eof), as a socket read would.
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> shm_link::readable() {
  // Its own timer, in this frame: an I/O object must not outlive its
  // io_context, and the transport may.
  asio::steady_timer timer(socket_.get_executor(), detail::clock::time_point::max());
  struct forget {
    shm_link& l;
    ~forget() {
      l.wake = nullptr;
      l.reader_waiting = false;
    }
  } guard{*this};
  for (;;) {
    if (!socket_.is_open()) throw asio::system_error(asio::error::operation_aborted);
    if (ring.readable()) co_return;
    if (peer_gone) throw asio::system_error(asio::error::eof);
    // Every frame read so far is handled: what waits on them may go on.
    owner_->reader_idle();
    wake = &timer;
    reader_waiting = true;
    co_await timer.async_wait(detail::use_task);
    wake = nullptr;
    reader_waiting = false;
    timer.expires_at(detail::clock::time_point::max());
  }
}

DCOMM_DECL void shm_link::start() {
  detail::start(ex_, watch(owner_->keep_alive()), detail::ignore_end{});
}

// Nothing is written to the socket: it becomes readable only when the peer
// closes it or dies. Readiness can be spurious where several threads run
// the io_context (one of them may handle a readiness event of the socket's
// after this wait began that was true before it: a socket not yet
// connected reports a hang-up): a peek that would block means the peer is
// still there.
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> shm_link::watch(std::shared_ptr<link_events> keep) {
  asio::error_code ec;
  for (;;) {
    std::tie(ec) = co_await socket_.async_wait(asio::socket_base::wait_read, detail::use_task);
    if (ec) break;
    wire_header h;
    const auto n = ::recv(socket_.native_handle(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    // A peer that left start-up before its transport ran said why on the
    // socket (mesh_detail::say_goodbye, goodbye_to_mesh): its goodbye names
    // the culprit, as one through the ring would.
    if (n == static_cast<ssize_t>(sizeof h) && h.magic == wire_magic && h.kind == msg_kind::bye)
      keep->heard_goodbye(peer_, h);
    break;
  }
  peer_gone = true;
  if (reader_waiting) {
    reader_waiting = false;
    if (wake) wake->cancel();
  }
  // A writer waiting for room that a gone peer will never make.
  if (writer_blocked && !ec) keep->lose(peer_, "writing to it failed: it closed the connection");
}

DCOMM_DECL void shm_link::close(const wire_header* bye) {
  if (bye) goodbye_on_socket(*bye);
  asio::error_code ignored;
  socket_.shutdown(detail::ip_tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  // A frame half written stays so: its send is no longer in progress (a
  // socket's write would end with an error here). The reader stops
  // (readable throws).
  if (frame_written_ > 0 && !queue_->frames.empty())
    if (io_item* it = queue_->frames.front().item) {
      it->in_flight = false;
      it->op->wake();
    }
  frame_written_ = 0;
  queue_->batch = 0;
  writer_blocked = false;
  if (wake) wake->cancel();
}

DCOMM_DECL bool shm_link::may_read() {
  if (!single_copy_ || direct_ == direct_reads::refused) return false;
  if (direct_ == direct_reads::untried) {
    direct_ = shm::is_reachable(segment_.identity(local), segment_.base()) ? direct_reads::allowed
                                                                           : direct_reads::refused;
    if (direct_ == direct_reads::refused)
      log(detail::log_level::info, "rank " + std::to_string(rank_) + " cannot read rank " +
                                       std::to_string(peer_) +
                                       "'s memory (process_vm_readv): its large messages and "
                                       "collectives go through shared memory in two copies");
  }
  return direct_ == direct_reads::allowed;
}

DCOMM_DECL shm::read_result shm_link::read_memory(void* to, std::uint64_t from, std::size_t n) {
  const auto read = shm::read_process(peer_pid(), to, from, n);
  if (read == shm::read_result::refused) direct_ = direct_reads::refused;
  if (read == shm::read_result::done) bytes_read_directly += n;
  return read;
}

// A large message offered at rts.cookie2: read into the receive's buffer at
// once. False: it goes through the ring (the kernel refused, the peer is
// not the process its identity says, or the peer withdrew an offer
// meanwhile, perhaps this one: then what was read may be torn, and the
// ring brings it again if the send still stands).
DCOMM_DECL bool shm_link::read_offered(void* dst, std::size_t n, const wire_header& rts) {
  if (!n || !may_read()) return false;
  if (read_memory(dst, rts.cookie2, n) != shm::read_result::done) return false;
  // The reads above come before this look: unless the count moved, the
  // sender still held the buffer after them.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return ring.withdrawn_by_peer() == rts.extra;
}

}  // namespace dcomm::cpu
