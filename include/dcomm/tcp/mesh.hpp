// The full mesh of peer connections a TCP backend runs on: one authenticated
// socket per pair of ranks, found through the store.
//
//   1. every rank listens on bind_host:0 and publishes "<prefix>/addr/<rank>"
//      = "<advertise_host> <port>";
//   2. rank r connects to every lower rank (reading its address from the
//      store) while it accepts one connection from every higher rank;
//   3. every connection opens with the dcomm handshake (purpose
//      "tcp_backend", the job token if set); the accepting side learns the
//      peer's rank from it.
// Everything shares one deadline; a timeout names the peers still missing,
// and why the last connection that claimed each of them was refused.
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
//     closed instead (a real peer reconnects: see below);
//   - gives a rank's place to a connection only at the verdict, once it has
//     passed every check (with a token: proved it holds the token), so a
//     stranger claiming a real rank cannot lock the real one out. Without a
//     token a claim is all there is to go on: the first connection to
//     complete the handshake as rank p holds p's place, and a later claim
//     is refused, told why. Set a job token where others can reach the
//     ports.
// Failures of strangers are logged and forgotten. The connecting side
// retries a handshake that broke halfway (reset, end of file: the peer was
// busy or dropped us) until the deadline; a refusal (auth_failed) or a
// peer that does not speak the protocol is final.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/tcp/wire_format.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm::tcp {

struct mesh_options {
  std::string purpose = "tcp_backend";
  std::string job_token{};
  // Where to listen; empty: every interface (IPv6 and IPv4).
  std::string bind_host = "";
  // The address the other ranks use to reach this one.
  std::string advertise_host = "127.0.0.1";
  std::string key_prefix = "dcomm/mesh";
  // How long one incoming connection may take over its handshake (never
  // past the overall deadline). A real peer needs one round trip.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(5);
  // Incoming handshakes in flight at once; beyond it the oldest is dropped.
  std::size_t max_pending_handshakes = 64;
};

// sockets[p] is connected to rank p; sockets[rank] stays closed.
using mesh_sockets = std::vector<detail::ip_tcp::socket>;

