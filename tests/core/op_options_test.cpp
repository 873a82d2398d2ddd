// Per-call options on every communicator operation, including the forms
// that took none before (the in-place scatter, gather, all_gather,
// reduce_scatter and all_to_all, the object collectives and split), and
// communicator::with(), the handle that carries defaults. Thread worlds
// over real loopback sockets.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "support/comm_world.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"
#include "support/store_world.hpp"

using namespace std::chrono_literals;
using dcomm::errc;
using dcomm::op_options;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

// One of the eight entry points, called on a world of two with `o`.
struct entry_point {
  const char* name;       // as the error names the operation
  dcomm::algorithm none;  // an algorithm this operation does not have
  std::function<asio::awaitable<void>(comm, op_options)> call;  // by value: with()'s
};

std::vector<entry_point> entry_points() {
  using A = dcomm::algorithm;
  return {
      {"scatter", A::chain,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::vector<float> buf(4, 1.0f);
         co_await c.scatter(buf, 1, o);
       }},
      {"gather", A::chain,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::vector<float> buf(4, 1.0f);
         co_await c.gather(buf, 0, o);
       }},
      {"all_gather", A::chain,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::vector<float> buf(4, 1.0f);
         co_await c.all_gather(buf, o);
       }},
      {"reduce_scatter", A::chain,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::vector<float> buf(4, 1.0f);
         co_await c.reduce_scatter(buf, dcomm::sum, o);
       }},
      {"all_to_all", A::ring,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::vector<float> buf(4, 1.0f);
         co_await c.all_to_all(buf, o);
       }},
      {"broadcast_object", A::direct,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::string s = "mine";
         co_await c.broadcast_object(s, 1, o);
       }},
      {"all_gather_object", A::direct,
       [](comm c, op_options o) -> asio::awaitable<void> {
         std::int64_t v = 7;
         auto all = co_await c.all_gather_object(v, o);
         (void)all;
       }},
      {"split", A::direct,
       [](comm c, op_options o) -> asio::awaitable<void> {
         auto child = co_await c.split(0, 0, o);
         (void)child;
       }},
  };
}

// Rank 1 of a world of two that never calls: it waits until rank 0 says it
// is done (at most `limit`), then leaves.
asio::awaitable<void> stay_silent(const std::atomic<bool>& done, std::chrono::milliseconds limit) {
  asio::steady_timer timer(co_await asio::this_coro::executor);
  for (auto waited = 0ms; !done && waited < limit; waited += 50ms) {
    timer.expires_after(50ms);
    co_await timer.async_wait(asio::use_awaitable);
  }
}

}  // namespace

TEST_SUITE("op options") {
  // The group's timeout is two minutes and the test's deadline one: an
  // operation that ignored its options would wait until the silent rank
  // leaves (15 s) and fail with peer_lost, not timeout. Its error names the
  // entry point (op_context::operation), whatever backend calls it runs.
  TEST_CASE("every entry point honours a per-call timeout, given or carried by with()") {
    DCOMM_TEST_DEADLINE(60s);
    std::atomic<bool> done{false};
    auto errors = dcomm::test::comm_world(
        2,
        [&](comm& c, int r) -> asio::awaitable<void> {
          if (r == 1) {
            co_await stay_silent(done, 15s);
            co_return;
          }
          const op_options quick{.timeout = 300ms};
          const op_options slow{.timeout = 120s};
          std::string failures;
          for (const auto& e : entry_points()) {
            // Its own options; a handle's defaults; its own over the handle's.
            const std::pair<const char*, std::function<asio::awaitable<void>()>> forms[] = {
                {"given", [&] { return e.call(c, quick); }},
                {"with()", [&] { return e.call(c.with(quick), {}); }},
                {"given over with()", [&] { return e.call(c.with(slow), quick); }},
            };
            for (const auto& [form, run] : forms) {
              auto [code, what] = co_await failure_of(run);
              // Named as called: a broadcast_object's, not its broadcasts'.
              if (code != errc::timeout || what.find(e.name) == std::string::npos)
                failures += std::string(e.name) + " (" + form +
                            "): " + (what.empty() ? "completed" : what) + "\n";
            }
          }
          done = true;
          require(failures.empty(), failures);
        },
        120s);
    done = true;
    INFO(dcomm::test::summary(errors));
    CHECK(errors[0].empty());
    CHECK(errors[1].empty());
  }

  // Only rank 0 makes the refused calls: had one of them taken a sequence
  // number (or split a child index), the calls after them would not match
  // rank 1's and fail (mismatch or timeout) instead of giving the results.
  TEST_CASE("an algorithm an entry point lacks is refused before the call takes a number") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      if (r == 0) {
        for (const auto& e : entry_points()) {
          const op_options bad{.algorithm = e.none};
          auto [code, what] = co_await failure_of([&] { return e.call(c, bad); });
          require(code == errc::invalid_argument && contains(what, "algorithm") &&
                      contains(what, e.name),
                  std::string(e.name) + ": " + (what.empty() ? "accepted" : what));
          auto [code2, what2] = co_await failure_of([&] { return e.call(c.with(bad), {}); });
          require(code2 == errc::invalid_argument,
                  std::string(e.name) + " through with(): " + (what2.empty() ? "accepted" : what2));
        }
      }
      const op_options soon{.timeout = 10s};
      auto child = co_await c.split(0, -r, soon);  // keys reverse the ranks
      require(child.has_value() && child->rank() == 1 - r, "split: rank in the child group");
      std::vector<std::int64_t> v{r + 1};
      co_await child->all_reduce(v, dcomm::sum, soon);
      require(v[0] == 3, "all_reduce on the child group: " + std::to_string(v[0]));
      const std::int64_t mine = 10 + r;
      auto all = co_await c.all_gather_object(mine, soon);
      require(all == std::vector<std::int64_t>{10, 11}, "all_gather_object");
      std::vector<std::int32_t> blocks{r == 0 ? 5 : -1, r == 1 ? 6 : -1};
      const comm soon_handle = c.with(soon);
      co_await soon_handle.all_gather(blocks, {.algorithm = dcomm::algorithm::ring});
      require(blocks == std::vector<std::int32_t>{5, 6}, "in-place all_gather with ring");
      std::string s = r == 1 ? "from one" : "";
      co_await soon_handle.broadcast_object(s, 1);
      require(s == "from one", "broadcast_object: " + s);
    });
  }

  TEST_CASE("with(): defaults add up field by field; groups made from it start without them") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      auto h = c.with({.timeout = 7s}).with({.algorithm = dcomm::algorithm::ring});
      require(h.defaults().timeout == std::chrono::milliseconds(7s) &&
                  h.defaults().algorithm == dcomm::algorithm::ring,
              "defaults of with().with()");
      require(!c.defaults().timeout, "the original handle keeps no defaults");
      std::vector<float> v{static_cast<float>(r + 1)};
      co_await h.all_reduce(v, dcomm::sum);  // ring: all_reduce has it
      require(v[0] == 3.0f, "all_reduce through the handle");
      // automatic means "not set": the handle's ring stands, and barrier,
      // which has no ring, is refused (before taking a number).
      auto [code, what] = co_await failure_of([&] { return h.barrier(); });
      require(code == errc::invalid_argument && contains(what, "ring"), "barrier: " + what);
      const comm timed = c.with({.timeout = 7s});
      auto child = co_await timed.split(0, r);
      require(child.has_value() && !child->defaults().timeout, "split's group has no defaults");
      co_await child->barrier();
      co_await c.barrier();
    });
  }
}

