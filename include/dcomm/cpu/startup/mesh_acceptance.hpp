// The accepting side of the mesh (cpu/startup/mesh.hpp): rank r accepts one
// connection from every higher rank, learning each peer's rank from the
// handshake, and watches every connected peer until the mesh is done.
//
// Anyone may connect to a mesh port while the mesh forms (port scanners,
// health checks, a rank of another job, an attacker): such connections must
// neither stop nor delay the real peers. So the accepting side
//   - handshakes every incoming connection in a coroutine of its own, with
//     its own deadline (handshake_timeout, bounded by the overall one): a
//     silent or slow stranger holds only itself up;
//   - keeps at most max_pending_handshakes in flight. A new connection
//     beyond that closes the oldest one that has sent nothing yet: a real
//     peer sends its hello at once, so a flood of idle connections cannot
//     push it out. When every one in flight has spoken, the newcomer is
//     closed instead (a real peer reconnects: see connect_to in
//     cpu/startup/mesh.hpp);
//   - gives a rank's place to a connection only at the verdict, once it has
//     passed every check (with a token: proved it holds the token), so a
//     stranger claiming a real rank cannot lock the real one out. Without a
//     token a claim is all there is to go on: the first connection to
//     complete the handshake as rank p holds p's place, and a later claim
//     is refused, told why. Set a job token where others can reach the
//     ports.
// Failures of strangers are logged and forgotten.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/cpu/startup/mesh_options.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"

