// The full mesh of peer connections a TCP backend runs on: one authenticated
// socket per pair of ranks, found through the store.
//
//   1. every rank listens on bind_host:0 and publishes "<prefix>/addr/<rank>"
//      = "<advertise_host> <port>";
//   2. rank r connects to every lower rank (reading its address from the
//      store) and accepts one connection from every higher rank;
//   3. every connection opens with the dcomm handshake (purpose
//      "tcp_backend", the job token if set); the accepting side learns the
//      peer's rank from it and refuses out-of-range or duplicate ranks.
// Everything shares one deadline; a timeout names the peers still missing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm::detail {

struct mesh_options {
  std::string purpose = "tcp_backend";
  std::string job_token{};
  // Where to listen; empty: every interface (IPv6 and IPv4).
  std::string bind_host = "";
  // The address the other ranks use to reach this one.
  std::string advertise_host = "127.0.0.1";
  std::string key_prefix = "dcomm/mesh";
};

// sockets[p] is connected to rank p; sockets[rank] stays closed.
using mesh_sockets = std::vector<tcp::socket>;

namespace mesh_detail {

inline tcp::acceptor open_acceptor(const asio::any_io_executor& ex, const std::string& bind_host,
                                   int rank) {
  tcp::acceptor acceptor(ex);
  asio::error_code ec;
  tcp::endpoint ep = bind_host.empty() ? tcp::endpoint(tcp::v6(), 0)
                                       : tcp::endpoint(asio::ip::make_address(bind_host, ec), 0);
  if (ec)
    throw_error(errc::invalid_argument, {.operation = "tcp mesh",
                                         .rank = rank,
                                         .address = bind_host,
                                         .detail = "bind_host must be an IP address"});
  acceptor.open(ep.protocol(), ec);
  if (ec && bind_host.empty()) {  // no IPv6 here
    ep = tcp::endpoint(tcp::v4(), 0);
    ec.clear();
    acceptor.open(ep.protocol(), ec);
  }
  if (!ec && ep.protocol() == tcp::v6() && bind_host.empty())
    acceptor.set_option(asio::ip::v6_only(false), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    throw_error(errc::invalid_argument, {.operation = "tcp mesh",
                                         .rank = rank,
                                         .address = endpoint_address(ep),
                                         .detail = "cannot listen: " + ec.message()});
  return acceptor;
}

}  // namespace mesh_detail

inline asio::awaitable<mesh_sockets> connect_mesh(std::shared_ptr<store> s, int rank, int world,
                                                  mesh_options options,
                                                  clock::time_point deadline) {
  auto executor = co_await asio::this_coro::executor;
  mesh_sockets sockets;
  for (int p = 0; p < world; ++p) sockets.emplace_back(executor);
  const int expected_accepts = world - 1 - rank;
  auto acceptor = mesh_detail::open_acceptor(executor, options.bind_host, rank);
  // Public store operations: they run on the store's executor, not ours.
  co_await s->set(options.key_prefix + "/addr/" + std::to_string(rank),
                  options.advertise_host + " " + std::to_string(acceptor.local_endpoint().port()));
  handshake_config config{.purpose = options.purpose, .token = options.job_token, .rank = rank};

  // Higher ranks connect to us.
  auto accept_all = [&]() -> asio::awaitable<void> {
    int accepted = 0;
    while (accepted < expected_accepts) {
      auto socket = co_await acceptor.async_accept(asio::use_awaitable);
      std::string peer_address = endpoint_address(socket.remote_endpoint());
      try {
        socket.set_option(tcp::no_delay(true));
        auto peer = co_await server_handshake(socket, config, peer_address, deadline);
        if (peer.rank <= rank || peer.rank >= world ||
            sockets[static_cast<std::size_t>(peer.rank)].is_open())
          throw_error(errc::mismatch, {.operation = "tcp mesh",
                                       .rank = rank,
                                       .address = peer_address,
                                       .expected = "a rank in (" + std::to_string(rank) + ", " +
                                                   std::to_string(world) + ") not yet connected",
                                       .seen = "rank " + std::to_string(peer.rank)});
        sockets[static_cast<std::size_t>(peer.rank)] = std::move(socket);
        ++accepted;
      } catch (const dcomm::error& e) {
        // A stranger, or a peer with the wrong token: refuse it, keep
        // waiting for the real peers.
        log(log_level::warning, std::string("tcp mesh refused a connection: ") + e.what());
      }
    }
  };
  // We connect to lower ranks.
  auto connect_all = [&]() -> asio::awaitable<void> {
    for (int p = 0; p < rank; ++p) {
      auto where =
          co_await s->get(options.key_prefix + "/addr/" + std::to_string(p), time_left(deadline));
      auto space = where.rfind(' ');
      std::string host = where.substr(0, space);
      auto port = static_cast<std::uint16_t>(std::stoul(where.substr(space + 1)));
      auto socket = co_await connect_with_retry(host, port, deadline, "tcp mesh");
      co_await client_handshake(socket, config, tcp_address(host, port), deadline);
      sockets[static_cast<std::size_t>(p)] = std::move(socket);
    }
  };

  // Connect down first, then accept from above. No deadlock: a rank only
  // ever waits on lower ranks while connecting, and rank 0 accepts at once.
  // (Sequential rather than a parallel_group: see with_deadline.)
  std::exception_ptr connect_error, accept_error;
  try {
    co_await connect_all();
  } catch (...) {
    connect_error = std::current_exception();
  }
  if (!connect_error) {
    error_context accept_timeout{.operation = "tcp mesh", .rank = rank};
    try {
      co_await with_deadline(accept_all(), deadline, accept_timeout,
                             [&acceptor] { acceptor.cancel(); });
    } catch (...) {
      accept_error = std::current_exception();
    }
  }
  // A failed connect names the peer it could not reach; rethrow it as is.
  if (connect_error) std::rethrow_exception(connect_error);
  std::vector<int> missing;
  for (int p = 0; p < world; ++p)
    if (p != rank && !sockets[static_cast<std::size_t>(p)].is_open()) missing.push_back(p);
  if (!missing.empty())
    throw_error(errc::timeout, {.operation = "tcp mesh",
                                .rank = rank,
                                .peers = "ranks " + format_ranks(missing),
                                .detail = "these peers did not connect by the deadline"});
  if (accept_error) std::rethrow_exception(accept_error);
  co_return sockets;
}

}  // namespace dcomm::detail