// g++ 12 destroys the members of a braced aggregate temporary in a co_await
// expression twice: the entry points' option types have only trivially
// destructible members, so the natural one-liner is safe. (Where a member
// was a std::string, the runs below freed memory twice and aborted.)
static_assert(std::is_trivially_destructible_v<dcomm::init_options<dcomm::cpu_backend>>);
static_assert(std::is_trivially_destructible_v<dcomm::cpu_backend::options>);
static_assert(std::is_trivially_destructible_v<dcomm::rendezvous_options>);

TEST_SUITE("op options") {
  TEST_CASE("init_process_group and rendezvous take braced options in a co_await") {
    DCOMM_TEST_DEADLINE(90s);
    dcomm::test::listening_socket ls;
    dcomm::test::temp_dir dir;
    auto results = dcomm::test::fork_world(2, 60s, [&](int rank) {
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(ls.port).c_str(), 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      if (rank == 0) ::setenv("DCOMM_MASTER_LISTEN_FD", std::to_string(ls.fd()).c_str(), 1);
      int status = 1;
      asio::io_context io;
      auto body = [&]() -> asio::awaitable<void> {
        auto ex = co_await asio::this_coro::executor;
        // A world of one through file://, its options a braced temporary.
        auto alone = co_await dcomm::rendezvous(
            ex, dcomm::rendezvous_options{
                    .init_method = "file://" + dir.path + "/alone" + std::to_string(rank),
                    .rank = 0,
                    .world_size = 1,
                    .job_token = ""});
        co_await dcomm::depart(alone);
        // The one-liner, with the backend's options braced too.
        auto comm = co_await dcomm::init_process_group<dcomm::cpu_backend>(
            ex, dcomm::init_options<dcomm::cpu_backend>{
                    .init_method = "env://",
                    .timeout = 30s,
                    .job_token = "",
                    .backend = {.bind_host = "127.0.0.1", .algorithms = "all_reduce=ring"}});
        std::vector<int> x{rank + 1, 10};
        co_await comm.all_reduce(x, dcomm::sum);
        status = x == std::vector<int>{3, 20} ? 0 : 2;
      };
      asio::co_spawn(io, body(), [&](std::exception_ptr e) {
        if (!e) return;
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& what) {
          std::fprintf(stderr, "rank %d: %s\n", rank, what.what());
        }
        status = 3;
      });
      io.run();
      return status;
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  }

  TEST_CASE("an option_string holds its text in place and refuses what does not fit") {
    dcomm::option_string s = "tcp://10.0.0.1:29500";
    std::string_view seen = s;
    CHECK(seen == "tcp://10.0.0.1:29500");
    CHECK(s == "tcp://10.0.0.1:29500");
    s = std::string("env://");
    CHECK(s.str() == "env://");
    CHECK(std::string_view(s.c_str()) == "env://");  // NUL-terminated after a shorter text
    s = "";
    CHECK(s.empty());
    const std::string fits(dcomm::option_string::capacity, 'x');
    CHECK(dcomm::option_string(fits).size() == fits.size());
    std::string what = "no error";
    try {
      dcomm::option_string too_long(fits + "y");
    } catch (const dcomm::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      what = e.what();
    }
    CHECK(contains(what, "1024 bytes"));
  }
}
