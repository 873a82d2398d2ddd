// The CPU backend at the edges (issue 14's outside fault run): a refused
// call takes no sequence number; every pair of different collective calls
// fails on every rank with mismatch naming both calls, whatever the
// algorithms' message patterns; a stopped or killed rank is the one every
// survivor names; and a chaos loop kills a random rank at a random moment
// (start-up, mid-collective, shutdown): no hang, no crash, no untyped error.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/comm_world.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

dcomm::op_options quick(dcomm::algorithm a = dcomm::algorithm::automatic) {
  return {.timeout = 5s, .algorithm = a};
}

// One collective call, and how describe() names it in a mismatch.
struct call_variant {
  std::string description;
  asio::awaitable<void> (*run)(comm&);
};

std::size_t blocks(comm& c, std::size_t per_rank) {
  return per_rank * static_cast<std::size_t>(c.size());
}

// Calls that differ in op, dtype, count, root, reduce op or algorithm;
// small ones and large ones (ring, chain: other message patterns).
std::vector<call_variant> call_variants() {
  using dcomm::algorithm;
  return {
      {"barrier", [](comm& c) -> asio::awaitable<void> { co_await c.barrier(quick()); }},
      {"broadcast(float32 x 10, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.broadcast(v, 0, quick());
       }},
      {"broadcast(float32 x 11, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(11);
         co_await c.broadcast(v, 0, quick());
       }},
      {"broadcast(float32 x 10, root 1)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.broadcast(v, 1, quick());
       }},
      {"broadcast(int32 x 10, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<std::int32_t> v(10);
         co_await c.broadcast(v, 0, quick());
       }},
      {"broadcast(float32 x 10, root 0, chain)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.broadcast(v, 0, quick(algorithm::chain));
       }},
      {"broadcast(float32 x 1048576, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(1 << 20);
         co_await c.broadcast(v, 0, quick());
       }},
      {"all_reduce(float32 x 10, sum)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.all_reduce(v, dcomm::sum, quick());
       }},
      {"all_reduce(float32 x 10, max)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.all_reduce(v, dcomm::max, quick());
       }},
      {"all_reduce(float32 x 10, sum, ring)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.all_reduce(v, dcomm::sum, quick(algorithm::ring));
       }},
      {"all_reduce(float32 x 300000, sum)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(300000);
         co_await c.all_reduce(v, dcomm::sum, quick());
       }},
      {"reduce(float32 x 10, sum, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.reduce(v, 0, dcomm::sum, quick());
       }},
      {"reduce(float32 x 10, sum, root 1)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> v(10);
         co_await c.reduce(v, 1, dcomm::sum, quick());
       }},
      {"scatter(float32 x 10, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> in(blocks(c, 10)), out(10);
         co_await c.scatter(in, out, 0, quick());
       }},
      {"gather(float32 x 10, root 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> in(10), out(blocks(c, 10));
         co_await c.gather(in, out, 0, quick());
       }},
      {"all_gather(float32 x 10)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> in(10), out(blocks(c, 10));
         co_await c.all_gather(in, out, quick());
       }},
      {"reduce_scatter(float32 x 10, sum)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> in(blocks(c, 10)), out(10);
         co_await c.reduce_scatter(in, out, dcomm::sum, quick());
       }},
      {"all_to_all(float32 x 10)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> in(blocks(c, 10)), out(blocks(c, 10));
         co_await c.all_to_all(in, out, quick());
       }},
      {"all_gather_v(float32 x 0)",
       [](comm& c) -> asio::awaitable<void> {
         std::vector<float> in(10), out;
         co_await c.all_gather_v(in, out, quick());
       }},
  };
}

