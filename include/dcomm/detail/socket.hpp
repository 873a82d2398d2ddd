// TCP helpers shared by the store and the backends: deadlines on socket
// operations, connecting with retries, and printing addresses.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <variant>

#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"

namespace dcomm::detail {

using tcp = asio::ip::tcp;

// "tcp://host:port", with an IPv6 host in brackets.
inline std::string tcp_address(const std::string& host, std::uint16_t port) {
  bool v6 = host.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline std::string endpoint_address(const tcp::endpoint& ep) {
  return tcp_address(ep.address().to_string(), ep.port());
}

// Runs op, failing with errc::timeout naming `operation` if the deadline
// passes first (the op is then cancelled). Not awaitable_operators' `||`:
// that waits for the first op to *succeed*, so a failing op would be reported
// as a timeout, and only at the deadline.
template <typename T>
asio::awaitable<T> with_deadline(asio::awaitable<T> op, clock::time_point deadline,
                                 error_context on_timeout) {
  namespace ex = asio::experimental;
  auto executor = co_await asio::this_coro::executor;
  asio::steady_timer timer(executor, deadline);
  auto results =
      co_await ex::make_parallel_group(asio::co_spawn(executor, std::move(op), ex::deferred),
                                       timer.async_wait(ex::deferred))
          .async_wait(ex::wait_for_one(), asio::use_awaitable);
  if (std::get<0>(results)[0] != 0) throw_error(errc::timeout, std::move(on_timeout));
  if (auto& failure = std::get<1>(results)) std::rethrow_exception(failure);
  if constexpr (!std::is_void_v<T>) co_return std::move(std::get<2>(results));
}

// Connects to host:port, retrying with backoff until the deadline: the
// server (rank 0) may start after its clients.
inline asio::awaitable<tcp::socket> connect_with_retry(std::string host, std::uint16_t port,
                                                       clock::time_point deadline,
                                                       std::string operation) {
  auto executor = co_await asio::this_coro::executor;
  tcp::resolver resolver(executor);
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  for (;;) {
    try {
      auto endpoints =
          co_await resolver.async_resolve(host, std::to_string(port), asio::use_awaitable);
      tcp::socket socket(executor);
      // Named, not braced in the co_await: g++ 12 destroys such temporaries twice.
      error_context on_timeout{.operation = operation, .address = tcp_address(host, port)};
      co_await with_deadline(asio::async_connect(socket, endpoints, asio::use_awaitable), deadline,
                             on_timeout);
      socket.set_option(tcp::no_delay(true));
      co_return socket;
    } catch (const std::system_error& e) {
      last_error = e.code().message();
    }
    auto now = clock::now();
    if (now >= deadline) break;
    asio::steady_timer timer(executor, std::min<clock::time_point>(now + backoff, deadline));
    co_await timer.async_wait(asio::use_awaitable);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(1));
  }
  throw_error(errc::connect_failed,
              {.operation = operation,
               .address = tcp_address(host, port),
               .detail = "gave up at the deadline; last error: " + last_error});
}

}  // namespace dcomm::detail
