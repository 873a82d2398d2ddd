// TCP helpers shared by the store and the backends: deadlines on socket
// operations, connecting with retries, and printing addresses.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <variant>

#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/error.hpp"

namespace dcomm::detail {

using ip_tcp = asio::ip::tcp;

// "tcp://host:port", with an IPv6 host in brackets.
inline std::string tcp_address(const std::string& host, std::uint16_t port) {
  bool v6 = host.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// An IPv4 peer of a dual-stack socket shows as itself, not as ::ffff:a.b.c.d.
inline std::string endpoint_address(const ip_tcp::endpoint& ep) {
  auto a = ep.address();
  if (a.is_v6() && a.to_v6().is_v4_mapped())
    a = asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6());
  return tcp_address(a.to_string(), ep.port());
}

// Runs op, failing with errc::timeout naming `on_timeout` if the deadline
// passes first: then cancel() is called, which must make one pending
// operation complete (e.g. socket.cancel(ec), never a throwing overload: the
// socket may have been closed meanwhile). It cancels only what is pending at
// that moment, so op must be a single operation, not a loop that starts new
// ones. A timer on the caller's executor does it, the classic
// Asio pattern. Not awaitable_operators or parallel_group: `||` waits for the
// first op to *succeed*, and Asio's parallel_group cancellation has known
// use-after-free races (asio#1332, asio#1348) that hung ranks under load.
template <typename T, typename Cancel>
asio::awaitable<T> with_deadline(asio::awaitable<T> op, detail::clock::time_point deadline,
                                 error_context on_timeout, Cancel cancel) {
  struct state {
    bool done = false;
    bool fired = false;
  };
  auto st = std::make_shared<state>();
  asio::steady_timer timer(co_await asio::this_coro::executor, deadline);
  // Runs on the same executor as this coroutine; after `done` it never
  // touches what cancel() refers to.
  timer.async_wait([st, cancel](const asio::error_code& ec) {
    if (ec || st->done) return;
    st->fired = true;
    cancel();
  });
  std::exception_ptr failure;
  // A timeout wins over the error the cancelled op ended with.
  auto settle = [&] {
    st->done = true;
    timer.cancel();
    if (st->fired) throw_error(errc::timeout, std::move(on_timeout));
    if (failure) std::rethrow_exception(failure);
  };
  if constexpr (std::is_void_v<T>) {
    try {
      co_await std::move(op);
    } catch (...) {
      failure = std::current_exception();
    }
    settle();
  } else {
    std::optional<T> result;
    try {
      result.emplace(co_await std::move(op));
    } catch (...) {
      failure = std::current_exception();
    }
    settle();
    co_return std::move(*result);
  }
}

// The dcomm code for a socket error: refused, unreachable and the like
// (nobody answered) are connect_failed; a connection that broke (reset, end
// of file, broken pipe) is peer_lost; anything else keeps its system code.
inline std::error_code socket_error_code(const std::error_code& ec) {
  if (ec == asio::error::connection_refused || ec == asio::error::host_unreachable ||
      ec == asio::error::network_unreachable || ec == asio::error::timed_out ||
      ec == asio::error::host_not_found || ec == asio::error::host_not_found_try_again ||
      ec == asio::error::service_not_found)
    return make_error_code(errc::connect_failed);
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::connection_aborted || ec == asio::error::broken_pipe ||
      ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor ||
      ec == asio::error::not_connected || ec == asio::error::shut_down)
    return make_error_code(errc::peer_lost);
  return ec;
}

// Rethrows `failure` so that no raw std::system_error reaches a user: a
// dcomm::error as it is, any other std::system_error ("Connection reset by
// peer", "End of file") as a dcomm::error with `ctx` that keeps the
// original message. Anything else (a bug) passes unchanged.
[[noreturn]] inline void rethrow_as_dcomm_error(std::exception_ptr failure, error_context ctx) {
  try {
    std::rethrow_exception(failure);
  } catch (const dcomm::error&) {
    throw;
  } catch (const std::system_error& e) {
    ctx.detail = ctx.detail.empty() ? std::string(e.what()) : ctx.detail + ": " + e.what();
    throw error(socket_error_code(e.code()), std::move(ctx));
  }
}

// Connects to host:port, retrying with backoff until the deadline: the
// server (rank 0) may start after its clients.
DCOMM_EMIT_ON_USE asio::awaitable<ip_tcp::socket> connect_with_retry(
    std::string host, std::uint16_t port, detail::clock::time_point deadline,
    std::string operation) {
  auto executor = co_await asio::this_coro::executor;
  ip_tcp::resolver resolver(executor);
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  for (;;) {
    try {
      // Named, not braced in the co_await: g++ 12 destroys such temporaries twice.
      error_context on_timeout{.operation = operation, .address = tcp_address(host, port)};
      auto endpoints = co_await with_deadline(
          resolver.async_resolve(host, std::to_string(port), asio::use_awaitable), deadline,
          on_timeout, [&resolver] { resolver.cancel(); });
      ip_tcp::socket socket(executor);
      // close(), not cancel(): async_connect over several endpoints goes
      // on to the next one after a cancelled attempt, past the deadline.
      co_await with_deadline(asio::async_connect(socket, endpoints, asio::use_awaitable), deadline,
                             on_timeout, [&socket] {
                               asio::error_code ignored;
                               socket.close(ignored);
                             });
      socket.set_option(ip_tcp::no_delay(true));
      co_return socket;
    } catch (const std::system_error& e) {
      last_error = e.code().message();
    }
    auto now = detail::clock::now();
    if (now >= deadline) break;
    asio::steady_timer timer(executor,
                             std::min<detail::clock::time_point>(now + backoff, deadline));
    co_await timer.async_wait(asio::use_awaitable);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
  throw_error(errc::connect_failed,
              {.operation = operation,
               .address = tcp_address(host, port),
               .detail = "gave up at the deadline; last error: " + last_error});
}

// The local address that routes to `host`, found without sending anything
// (a connected UDP socket); empty if there is no route.
inline std::string local_address_towards(const asio::any_io_executor& ex, const std::string& host) {
  if (host.empty()) return {};
  asio::error_code ec;
  auto target = asio::ip::make_address(host, ec);
  if (ec) {
    asio::ip::udp::resolver resolver(ex);
    auto results = resolver.resolve(host, "9", ec);
    if (ec || results.empty()) return {};
    target = results.begin()->endpoint().address();
  }
  asio::ip::udp::socket probe(ex);
  probe.connect({target, 9}, ec);
  if (ec) return {};
  auto local = probe.local_endpoint(ec);
  return ec ? std::string{} : local.address().to_string();
}

}  // namespace dcomm::detail

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::detail::connect_with_retry<void>(std::string host, std::uint16_t port, detail::clock::time_point deadline, std::string operation) -> asio::awaitable<ip_tcp::socket>)
// clang-format on
// End of the separate-compilation block.
