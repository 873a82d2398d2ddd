// N ranks as threads in this process, each with its own io_context and a
// communicator<cpu_backend> over real loopback sockets, sharing one
// hash_store: dcomm::thread_world (dcomm/thread_world.hpp), with each rank's
// error as a message. The body is a coroutine per rank.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/thread_world.hpp"
#include "support/check_failed.hpp"
#include "support/sanitizer.hpp"
#include "support/text.hpp"

namespace dcomm::test {

using comm = communicator<cpu_backend>;
using rank_body = std::function<asio::awaitable<void>(comm&, int)>;

// Runs body on every rank; returns each rank's error message ("" when it
// succeeded). Operations default to `timeout`.
// Each rank's backend options from `backend_of(rank)`.
// The world's own deadline is beyond any test's (DCOMM_TEST_DEADLINE and
// meson's limits stop a hung test first, naming it).
inline std::vector<std::string> comm_world(
    int world, const rank_body& body, std::chrono::milliseconds timeout,
    const std::function<cpu_backend::options(int)>& backend_of) {
  // DCOMM_TEST_HOSTS=k runs the world as k hosts of consecutive ranks
  // (shared memory inside each, TCP between them): meson runs suites so.
  const char* hosts = std::getenv("DCOMM_TEST_HOSTS");
  const int k = hosts && *hosts ? std::max(1, std::atoi(hosts)) : 0;
  auto with_host = [&backend_of, k, world](int r) {
    cpu_backend::options o = backend_of(r);
    if (k > 0 && o.host_id.empty()) o.host_id = "test-host-" + std::to_string(r * k / world);
    return o;
  };
  thread_world_options<cpu_backend> o{
      .timeout = timeout, .deadline = std::chrono::minutes(15), .backend_of = with_host};
  auto failures = thread_world_failures<cpu_backend>(
      world, [&](comm& c) { return body(c, c.rank()); }, o);
  std::vector<std::string> errors;
  for (auto& f : failures) errors.push_back(f ? detail::message_of(f) : std::string());
  return errors;
}

inline std::vector<std::string> comm_world(
    int world, const rank_body& body, std::chrono::milliseconds timeout = std::chrono::seconds(20),
    cpu_backend::options backend = {}) {
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

}  // namespace dcomm::test
