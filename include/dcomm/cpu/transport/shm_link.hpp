// A link to a peer on the same host (cpu/transport/transport.hpp's make_link
// decides which): the same frames as on a socket, written to and read from
// a pair of shared memory rings (shm/channel.hpp), so that matching,
// mismatch detection, probes, failure forwarding and goodbyes work
// unchanged. The mesh's socket to such a peer carries nothing; it stays
// open so that the kernel tells when the peer is gone (closed, killed,
// crashed) at once.
//
// Its bytes are found by polling: the transport's host machinery
// (cpu/transport/impl/shm_links.hpp: the spin, the doorbell, the arenas)
// looks at the rings, takes small messages in place, wakes the reader and
// resumes a writer that waits for room through the public members below.
// A large message's rts may offer the sender's buffer, which the receiver
// then reads in one copy (shm/single_copy.hpp).
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "dcomm/cpu/transport/link.hpp"
#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/task.hpp"
#include "dcomm/shm/channel.hpp"
#include "dcomm/shm/segment.hpp"
#include "dcomm/shm/single_copy.hpp"

namespace dcomm::cpu {

class shm_link final : public link {
 public:
  // This rank is `me` and the peer `local` among the ranks of `seg`;
  // `socket`: the mesh's, watched for the peer's end. `single_copy`:
  // large sends are offered, and offers read, where the kernel allows.
  shm_link(detail::ip_tcp::socket socket, asio::any_io_executor ex, shm::segment& seg,
           std::size_t me, std::size_t local, int rank, bool single_copy)
      : link({.carries = transports::shm, .cheap_reads = true, .polled = true, .host_arena = true}),
        ring(seg, me, local),
        local(local),
        socket_(std::move(socket)),
        ex_(std::move(ex)),
        segment_(seg),
        rank_(rank),
        single_copy_(single_copy) {}

  void start() override;
  void write() override;
  bool offer(wire_header& rts, const void* buffer) override {
    if (!single_copy_) return false;
    rts.cookie2 = reinterpret_cast<std::uintptr_t>(buffer);
    rts.extra = ring.withdrawn_here();
    return true;
  }
  void withdraw_offer() override { ring.withdraw(); }

  std::size_t read_now(void* dst, std::size_t n) override { return ring.read_some(dst, n); }
  detail::task<std::size_t> read(void* dst, std::size_t n, bool all) override {
    return read_ring(static_cast<char*>(dst), n, all);
  }
  bool read_offered(void* dst, std::size_t n, const wire_header& rts) override;

  bool open() const override { return socket_.is_open(); }
  void shut_for_sending(const wire_header& bye) override {
    goodbye_on_socket(bye);
    shut_ = true;
    asio::error_code ignored;
    socket_.shutdown(detail::ip_tcp::socket::shutdown_send, ignored);
  }
  std::size_t unacknowledged() override { return ring.unread_by_peer(); }
  void close(const wire_header* bye) override;
  void goodbye_to_mesh(const wire_header& bye) override {
    if (!socket_.is_open()) return;
    [[maybe_unused]] auto sent =
        ::send(socket_.native_handle(), &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
  }

  // Whether this rank may read the peer's memory (single_copy and the
  // kernel; asked once), and a read of it (shm::read_process's answer; a
  // refusal marks the link).
  bool may_read();
  shm::read_result read_memory(void* to, std::uint64_t from, std::size_t n);
  std::uint64_t peer_pid() const {
    return segment_.identity(local).pid.load(std::memory_order_relaxed);
  }

  // For the host machinery (cpu/transport/impl/shm_links.hpp).
  shm::channel ring;
  const std::size_t local;  // the peer's place in the segment
  // The reader waits in `readable` (on `wake`, its timer, which a poll
  // cancels once the ring has bytes).
  asio::steady_timer* wake = nullptr;
  bool reader_waiting = false;
  bool writer_blocked = false;  // the ring was full
  bool peer_gone = false;       // what its ring holds is all there will be
  // What an arena step waits to have read from the ring before it ends
  // (transport::arena_rings_read).
  std::uint64_t read_before_step = 0;
  // Wakes the reader if it waits and the ring has bytes (or the peer is
  // gone): whether it did.
  bool wake_reader() {
    if (!reader_waiting || !(ring.readable() || peer_gone)) return false;
    reader_waiting = false;
    if (wake) wake->cancel();
    return true;
  }

 private:
  DCOMM_EMIT_ON_USE detail::task<std::size_t> read_ring(char* dst, std::size_t n, bool all);
  DCOMM_EMIT_ON_USE detail::task<void> readable();
  DCOMM_EMIT_ON_USE detail::task<void> watch(std::shared_ptr<link_events> keep);
  // The socket gets the goodbye too, for a peer still in its mesh, which
  // watches only the socket (cpu/startup/mesh_acceptance.hpp): gone in
  // order, or because of whom. Once, and before the socket is shut for
  // sending (a send after that fails); only once every frame is in the
  // ring, which the peer reads to the end.
  void goodbye_on_socket(const wire_header& bye) {
    if (shut_ || bye_sent_) return;
    bye_sent_ = true;
    [[maybe_unused]] const auto sent =
        ::send(socket_.native_handle(), &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
  }

  detail::ip_tcp::socket socket_;
  asio::any_io_executor ex_;
  shm::segment& segment_;
  int rank_;
  bool single_copy_;
  bool shut_ = false;
  bool bye_sent_ = false;
  std::size_t frame_written_ = 0;  // of the front frame, its header included
  enum class direct_reads : std::uint8_t { untried, allowed, refused };
  direct_reads direct_ = direct_reads::untried;
};

}  // namespace dcomm::cpu

// The bodies: header-only everywhere, in the separate-compilation mode
// in the library alone (DCOMM_DECL, detail/asio.hpp).
#if !defined(DCOMM_SEPARATE_COMPILATION) || defined(DCOMM_SOURCE)
#include "dcomm/cpu/transport/impl/shm_link.hpp"
#endif

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_link::read_ring<void>(char* dst, std::size_t n, bool all) -> detail::task<std::size_t>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_link::readable<void>() -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_link::watch<void>(std::shared_ptr<link_events> keep) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