// Every ordered pair (a, b) of different calls: rank `odd` calls b, the
// others a. Each rank must fail with mismatch, its message naming both
// calls; a barrier after each pair shows the ranks are still in step.
// Returns what went wrong ("" if nothing).
std::string mismatch_matrix(int world, int odd) {
  const auto variants = call_variants();
  std::mutex m;
  std::string report;
  auto errors = dcomm::test::comm_world(
      world,
      [&](comm& c, int r) -> asio::awaitable<void> {
        for (std::size_t a = 0; a < variants.size(); ++a)
          for (std::size_t b = 0; b < variants.size(); ++b) {
            if (a == b) continue;
            const auto& mine = variants[r == odd ? b : a];
            auto [code, what] = co_await failure_of([&] { return mine.run(c); });
            const bool both =
                contains(what, variants[a].description) && contains(what, variants[b].description);
            if (code != dcomm::errc::mismatch || !both) {
              std::lock_guard lock(m);
              report += "rank " + std::to_string(r) + ", " + variants[a].description + " vs " +
                        variants[b].description + ": " + (what.empty() ? "succeeded" : what) + "\n";
            }
            co_await c.barrier(quick());
          }
      },
      30s);
  return report + dcomm::test::summary(errors);
}

// The ranks an error blames: the numbers in its peers field.
std::set<int> blamed(const dcomm::error& e) {
  std::set<int> ranks;
  const std::string& p = e.context().peers;
  for (std::size_t i = 0; i < p.size();) {
    if (std::isdigit(static_cast<unsigned char>(p[i]))) {
      std::size_t end = i;
      ranks.insert(std::stoi(p.substr(i), &end));
      i += end;
    } else {
      ++i;
    }
  }
  return ranks;
}

// How a survivor of a fault ended, as its exit code.
enum survivor : int { finished = 0, named_it = 3, blamed_another = 4, untyped = 5 };

}  // namespace

