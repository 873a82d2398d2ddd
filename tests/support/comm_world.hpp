// N ranks as threads in this process, each with its own io_context and a
// communicator<tcp_backend> over real loopback sockets, sharing one
// hash_store (Gloo's base_test idea). The body is a coroutine per rank.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/store/hash_store.hpp"
#include "dcomm/tcp_backend.hpp"
#include "support/sanitizer.hpp"

namespace dcomm::test {

using comm = communicator<tcp_backend>;
using rank_body = std::function<asio::awaitable<void>(comm&, int)>;

// Runs body on every rank; returns each rank's error message ("" when it
// succeeded). Operations default to `timeout`.
// Each rank's backend options from `backend_of(rank)`.
inline std::vector<std::string> comm_world(
    int world, const rank_body& body, std::chrono::milliseconds timeout,
    const std::function<tcp_backend::options(int)>& backend_of) {
  auto table = std::make_shared<hash_store::table>();
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        asio::io_context ctx;
        try {
          auto s = hash_store::create(ctx.get_executor(), table);
          sync_wait(ctx, [&]() -> asio::awaitable<void> {
            init_options<tcp_backend> o{.timeout = timeout, .job_token = ""};
            o.backend = backend_of(r);
            if (o.backend.bind_host.empty()) o.backend.bind_host = "127.0.0.1";
            auto c = co_await init_process_group<tcp_backend>(ctx.get_executor(), s, r, world, o);
            co_await body(c, r);
          }());
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
  }
  return errors;
}

inline std::vector<std::string> comm_world(
    int world, const rank_body& body, std::chrono::milliseconds timeout = std::chrono::seconds(20),
    tcp_backend::options backend = {}) {
  return comm_world(world, body, timeout, [&](int) { return backend; });
}

inline std::string summary(const std::vector<std::string>& errors) {
  std::string s;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) s += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return s;
}

// Runs the body and requires every rank to succeed.
#define DCOMM_REQUIRE_WORLD(...)                                 \
  do {                                                           \
    auto dcomm_errors_ = ::dcomm::test::comm_world(__VA_ARGS__); \
    auto dcomm_summary_ = ::dcomm::test::summary(dcomm_errors_); \
    INFO(dcomm_summary_);                                        \
    REQUIRE(dcomm_summary_.empty());                             \
  } while (false)

// A failure inside a rank's coroutine, with the rank and what was compared.
struct check_failed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Inside a rank's coroutine: fails that rank with `what`.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw check_failed(what);
}

// The error code and message a coroutine failed with (none: "").
template <class F>
asio::awaitable<std::pair<errc, std::string>> failure_of(F op) {
  try {
    co_await op();
  } catch (const dcomm::error& e) {
    co_return std::pair{static_cast<errc>(e.code().value()), std::string(e.what())};
  }
  co_return std::pair{errc{}, std::string()};
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace dcomm::test
