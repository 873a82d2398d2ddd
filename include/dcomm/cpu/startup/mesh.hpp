// The full mesh of peer connections a CPU backend runs on: one authenticated
// socket per pair of ranks, found through the store.
//
//   1. every rank listens on bind_host:0 and publishes "<prefix>/addr/<rank>"
//      = "<advertise_host> <port>";
//   2. rank r connects to every lower rank (reading its address from the
//      store; this file) while it accepts one connection from every higher
//      rank (cpu/startup/mesh_acceptance.hpp, which also keeps strangers from
//      stopping or delaying the real peers);
//   3. every connection opens with the dcomm handshake (purpose
//      "tcp_backend", the job token if set); the accepting side learns the
//      peer's rank from it.
// Everything shares one deadline; a timeout names the peers still missing,
// and why the last connection that claimed each of them was refused.
//
// The connecting side retries a handshake that broke halfway (reset, end of
// file: the peer was busy or dropped us) until the deadline; a refusal
// (auth_failed) or a peer that does not speak the protocol is final.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/cpu/startup/mesh_acceptance.hpp"
#include "dcomm/cpu/startup/mesh_options.hpp"
#include "dcomm/cpu/startup/published.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm::cpu {

namespace mesh_detail {

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

// Rank `peer`'s mesh address, read from the store. A store that failed
// blames whom it names (its host's notice: the cause the host left for).
DCOMM_EMIT_ON_USE asio::awaitable<std::string> read_address(std::shared_ptr<store> s, int rank,
                                                            int peer, const std::string& key,
                                                            detail::clock::time_point deadline) {
  std::exception_ptr failure;
  try {
    co_return co_await s->get(key, detail::time_left(deadline));
  } catch (...) {
    failure = std::current_exception();
  }
  rethrow_unpublished(failure, "tcp mesh", rank, peer, key, "mesh address");
}

// How long one round of connection attempts lasts before the store is asked
// again: a peer that refuses after publishing its address has left start-up,
// often because of another rank; when it hosts the store, its clients hear
// the cause it left for (its notice), and that names the culprit.
inline constexpr auto store_recheck_interval = std::chrono::milliseconds(250);

// Connects to lower rank `peer` and completes the handshake, retrying a
// handshake that broke halfway until the deadline.
DCOMM_EMIT_ON_USE asio::awaitable<detail::ip_tcp::socket> connect_to(
    std::shared_ptr<store> s, int rank, int peer, const mesh_options& options,
    const detail::handshake_config& config, detail::clock::time_point deadline) {
  auto executor = co_await asio::this_coro::executor;
  const std::string key = options.key_prefix + "/addr/" + std::to_string(peer);
  std::string where = co_await read_address(s, rank, peer, key, deadline);
  std::exception_ptr failure;
  auto [host, port] = parse_address(where, rank, key);
  const std::string address = detail::tcp_address(host, port);

  auto backoff = std::chrono::milliseconds(10);
  // The handshakes that broke, and the last one's failure: where the
  // deadline then cuts an attempt short, the peer's own words are the cause.
  int breaks = 0;
  std::exception_ptr last_break;
  for (;;) {
    bool broken = false, unreachable = false;
    try {
      const auto round_end = std::min(deadline, detail::clock::now() + store_recheck_interval);
      auto socket = co_await detail::connect_with_retry(host, port, round_end, "tcp mesh");
      co_await client_handshake(socket, config, address, deadline);
      co_return socket;
    } catch (const dcomm::error& e) {
      failure = std::current_exception();
      broken = e.code() == errc::peer_lost;
      unreachable = e.code() == errc::connect_failed;
    } catch (...) {
      failure = std::current_exception();
    }
    if (broken) {
      ++breaks;
      last_break = failure;
    }
    if (unreachable && detail::clock::now() < deadline) {
      // Not listening (yet, or any more): ask the store, which fails naming
      // the cause if its host left start-up, and try again.
      co_await read_address(s, rank, peer, key, deadline);
      continue;
    }
    // A refusal, a stranger's server: final. A reset or an end of file: the
    // peer may have been busy or dropped us; try again until the deadline.
    const bool at_deadline = detail::clock::now() + backoff >= deadline;
    if (!broken && !(at_deadline && breaks > 0)) rethrow_for_peer(failure, rank, peer, address);
    if (at_deadline) {
      if (broken && breaks == 1) rethrow_for_peer(failure, rank, peer, address);
      throw_error(
          errc::connect_failed,
          {.operation = "tcp mesh",
           .rank = rank,
           .peers = "rank " + std::to_string(peer),
           .address = address,
           .detail = "the handshake broke " +
                     (breaks == 1 ? std::string("once") : std::to_string(breaks) + " times") +
                     " until the deadline" +
                     (broken ? "" : " (the last attempt: " + detail::message_of(failure) + ")") +
                     "; last break: " + detail::message_of(last_break)});
    }
    log(detail::log_level::debug, "tcp mesh (rank " + std::to_string(rank) +
                                      "): handshake with rank " + std::to_string(peer) + " at " +
                                      address + " broke; retrying");
    asio::steady_timer pause(executor, detail::clock::now() + backoff);
    co_await pause.async_wait(asio::use_awaitable);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
}

// The mesh failed here: every peer already connected hears why (a goodbye
// in the transport's format, blaming `culprit`), so that it names the cause
// and not this rank. Nothing else has been sent on these sockets, so the
// few bytes go out at once, without blocking.
inline void say_goodbye(mesh_sockets& sockets, cpu::fail_reason reason, int culprit) {
  const auto bye = cpu::goodbye(reason, culprit);
  for (auto& socket : sockets)
    if (socket.is_open()) {
      [[maybe_unused]] auto sent =
          ::send(socket.native_handle(), &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
}

// The same, and a peer whose handshake this rank had just admitted (it
// thinks itself connected; handshake_one still holds its socket) hears it
// too, as that handshake ends.
inline void say_goodbye(acceptance& st, mesh_sockets& sockets, cpu::fail_reason reason,
                        int culprit) {
  st.farewell = cpu::goodbye(reason, culprit);
  say_goodbye(sockets, reason, culprit);
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

// What a start-up failure says in goodbyes: its reason, and the one rank
// it blames (-1: none, or several).
inline std::pair<cpu::fail_reason, int> cause_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const dcomm::error& e) {
    const int culprit = single_rank(e.context().peers);
    if (e.code() == errc::peer_lost) return {cpu::fail_reason::peer_lost, culprit};
    if (e.code() == errc::timeout) return {cpu::fail_reason::timeout, culprit};
    return {cpu::fail_reason::other, culprit};
  } catch (...) {
  }
  return {cpu::fail_reason::other, -1};
}

// Step 1: publishes where this rank listens, for the higher ranks to read.
DCOMM_EMIT_ON_USE asio::awaitable<void> publish_address(std::shared_ptr<store> s,
                                                        const acceptance& st,
                                                        const mesh_options& options) {
  const std::string key = options.key_prefix + "/addr/" + std::to_string(st.rank);
  const std::string here =
      options.advertise_host + " " + std::to_string(st.acceptor.local_endpoint().port());
  std::exception_ptr failure;
  try {
    // Public store operations: they run on the store's executor, not ours.
    co_await s->set(key, here);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure)
    detail::rethrow_as_dcomm_error(failure, {.operation = "tcp mesh",
                                             .rank = st.rank,
                                             .key = key,
                                             .detail = "cannot publish this rank's address"});
}

// Step 2 (while the accept loop runs): connects to every lower rank in turn,
// watching each one connected, until a connected rank is lost. Returns the
// failure to connect, if any.
DCOMM_EMIT_ON_USE asio::awaitable<std::exception_ptr> connect_down(std::shared_ptr<store> s,
                                                                   std::shared_ptr<acceptance> st,
                                                                   const mesh_options& options,
                                                                   mesh_sockets& sockets) {
  auto executor = co_await asio::this_coro::executor;
  std::exception_ptr failure;
  try {
    for (int p = 0; p < st->rank && st->lost.empty(); ++p) {
      auto& socket = sockets[static_cast<std::size_t>(p)];
      socket = co_await connect_to(s, st->rank, p, options, st->config, st->deadline);
      asio::co_spawn(executor, watch(st, socket, p), asio::detached);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  co_return failure;
}

// Step 4: the higher ranks accepted so far join the lower ones, for the
// goodbyes if the mesh failed, else as the mesh.
inline void take_accepted(acceptance& st, mesh_sockets& sockets) {
  for (int p = st.rank + 1; p < st.world; ++p)
    if (st.sockets[static_cast<std::size_t>(p)].is_open())
      sockets[static_cast<std::size_t>(p)] = std::move(st.sockets[static_cast<std::size_t>(p)]);
}

// A rank that connected and then closed died in start-up: the first
// cause, before anything that followed from it.
[[noreturn]] inline void fail_lost(acceptance& st, mesh_sockets& sockets) {
  const auto first = st.lost.front();
  const bool died = first.via == first.blamed;
  say_goodbye(st, sockets, died ? cpu::fail_reason::peer_lost : first.reason, first.blamed);
  throw_error(!died && first.reason == cpu::fail_reason::timeout ? errc::timeout : errc::peer_lost,
              {.operation = "tcp mesh",
               .rank = st.rank,
               .peers = "rank " + std::to_string(first.blamed),
               .detail = died ? "it connected, then closed its connection during start-up (died?)"
                              : "rank " + std::to_string(first.via) + " left start-up after " +
                                    cpu::describe(first.reason) + " it blamed on rank " +
                                    std::to_string(first.blamed)});
}

// A failed connect names the peer it could not reach.
[[noreturn]] inline void fail_connect(acceptance& st, std::exception_ptr failure,
                                      mesh_sockets& sockets) {
  int culprit = -1;
  try {
    std::rethrow_exception(failure);
  } catch (const dcomm::error& e) {
    culprit = single_rank(e.context().peers);
  } catch (...) {
  }
  say_goodbye(st, sockets, cpu::fail_reason::other, culprit);
  std::rethrow_exception(failure);
}

// Higher ranks that did not connect by the deadline: a timeout naming them,
// with why the last connection that claimed each was refused.
inline void check_all_in(acceptance& st, mesh_sockets& sockets) {
  std::vector<int> missing;
  std::string reasons;
  errc code = errc::timeout;
  for (int p = st.rank + 1; p < st.world; ++p) {
    if (sockets[static_cast<std::size_t>(p)].is_open()) continue;
    missing.push_back(p);
    if (auto it = st.refusals.find(p); it != st.refusals.end()) {
      reasons += "; " + it->second.reason;
      if (it->second.code == errc::auth_failed) code = errc::auth_failed;
    }
  }
  if (missing.empty()) return;
  say_goodbye(st, sockets, cpu::fail_reason::timeout, missing.size() == 1 ? missing.front() : -1);
  throw_error(code, {.operation = "tcp mesh",
                     .rank = st.rank,
                     .peers = "ranks " + detail::format_ranks(missing),
                     .detail = "these peers did not connect by the deadline" + reasons});
}

}  // namespace mesh_detail

// Connects rank `rank` of `world` to every other rank through the store `s`
// (see the top of this file); one deadline for all of it. On failure, every
// peer connected so far hears why, and the error names the culprit.
DCOMM_EMIT_ON_USE asio::awaitable<mesh_sockets> connect_mesh(std::shared_ptr<store> s, int rank,
                                                             int world, mesh_options options,
                                                             detail::clock::time_point deadline) {
  using namespace mesh_detail;
  detail::require_crypto_for(options.job_token, "tcp mesh");
  auto executor = co_await asio::this_coro::executor;
  detail::handshake_config config{
      .purpose = options.purpose, .token = options.job_token, .rank = rank};
  auto st = std::make_shared<acceptance>(executor, rank, world, deadline, config, options);
  co_await publish_address(s, *st, options);

  // Accept from above while connecting down. No deadlock: a rank only ever
  // waits on lower ranks while connecting, and every rank accepts at once.
  if (st->expected() > 0) asio::co_spawn(executor, accept_loop(st), asio::detached);
  mesh_sockets sockets;
  for (int p = 0; p < world; ++p) sockets.emplace_back(executor);
  const std::exception_ptr failure = co_await connect_down(s, st, options, sockets);
  // Step 3: until every higher rank is in, a connected rank is lost, or the
  // deadline (the timer's own): the check and the wait run without a
  // handler between them, so a cancel() cannot fall between.
  if (!failure && st->lost.empty() && st->connected < st->expected()) {
    asio::error_code ignored;
    co_await st->done.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  }
  st->finish();
  take_accepted(*st, sockets);
  if (!st->lost.empty()) fail_lost(*st, sockets);
  if (failure) fail_connect(*st, failure, sockets);
  check_all_in(*st, sockets);
  co_return sockets;
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::read_address<void>(std::shared_ptr<store> s, int rank, int peer, const std::string& key, detail::clock::time_point deadline) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::connect_to<void>(std::shared_ptr<store> s, int rank, int peer, const mesh_options& options, const detail::handshake_config& config, detail::clock::time_point deadline) -> asio::awaitable<detail::ip_tcp::socket>)
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::publish_address<void>(std::shared_ptr<store> s, const acceptance& st, const mesh_options& options) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::mesh_detail::connect_down<void>(std::shared_ptr<store> s, std::shared_ptr<acceptance> st, const mesh_options& options, mesh_sockets& sockets) -> asio::awaitable<std::exception_ptr>)
DCOMM_INSTANTIATE(auto dcomm::cpu::connect_mesh<void>(std::shared_ptr<store> s, int rank, int world, mesh_options options, detail::clock::time_point deadline) -> asio::awaitable<mesh_sockets>)
// clang-format on
// End of the separate-compilation block.