TEST_SUITE("cpu faults") {
  TEST_CASE("a refused call takes no sequence number: the next call still matches") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      std::vector<float> v(10, 1.0f);
      if (r == 0) {
        // An algorithm the operation does not have, a stream on a backend
        // without streams: refused before anything is sent or numbered.
        auto [ring, why] = co_await failure_of([&] {
          return c.broadcast(v, 0, dcomm::op_options{.algorithm = dcomm::algorithm::ring});
        });
        require(ring == dcomm::errc::invalid_argument && contains(why, "binomial_tree, chain") &&
                    !contains(why, "call #"),
                "broadcast with ring: " + why);
        auto [stream, why2] = co_await failure_of([&] {
          return c.all_reduce(v, dcomm::sum,
                              dcomm::op_options{.stream = reinterpret_cast<CUstream_st*>(16)});
        });
        require(stream == dcomm::errc::invalid_argument && contains(why2, "stream"),
                "all_reduce on a stream: " + why2);
        auto [barrier, why3] = co_await failure_of(
            [&] { return c.barrier(dcomm::op_options{.algorithm = dcomm::algorithm::direct}); });
        require(barrier == dcomm::errc::invalid_argument, "barrier with direct: " + why3);
        auto [send, why4] = co_await failure_of([&] {
          return c.send(v, 1, 0, dcomm::op_options{.algorithm = dcomm::algorithm::ring});
        });
        require(send == dcomm::errc::invalid_argument, "send with ring: " + why4);
      }
      co_await c.all_reduce(v, dcomm::sum, quick());
      require(v[0] == 2.0f, "all_reduce after refused calls: " + std::to_string(v[0]));
      co_await c.broadcast(v, 1, quick());
    });
  }
  // What docs/communicator.md ("Threads and errors") says of a timeout: the
  // communicator stays usable. The failure reaches the rank that was late
  // (it fails that call on entering it, without waiting for its own
  // deadline), and every rank's next call matches and works.
  TEST_CASE("after a timeout a late rank fails that call at once, and the next call works") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      if (r == 2) {
        asio::steady_timer late(co_await asio::this_coro::executor, 2s);
        co_await late.async_wait(asio::use_awaitable);
      }
      std::vector<int> v{1};
      const dcomm::op_options deadline{.timeout = r == 2 ? 20s : 500ms};
      const auto entered = std::chrono::steady_clock::now();
      auto [code, what] =
          co_await failure_of([&] { return c.all_reduce(v, dcomm::sum, deadline); });
      const auto waited = std::chrono::steady_clock::now() - entered;
      require(code == dcomm::errc::timeout && contains(what, "rank 2"),
              "rank " + std::to_string(r) + ": " + what);
      require(waited < 5s, "rank " + std::to_string(r) + " waited for its own deadline: " + what);
      std::vector<int> w{r + 1};
      co_await c.all_reduce(w, dcomm::sum, quick());
      require(w[0] == 6, "the all_reduce after the timeout: " + std::to_string(w[0]));
      co_await c.barrier(quick());
    });
  }

  // And of a lost peer: what needs it fails, now and later (its connection
  // is not made again); what does not need it goes on.
  TEST_CASE("after a peer is lost, calls that need it fail; a group without it still works") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      std::optional<comm> pair = c.new_group({0, 1});
      co_await c.barrier(quick());
      if (r == 2) co_return;  // its communicator goes away: its links close
      std::vector<int> v{1};
      for (int call = 0; call < 2; ++call) {
        auto [code, what] =
            co_await failure_of([&] { return c.all_reduce(v, dcomm::sum, quick()); });
        require(code == dcomm::errc::peer_lost && contains(what, "rank 2"),
                "world all_reduce " + std::to_string(call) + " without rank 2: " + what);
      }
      std::vector<int> w{r + 1};
      co_await pair->all_reduce(w, dcomm::sum, quick());
      require(w[0] == 3, "the pair's all_reduce: " + std::to_string(w[0]));
      std::vector<int> x{r == 0 ? 42 : 0};
      if (r == 0)
        co_await c.send(x, 1, 7, quick());
      else
        co_await c.recv(x, 0, 7, quick());
      require(x[0] == 42, "send/recv between the survivors: " + std::to_string(x[0]));
    });
  }

  TEST_CASE("every pair of different calls fails on both ranks with mismatch, naming both") {
    DCOMM_TEST_DEADLINE(180s);
    auto report = mismatch_matrix(2, 1);
    INFO(report);
    CHECK(report.empty());
  }

  TEST_CASE("one rank of four calls something else: all four fail with mismatch, naming both") {
    DCOMM_TEST_DEADLINE(180s);
    auto report = mismatch_matrix(4, 2);
    INFO(report);
    CHECK(report.empty());
  }

  TEST_CASE("confirm_rooted off: a root returns at once; ranks that disagree on it fail") {
    DCOMM_TEST_DEADLINE(60s);
    // Off everywhere: broadcasts and reduces still deliver.
    DCOMM_REQUIRE_WORLD(
        3,
        [](comm& c, int r) -> asio::awaitable<void> {
          for (int root = 0; root < 3; ++root) {
            std::vector<int> v(5, r == root ? 40 + root : 0);
            co_await c.broadcast(v, root, quick());
            require(v[4] == 40 + root, "broadcast without confirmation: " + std::to_string(v[4]));
            std::vector<int> one(5, 1);
            co_await c.reduce(one, root, dcomm::sum, quick());
            require(r != root || one[0] == 3, "reduce without confirmation");
          }
        },
        20s, dcomm::cpu_backend::options{.confirm_rooted = false});
    // Ranks that disagree: a call that differs, caught on both sides.
    auto errors = dcomm::test::comm_world(
        2,
        [](comm& c, int) -> asio::awaitable<void> {
          std::vector<float> v(10);
          co_await c.broadcast(v, 0, quick());
        },
        20s, [](int r) { return dcomm::cpu_backend::options{.confirm_rooted = r == 0}; });
    INFO(dcomm::test::summary(errors));
    for (const auto& e : errors) {
      CHECK(contains(e, "mismatch"));
      CHECK(contains(e, "without confirmation"));
    }
  }

  TEST_CASE("a stopped rank is the one every survivor's timeout names") {
    DCOMM_TEST_DEADLINE(120s);
    // Stopped before it enters the call, and in the middle of a large ring.
    for (bool mid_collective : {false, true}) {
      CAPTURE(mid_collective);
      dcomm::test::listening_socket master;
      auto results = dcomm::test::fork_world(4, 60s, [&](int rank) -> int {
        dcomm::test::set_rank_environment(master, rank, 4);
        auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 20s});
        const auto pids =
            c.all_gather_object(static_cast<std::int32_t>(::getpid()), dcomm::blocking);
        std::vector<float> v(mid_collective ? 8 << 20 : 16, 1.0f);
        const dcomm::op_options soon{.timeout = 2s};
        if (rank == 2) {
          if (mid_collective) {
            c.all_reduce(v, dcomm::sum, soon, [](std::exception_ptr) {});
            std::this_thread::sleep_for(20ms);
          }
          ::raise(SIGSTOP);  // rank 0 kills it once everyone has judged
          return 0;
        }
        int code = finished;
        try {
          // Rank 2 stops in the first call, or (it finished before the
          // stop, on a fast machine or a late thread) before the second.
          for (int call = 0; call < 2; ++call) c.all_reduce(v, dcomm::sum, soon, dcomm::blocking);
        } catch (const dcomm::error& e) {
          std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
          code = blamed(e) == std::set<int>{2} ? named_it : blamed_another;
        }
        if (rank == 0) {
          std::this_thread::sleep_for(1500ms);  // the others have judged by now
          ::kill(pids[2], SIGKILL);
        }
        return code;
      });
      INFO(dcomm::test::describe(results));
      CHECK(results[2].signal == SIGKILL);
      for (int r : {0, 1, 3}) CHECK(results[static_cast<std::size_t>(r)].exit_code == named_it);
    }
  }

  // A silent rank may only be slow (a loaded host): the culprit the
  // timeout's fail frames name is the rank that answered it had not
  // entered, so that the slow one, told, names that rank and not itself.
  TEST_CASE("a timeout blames a rank that had not entered before one too slow to answer") {
    DCOMM_TEST_DEADLINE(120s);
    dcomm::test::listening_socket master;
    auto results = dcomm::test::fork_world(4, 60s, [&](int rank) -> int {
      dcomm::test::set_rank_environment(master, rank, 4);
      auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 20s});
      const auto pids = c.all_gather_object(static_cast<std::int32_t>(::getpid()), dcomm::blocking);
      std::vector<float> v(16, 1.0f);
      if (rank == 1) {
        std::this_thread::sleep_for(5s);  // absent: its thread answers "not entered"
        return finished;
      }
      if (rank == 2) {
        // Stopped in the call (it cannot answer the probe) until rank 0
        // has judged; its own deadline far off, so that what it says is
        // what the others told it.
        std::thread([] {
          std::this_thread::sleep_for(100ms);
          ::raise(SIGSTOP);
        }).detach();
      }
      int code = finished;
      try {
        c.all_reduce(v, dcomm::sum, {.timeout = rank == 2 ? 30s : 2s}, dcomm::blocking);
      } catch (const dcomm::error& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        // Ranks 0 and 3 name both (their own probe), or rank 1 (the
        // other's fail frame came first); rank 2 is told by them.
        const std::set<int> named = blamed(e);
        const bool right = named == std::set<int>{1} || (rank != 2 && named == std::set<int>{1, 2});
        code = e.code() == dcomm::errc::timeout && right ? named_it : blamed_another;
      }
      if (rank == 0) {
        std::this_thread::sleep_for(1s);  // rank 3 has judged too
        ::kill(pids[2], SIGCONT);
      }
      if (rank != 2) std::this_thread::sleep_for(2s);  // rank 2 reads the fail frames first
      return code;
    });
    INFO(dcomm::test::describe(results));
    CHECK(results[1].exit_code == finished);
    for (int r : {0, 2, 3}) CHECK(results[static_cast<std::size_t>(r)].exit_code == named_it);
  }

  TEST_CASE("chaos: 50 random kills at start-up, mid-collective and at shutdown") {
    DCOMM_TEST_DEADLINE(600s);
    // One rank's life: start-up, 40 collectives, the communicator closed.
    // The victim (-1: none) kills itself `delay` after it started.
    auto job = [](int victim, std::chrono::microseconds delay) {
      dcomm::test::listening_socket master;
      return dcomm::test::fork_world(4, 60s, [&](int rank) -> int {
        if (rank == victim)
          std::thread([delay] {
            std::this_thread::sleep_for(delay);
            ::kill(::getpid(), SIGKILL);
          }).detach();
        dcomm::test::set_rank_environment(master, rank, 4);
        try {
          auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 3s});
          std::vector<float> small(16, 1.0f), large(1 << 18, 1.0f);
          for (int i = 0; i < 10; ++i) {
            c.all_reduce(small, dcomm::sum, dcomm::blocking);
            c.all_reduce(large, dcomm::sum, dcomm::blocking);
            c.broadcast(small, i % 4, dcomm::blocking);
            c.barrier(dcomm::blocking);
          }
        } catch (const dcomm::error& e) {
          const bool right = blamed(e) == std::set<int>{victim};
          if (!right) std::fprintf(stderr, "rank %d (victim %d): %s\n", rank, victim, e.what());
          return right ? named_it : blamed_another;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d (victim %d): untyped: %s\n", rank, victim, e.what());
          return untyped;
        }
        return finished;
      });
    };
    // How long a job lives here (sanitizers and load change it): the kills
    // are spread uniformly over it.
    const auto start = std::chrono::steady_clock::now();
    auto clean = job(-1, {});
    const auto life = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now() - start);
    INFO(dcomm::test::describe(clean));
    for (const auto& r : clean) REQUIRE(r.ok());
    // DCOMM_CHAOS_SEED replays or varies the trials.
    const char* seed = std::getenv("DCOMM_CHAOS_SEED");
    std::mt19937 random(seed ? static_cast<std::uint32_t>(std::stoul(seed)) : 20261123u);
    int hangs = 0, crashes = 0, wrong = 0, untyped_errors = 0, named = 0, killed = 0;
    std::string report;
    for (int trial = 0; trial < 50; ++trial) {
      const int victim = static_cast<int>(random() % 4);
      const auto delay = std::chrono::microseconds(random() % (life.count() * 4 / 5));
      auto results = job(victim, delay);
      bool bad = false;
      for (const auto& r : results) {
        if (r.rank == victim) {
          killed += r.signal == SIGKILL;
          if (r.signal == SIGKILL || r.exit_code == finished) continue;
        }
        hangs += r.timed_out;
        crashes += r.signal != 0;
        wrong += r.exit_code == blamed_another;
        untyped_errors += r.exit_code == untyped;
        named += r.exit_code == named_it;
        bad =
            bad || r.timed_out || r.signal || (r.exit_code != finished && r.exit_code != named_it);
      }
      if (bad)
        report += "trial " + std::to_string(trial) + " (victim " + std::to_string(victim) + " at " +
                  std::to_string(delay.count() / 1000) + " of " +
                  std::to_string(life.count() / 1000) + " ms): " + dcomm::test::describe(results) +
                  "\n";
    }
    INFO(report);
    MESSAGE("chaos (seed " << std::string(seed ? seed : "20261123") << "): a clean job lives "
                           << life.count() / 1000 << " ms; " << killed << " victims killed; "
                           << named << " survivors named the victim");
    CHECK(hangs == 0);
    CHECK(crashes == 0);
    CHECK(wrong == 0);
    CHECK(untyped_errors == 0);
  }
}