namespace mesh_detail {

inline detail::ip_tcp::acceptor open_acceptor(const asio::any_io_executor& ex, const std::string& bind_host,
                                   int rank) {
  detail::ip_tcp::acceptor acceptor(ex);
  asio::error_code ec;
  detail::ip_tcp::endpoint ep = bind_host.empty() ? detail::ip_tcp::endpoint(detail::ip_tcp::v6(), 0)
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

// Rethrows a failure to reach `peer` as a dcomm::error that names this rank
// and the peer (besides what it said already).
[[noreturn]] inline void rethrow_for_peer(std::exception_ptr failure, int rank, int peer,
                                          const std::string& address) {
  error_context ctx;
  std::error_code code;
  try {
    detail::rethrow_as_dcomm_error(failure, {.operation = "tcp mesh", .address = address});
  } catch (const dcomm::error& e) {
    ctx = e.context();
    code = e.code();
  }
  if (!ctx.rank) ctx.rank = rank;
  if (ctx.peers.empty()) ctx.peers = "rank " + std::to_string(peer);
  if (ctx.address.empty()) ctx.address = address;
  throw error(code, std::move(ctx));
}

// Rank p's mesh address "host port", as published in the store.
inline std::pair<std::string, std::uint16_t> parse_address(const std::string& where, int rank,
                                                           const std::string& key) {
  auto space = where.rfind(' ');
  unsigned port = 0;
  if (space != std::string::npos && space > 0) {
    const char* first = where.data() + space + 1;
    const char* last = where.data() + where.size();
    auto [end, ec] = std::from_chars(first, last, port);
    if (ec != std::errc{} || end != last || first == last) port = 0;
  }
  if (port == 0 || port > 65535)
    throw_error(errc::protocol_error, {.operation = "tcp mesh",
                                       .rank = rank,
                                       .key = key,
                                       .expected = "\"<host> <port>\"",
                                       .seen = "'" + where + "'"});
  return {where.substr(0, space), static_cast<std::uint16_t>(port)};
}

// Connects to lower rank `peer` and completes the handshake, retrying a
// handshake that broke halfway until the deadline.
inline asio::awaitable<detail::ip_tcp::socket> connect_to(std::shared_ptr<store> s, int rank, int peer,
                                               const mesh_options& options,
                                               const detail::handshake_config& config,
                                               detail::clock::time_point deadline) {
  auto executor = co_await asio::this_coro::executor;
  const std::string key = options.key_prefix + "/addr/" + std::to_string(peer);
  std::string where;
  std::exception_ptr failure;
  try {
    where = co_await s->get(key, detail::time_left(deadline));
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    try {
      detail::rethrow_as_dcomm_error(failure, {});
    } catch (const dcomm::error& e) {
      bool late = e.code() == errc::timeout;
      // The store's own failure (its host lost) blames whom the store names.
      throw error(e.code(),
                  {.operation = "tcp mesh",
                   .rank = rank,
                   .peers = late || e.context().peers.empty() ? "rank " + std::to_string(peer)
                                                              : e.context().peers,
                   .key = key,
                   .address = e.context().address,
                   .detail = late ? "rank " + std::to_string(peer) +
                                        " did not publish its mesh address by the "
                                        "deadline"
                                  : std::string("reading the address: ") + e.what()});
    }
  }
  auto [host, port] = parse_address(where, rank, key);
  const std::string address = detail::tcp_address(host, port);

  auto backoff = std::chrono::milliseconds(10);
  for (int attempt = 1;; ++attempt) {
    bool broken = false;
    try {
      auto socket = co_await detail::connect_with_retry(host, port, deadline, "tcp mesh");
      co_await client_handshake(socket, config, address, deadline);
      co_return socket;
    } catch (const dcomm::error& e) {
      failure = std::current_exception();
      broken = e.code() == errc::peer_lost;
    } catch (...) {
      failure = std::current_exception();
    }
    // A refusal, a stranger's server, the deadline: final. A reset or an
    // end of file: the peer may have been busy or dropped us; try again.
    if (!broken || detail::clock::now() + backoff >= deadline) {
      if (!broken || attempt == 1) rethrow_for_peer(failure, rank, peer, address);
      std::string last;
      try {
        std::rethrow_exception(failure);
      } catch (const std::exception& e) {
        last = e.what();
      }
      throw_error(errc::connect_failed,
                  {.operation = "tcp mesh",
                   .rank = rank,
                   .peers = "rank " + std::to_string(peer),
                   .address = address,
                   .detail = "the handshake broke " + std::to_string(attempt) +
                             " times until the deadline; last: " + last});
    }
    log(detail::log_level::debug, "tcp mesh (rank " + std::to_string(rank) + "): handshake with rank " +
                              std::to_string(peer) + " at " + address + " broke; retrying");
    asio::steady_timer pause(executor, detail::clock::now() + backoff);
    co_await pause.async_wait(asio::use_awaitable);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
}

// The accepting side, shared by the accept loop, the handshakes it starts
// and connect_mesh. Everything runs on one executor (a strand or a
// one-thread context), so nothing here is locked.
struct acceptance {
  acceptance(const asio::any_io_executor& ex, int rank_, int world_, detail::clock::time_point deadline_,
             detail::handshake_config config_, const mesh_options& options)
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
    int blamed;                   // the rank that died, or the one a goodbye blamed
    int via;                      // the peer whose socket told
    tcp::fail_reason reason;  // the goodbye's (peer_lost: no goodbye, died)
  };
  std::vector<loss> lost;
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
      log(detail::log_level::warning, "tcp mesh (rank " + std::to_string(rank) +
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
inline asio::awaitable<void> watch(std::shared_ptr<acceptance> st, detail::ip_tcp::socket& socket, int peer) {
  st->watched.push_back(&socket);
  for (;;) {
    asio::error_code ec;
    co_await socket.async_wait(detail::ip_tcp::socket::wait_read,
                               asio::redirect_error(asio::use_awaitable, ec));
    // Finished: the socket may have moved on to the transport; leave it be.
    if (st->finished || ec) co_return;
    tcp::wire_header h;
    auto n = ::recv(socket.native_handle(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 && static_cast<std::size_t>(n) < sizeof h) {  // the rest is on its way
      asio::steady_timer pause(co_await asio::this_coro::executor, std::chrono::milliseconds(1));
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      if (st->finished) co_return;
      continue;
    }
    if (n > 0 && (h.magic != tcp::wire_magic || h.kind != tcp::msg_kind::bye))
      co_return;  // its transport speaks: alive
    acceptance::loss l{peer, peer, tcp::fail_reason::peer_lost};
    if (n > 0) {
      auto [reason, culprit] = tcp::read_goodbye(h, st->world);
      // Done with start-up and gone again in order: no failure of ours
      // (calls that need it will say so).
      if (reason == tcp::fail_reason::none) co_return;
      if (culprit >= 0 && culprit != st->rank) l = {culprit, peer, reason};
    }
    st->lost.push_back(l);
    st->done.cancel();
    co_return;
  }
}

// The mesh failed here: every peer already connected hears why (a goodbye
// in the transport's format, blaming `culprit`), so that it names the cause
// and not this rank. Nothing else has been sent on these sockets, so the
// few bytes go out at once, without blocking.
inline void say_goodbye(mesh_sockets& sockets, tcp::fail_reason reason, int culprit) {
  const auto bye = tcp::goodbye(reason, culprit);
  for (auto& socket : sockets)
    if (socket.is_open()) {
      [[maybe_unused]] auto sent =
          ::send(socket.native_handle(), &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
}

// The one rank an error blames ("rank 3", "ranks {3}"), or -1.
inline int single_rank(const std::string& peers) {
  int rank = -1, found = 0;
  for (std::size_t i = 0; i < peers.size(); ++i)
    if (std::isdigit(static_cast<unsigned char>(peers[i])) &&
        (i == 0 || !std::isdigit(static_cast<unsigned char>(peers[i - 1])))) {
      rank = std::atoi(peers.c_str() + i);
      ++found;
    }
  return found == 1 && peers.find('-') == std::string::npos ? rank : -1;
}

inline asio::awaitable<void> handshake_one(std::shared_ptr<acceptance> st, detail::ip_tcp::socket socket) {
  const std::uint64_t id = st->next_id++;
  st->silent[id] = &socket;
  asio::error_code ec;
  auto remote = socket.remote_endpoint(ec);  // fails if the peer has already gone
  const std::string address = ec ? std::string("an unknown address") : detail::endpoint_address(remote);
  socket.set_option(detail::ip_tcp::no_delay(true), ec);
  int reserved = -1;
  detail::handshake_admit admit = [&st, &reserved, id](const detail::handshake_peer& peer) -> std::string {
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
    co_await detail::with_deadline(socket.async_wait(detail::ip_tcp::socket::wait_read, asio::use_awaitable), deadline,
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
  if (st->finished) co_return;
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
    log(detail::log_level::debug, "tcp mesh (rank " + std::to_string(st->rank) + "): dropped " + address +
                              " to make room for new connections");
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

inline asio::awaitable<void> accept_loop(std::shared_ptr<acceptance> st) {
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
      log(detail::log_level::debug, "tcp mesh (rank " + std::to_string(st->rank) +
                                "): too many handshakes in flight; closed a new connection");
      socket.close(ec);
      continue;
    }
    asio::co_spawn(executor, handshake_one(st, std::move(socket)), asio::detached);
  }
}

}  // namespace mesh_detail

inline asio::awaitable<mesh_sockets> connect_mesh(std::shared_ptr<store> s, int rank, int world,
                                                  mesh_options options,
                                                  detail::clock::time_point deadline) {
  using namespace mesh_detail;
  detail::require_crypto_for(options.job_token, "tcp mesh");
  auto executor = co_await asio::this_coro::executor;
  detail::handshake_config config{.purpose = options.purpose, .token = options.job_token, .rank = rank};
  auto st = std::make_shared<acceptance>(executor, rank, world, deadline, config, options);
  const std::string key = options.key_prefix + "/addr/" + std::to_string(rank);
  const std::string here =
      options.advertise_host + " " + std::to_string(st->acceptor.local_endpoint().port());
  std::exception_ptr failure;
  try {
    // Public store operations: they run on the store's executor, not ours.
    co_await s->set(key, here);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure)
    detail::rethrow_as_dcomm_error(failure, {.operation = "tcp mesh",
                                     .rank = rank,
                                     .key = key,
                                     .detail = "cannot publish this rank's address"});

  // Accept from above while connecting down. No deadlock: a rank only ever
  // waits on lower ranks while connecting, and every rank accepts at once.
  if (st->expected() > 0) asio::co_spawn(executor, accept_loop(st), asio::detached);
  mesh_sockets sockets;
  for (int p = 0; p < world; ++p) sockets.emplace_back(executor);
  try {
    for (int p = 0; p < rank && st->lost.empty(); ++p) {
      auto& socket = sockets[static_cast<std::size_t>(p)];
      socket = co_await connect_to(s, rank, p, options, config, deadline);
      asio::co_spawn(executor, watch(st, socket, p), asio::detached);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // Until every higher rank is in, a connected rank is lost, or the
  // deadline (the timer's own): the check and the wait run without a
  // handler between them, so a cancel() cannot fall between.
  if (!failure && st->lost.empty() && st->connected < st->expected()) {
    asio::error_code ignored;
    co_await st->done.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  }
  st->finish();
  // Every rank connected so far (either way), for the goodbyes.
  for (int p = rank + 1; p < world; ++p)
    if (st->sockets[static_cast<std::size_t>(p)].is_open())
      sockets[static_cast<std::size_t>(p)] = std::move(st->sockets[static_cast<std::size_t>(p)]);
  // A rank that connected and then closed died in start-up: the first
  // cause, before anything that followed from it.
  if (!st->lost.empty()) {
    const auto first = st->lost.front();
    const bool died = first.via == first.blamed;
    say_goodbye(sockets, died ? tcp::fail_reason::peer_lost : first.reason, first.blamed);
    throw_error(
        !died && first.reason == tcp::fail_reason::timeout ? errc::timeout : errc::peer_lost,
        {.operation = "tcp mesh",
         .rank = rank,
         .peers = "rank " + std::to_string(first.blamed),
         .detail = died ? "it connected, then closed its connection during start-up (died?)"
                        : "rank " + std::to_string(first.via) + " left start-up after " +
                              tcp::describe(first.reason) + " it blamed on rank " +
                              std::to_string(first.blamed)});
  }
  // A failed connect names the peer it could not reach.
  if (failure) {
    int culprit = -1;
    try {
      std::rethrow_exception(failure);
    } catch (const dcomm::error& e) {
      culprit = single_rank(e.context().peers);
    } catch (...) {
    }
    say_goodbye(sockets, tcp::fail_reason::other, culprit);
    std::rethrow_exception(failure);
  }

  std::vector<int> missing;
  std::string reasons;
  errc code = errc::timeout;
  for (int p = rank + 1; p < world; ++p) {
    if (sockets[static_cast<std::size_t>(p)].is_open()) continue;
    missing.push_back(p);
    if (auto it = st->refusals.find(p); it != st->refusals.end()) {
      reasons += "; " + it->second.reason;
      if (it->second.code == errc::auth_failed) code = errc::auth_failed;
    }
  }
  if (!missing.empty()) {
    say_goodbye(sockets, tcp::fail_reason::timeout, missing.size() == 1 ? missing.front() : -1);
    throw_error(code, {.operation = "tcp mesh",
                       .rank = rank,
                       .peers = "ranks " + detail::format_ranks(missing),
                       .detail = "these peers did not connect by the deadline" + reasons});
  }
  co_return sockets;
}

}  // namespace dcomm::tcp