namespace dcomm::cpu::mesh_detail {

inline detail::ip_tcp::acceptor open_acceptor(const asio::any_io_executor& ex,
                                              const std::string& bind_host, int rank) {
  detail::ip_tcp::acceptor acceptor(ex);
  asio::error_code ec;
  detail::ip_tcp::endpoint ep =
      bind_host.empty() ? detail::ip_tcp::endpoint(detail::ip_tcp::v6(), 0)
                        : detail::ip_tcp::endpoint(asio::ip::make_address(bind_host, ec), 0);
  if (ec)
    throw_error(errc::invalid_argument, {.operation = "tcp mesh",
                                         .rank = rank,
                                         .address = bind_host,
                                         .detail = "bind_host must be an IP address"});
  acceptor.open(ep.protocol(), ec);
  if (ec && bind_host.empty()) {  // no IPv6 here
    ep = detail::ip_tcp::endpoint(detail::ip_tcp::v4(), 0);
    ec.clear();
    acceptor.open(ep.protocol(), ec);
  }
  if (!ec && ep.protocol() == detail::ip_tcp::v6() && bind_host.empty())
    acceptor.set_option(asio::ip::v6_only(false), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    throw_error(errc::invalid_argument, {.operation = "tcp mesh",
                                         .rank = rank,
                                         .address = detail::endpoint_address(ep),
                                         .detail = "cannot listen: " + ec.message()});
  return acceptor;
}

// The accepting side, shared by the accept loop, the handshakes it starts
// and connect_mesh. Everything runs on one executor (a strand or a
// one-thread context), so nothing here is locked.
struct acceptance {
  acceptance(const asio::any_io_executor& ex, int rank_, int world_,
             detail::clock::time_point deadline_, detail::handshake_config config_,
             const mesh_options& options)
      : rank(rank_),
        world(world_),
        deadline(deadline_),
        config(std::move(config_)),
        handshake_timeout(options.handshake_timeout),
        max_pending(std::max<std::size_t>(options.max_pending_handshakes, 1)),
        acceptor(open_acceptor(ex, options.bind_host, rank_)),
        done(ex, deadline_) {
    for (int p = 0; p < world; ++p) sockets.emplace_back(ex);
    taken.assign(static_cast<std::size_t>(world), false);
  }

  struct refusal {
    errc code{};
    std::string reason{};
  };

  const int rank;
  const int world;
  const detail::clock::time_point deadline;
  const detail::handshake_config config;
  const std::chrono::milliseconds handshake_timeout;
  const std::size_t max_pending;
  detail::ip_tcp::acceptor acceptor;
  mesh_sockets sockets;     // accepted peers
  std::vector<bool> taken;  // a proven peer holds (or is being given) the place
  int connected = 0;
  bool finished = false;
  // Handshakes in flight, not yet admitted; the sockets live in their
  // coroutines. Those whose peer has sent nothing yet, oldest first, may
  // be dropped to make room; those that have spoken end by their deadline.
  std::map<std::uint64_t, detail::ip_tcp::socket*> silent;
  std::map<std::uint64_t, detail::ip_tcp::socket*> talking;
  std::uint64_t next_id = 0;
  asio::steady_timer done;  // connect_mesh waits on it: cancelled when all are in
  // Sockets already connected (either way), watched until the mesh is
  // done: one that closes means its rank died in start-up (`lost`).
  std::vector<detail::ip_tcp::socket*> watched;
  struct loss {
    int blamed;               // the rank that died, or the one a goodbye blamed
    int via;                  // the peer whose socket told
    cpu::fail_reason reason;  // the goodbye's (peer_lost: no goodbye, died)
  };
  std::vector<loss> lost;
  // The goodbye this rank said when its mesh failed (mesh.hpp), if it did.
  std::optional<cpu::wire_header> farewell;
  // Why the last connection claiming each missing rank failed.
  std::map<int, refusal> refusals;
  int logged = 0;

  int expected() const { return world - 1 - rank; }
  std::size_t in_flight() const { return silent.size() + talking.size(); }

  // Stops accepting, drops every handshake in flight, stops watching.
  void finish() {
    finished = true;
    asio::error_code ignored;
    acceptor.close(ignored);
    for (auto* group : {&silent, &talking}) {
      for (auto& [id, socket] : *group) socket->close(ignored);
      group->clear();
    }
    for (auto* socket : watched) socket->cancel(ignored);
    watched.clear();
    done.cancel();
  }

  // Logs a refused connection. A port scan can make thousands: after the
  // first few, only at debug level.
  void log_refusal(const std::string& what) {
    static constexpr int loud = 16;
    auto level = logged < loud ? detail::log_level::warning : detail::log_level::debug;
    if (logged++ == loud)
      log(detail::log_level::warning,
          "tcp mesh (rank " + std::to_string(rank) +
              "): further refused connections are logged at debug level");
    log(level, "tcp mesh (rank " + std::to_string(rank) + ") refused a connection: " + what);
  }

  // Records why a connection that claimed a rank still missing failed.
  void note_failure(std::exception_ptr failure, const std::string& address) {
    std::optional<int> claimed;
    refusal r{errc::peer_lost, ""};
    try {
      std::rethrow_exception(failure);
    } catch (const dcomm::error& e) {
      claimed = e.context().rank;  // the server side's context names the peer
      if (e.code().category() == error_category()) r.code = static_cast<errc>(e.code().value());
      r.reason = e.context().detail.empty() ? e.code().message() : e.context().detail;
      log_refusal(e.what());
    } catch (const std::exception& e) {
      log_refusal("from " + address + ": " + e.what());
    }
    if (!claimed || *claimed <= rank || *claimed >= world ||
        taken[static_cast<std::size_t>(*claimed)])
      return;
    auto who = "rank " + std::to_string(*claimed);
    if (r.code == errc::auth_failed)
      r.reason = who + " was refused: " + r.reason + " (from " + address + ")";
    else
      r.reason = who + " connected from " + address + " but its handshake failed: " + r.reason;
    refusals[*claimed] = std::move(r);
  }
};

// Watches a connected peer until the mesh is done. Nothing travels on a
// mesh socket before the transport starts, so it becomes readable only when
// the peer closes it (it died in start-up), says goodbye (its start-up
// failed: the goodbye names the cause), or, done with its own mesh, sends a
// first frame of its transport (alive: the watch ends). The bytes are only
// peeked at: the transport reads them.
DCOMM_EMIT_ON_USE asio::awaitable<void> watch(std::shared_ptr<acceptance> st,
                                              detail::ip_tcp::socket& socket, int peer) {
  st->watched.push_back(&socket);
  for (;;) {
    asio::error_code ec;
    co_await socket.async_wait(detail::ip_tcp::socket::wait_read,
                               asio::redirect_error(asio::use_awaitable, ec));
    // Finished: the socket may have moved on to the transport; leave it be.
    if (st->finished || ec) co_return;
    cpu::wire_header h;
    auto n = ::recv(socket.native_handle(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    // Nothing there: the readiness was spurious (where several threads run
    // the io_context, one may handle a readiness event that was true before
    // the wait began); the peer is still connected.
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n > 0 && static_cast<std::size_t>(n) < sizeof h) {  // the rest is on its way
      asio::steady_timer pause(co_await asio::this_coro::executor, std::chrono::milliseconds(1));
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      if (st->finished) co_return;
      continue;
    }
    if (n > 0 && (h.magic != cpu::wire_magic || h.kind != cpu::msg_kind::bye))
      co_return;  // its transport speaks: alive
    acceptance::loss l{peer, peer, cpu::fail_reason::peer_lost};
    if (n > 0) {
      auto [reason, culprit] = cpu::read_goodbye(h, st->world);
      // Done with start-up and gone again in order: no failure of ours
      // (calls that need it will say so).
      if (reason == cpu::fail_reason::none) co_return;
      if (culprit >= 0 && culprit != st->rank) l = {culprit, peer, reason};
    }
    st->lost.push_back(l);
    st->done.cancel();
    co_return;
  }
}

DCOMM_EMIT_ON_USE asio::awaitable<void> handshake_one(std::shared_ptr<acceptance> st,
                                                      detail::ip_tcp::socket socket) {
  const std::uint64_t id = st->next_id++;
  st->silent[id] = &socket;
  asio::error_code ec;
  auto remote = socket.remote_endpoint(ec);  // fails if the peer has already gone
  const std::string address =
      ec ? std::string("an unknown address") : detail::endpoint_address(remote);
  socket.set_option(detail::ip_tcp::no_delay(true), ec);
  int reserved = -1;
  detail::handshake_admit admit = [&st, &reserved,
                                   id](const detail::handshake_peer& peer) -> std::string {
    if (peer.rank <= st->rank || peer.rank >= st->world)
      return "rank " + std::to_string(st->rank) + " accepts ranks " + std::to_string(st->rank + 1) +
             " to " + std::to_string(st->world - 1) + " only, not rank " +
             std::to_string(peer.rank);
    if (st->taken[static_cast<std::size_t>(peer.rank)])
      return "rank " + std::to_string(peer.rank) + " is already connected to rank " +
             std::to_string(st->rank);
    st->taken[static_cast<std::size_t>(peer.rank)] = true;
    reserved = peer.rank;
    // Proven, and about to hear "accepted": never dropped from now on, or
    // the peer would think itself connected to a closed socket. (At most
    // one per missing rank, so the bound on handshakes still holds.)
    st->talking.erase(id);
    return {};
  };
  const auto deadline = std::min(st->deadline, detail::clock::now() + st->handshake_timeout);
  std::exception_ptr failure;
  detail::handshake_peer peer;
  try {
    // Until the peer says something: meanwhile it may be dropped.
    error_context on_timeout{.operation = "handshake (" + st->config.purpose + ")",
                             .address = address};
    co_await detail::with_deadline(
        socket.async_wait(detail::ip_tcp::socket::wait_read, asio::use_awaitable), deadline,
        on_timeout, [&socket] {
          asio::error_code ignored;
          socket.cancel(ignored);
        });
    if (st->silent.erase(id) > 0) st->talking[id] = &socket;
    peer = co_await server_handshake(socket, st->config, address, deadline, std::move(admit));
  } catch (...) {
    failure = std::current_exception();
  }
  // In neither group any more, yet never admitted: dropped to make room.
  const bool dropped = st->silent.erase(id) + st->talking.erase(id) == 0 && reserved < 0;
  if (st->finished) {
    // Admitted as the mesh failed: the peer thinks itself connected and
    // would blame this rank for the close, so it hears why first.
    if (!failure && st->farewell) {
      [[maybe_unused]] auto sent = ::send(socket.native_handle(), &*st->farewell,
                                          sizeof *st->farewell, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    co_return;
  }
  if (!failure) {
    auto& placed = st->sockets[static_cast<std::size_t>(peer.rank)];
    placed = std::move(socket);
    asio::co_spawn(co_await asio::this_coro::executor, watch(st, placed, peer.rank),
                   asio::detached);
    if (++st->connected == st->expected()) st->done.cancel();
    co_return;
  }
  if (reserved >= 0) st->taken[static_cast<std::size_t>(reserved)] = false;
  if (dropped) {
    log(detail::log_level::debug, "tcp mesh (rank " + std::to_string(st->rank) + "): dropped " +
                                      address + " to make room for new connections");
    co_return;
  }
  st->note_failure(failure, address);
}

// Drops the oldest connection in flight that has sent nothing; false if
// there is none. One whose bytes wait unread has spoken, though its
// coroutine has not seen it yet: a real peer's hello is usually there by the
// time it is accepted, so it is never the one dropped.
inline bool make_room(acceptance& st) {
  while (!st.silent.empty()) {
    auto oldest = st.silent.begin();
    asio::error_code ec;
    if (oldest->second->available(ec) > 0 && !ec) {
      st.talking.insert(*oldest);
      st.silent.erase(oldest);
      continue;
    }
    oldest->second->close(ec);
    st.silent.erase(oldest);
    return true;
  }
  return false;
}

DCOMM_EMIT_ON_USE asio::awaitable<void> accept_loop(std::shared_ptr<acceptance> st) {
  auto executor = co_await asio::this_coro::executor;
  while (!st->finished) {
    asio::error_code ec;
    auto socket = co_await st->acceptor.async_accept(asio::redirect_error(asio::use_awaitable, ec));
    if (st->finished || !st->acceptor.is_open()) break;
    if (ec) {
      // Out of file descriptors and the like: pause, then go on.
      log(detail::log_level::warning,
          "tcp mesh (rank " + std::to_string(st->rank) + ") cannot accept: " + ec.message());
      asio::steady_timer pause(
          executor, std::min(st->deadline, detail::clock::now() + std::chrono::milliseconds(50)));
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      continue;
    }
    if (st->in_flight() >= st->max_pending && !mesh_detail::make_room(*st)) {
      // Everyone in flight has spoken: the newcomer waits its turn (a real
      // peer reconnects; a stranger's handshake ends by its deadline).
      log(detail::log_level::debug,
          "tcp mesh (rank " + std::to_string(st->rank) +
              "): too many handshakes in flight; closed a new connection");
      socket.close(ec);
      continue;
    }
    asio::co_spawn(executor, handshake_one(st, std::move(socket)), asio::detached);
  }
}

}  // namespace dcomm::cpu::mesh_detail

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::watch<void>(std::shared_ptr<acceptance> st, detail::ip_tcp::socket& socket, int peer) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::handshake_one<void>(std::shared_ptr<acceptance> st, detail::ip_tcp::socket socket) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::accept_loop<void>(std::shared_ptr<acceptance> st) -> asio::awaitable<void>)
// clang-format on
// End of the separate-compilation block.
