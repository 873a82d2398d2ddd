// Agreement between processes (issue 43, docs/elastic.md): a rank killed
// as the agreement starts or while it runs, the coordinator or another:
// every survivor returns the same decision. Apart from elastic_test.cpp:
// the TSan build, which runs that file's suite, does not fork.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "dcomm/cpu_backend.hpp"
#include "dcomm/init_process_group.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"

using namespace std::chrono_literals;

TEST_SUITE("cpu elastic processes") {
  TEST_CASE("agree: survivors of a killed coordinator, or member, decide the same") {
    DCOMM_TEST_DEADLINE(120s);
    // Killed as the agreement starts, or a little later (mid-protocol, or
    // after it decided: any decision may stand, the same on every rank).
    for (int victim : {0, 2})
      for (int delay_us : {0, 100, 1000}) {
        CAPTURE(victim);
        CAPTURE(delay_us);
        dcomm::test::listening_socket master;
        auto results = dcomm::test::fork_world(4, 60s, [&](int rank) -> int {
          dcomm::test::set_rank_environment(master, rank, 4);
          auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 20s});
          c.barrier(dcomm::blocking);
          if (rank == victim) {
            c.agree(true, [](std::exception_ptr, dcomm::agreement) {});
            std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
            ::kill(::getpid(), SIGKILL);
          }
          const dcomm::agreement a = c.agree(true, dcomm::op_options{.timeout = 20s}, dcomm::blocking);
          int mask = 0;
          for (int f : a.failed) mask |= 1 << f;
          return 64 + (a.flag ? 16 : 0) + mask;  // the decision, as the exit code
        });
        INFO(dcomm::test::describe(results));
        CHECK(results[static_cast<std::size_t>(victim)].signal == SIGKILL);
        const int first = victim == 0 ? 1 : 0;
        const int decision = results[static_cast<std::size_t>(first)].exit_code;
        CHECK((decision == 64 + 16 || decision == 64 + 16 + (1 << victim)));
        for (int r = 0; r < 4; ++r)
          if (r != victim) CHECK(results[static_cast<std::size_t>(r)].exit_code == decision);
      }
  }

  // The promise: a lost rank costs the job a step, not the job.
  TEST_CASE("a rank killed mid-all_reduce costs the survivors a step: revoke, shrink, go on") {
    DCOMM_TEST_DEADLINE(120s);
    dcomm::test::listening_socket master;
    auto results = dcomm::test::fork_world(4, 60s, [&](int rank) -> int {
      dcomm::test::set_rank_environment(master, rank, 4);
      dcomm::init_options<dcomm::cpu_backend> o{.timeout = 20s};
      o.backend.revoke_on_failure = true;
      auto c = dcomm::init_process_group<dcomm::cpu_backend>(o);
      const int steps = 6;
      int recoveries = 0;
      for (int step = 0; step < steps; ++step) {
        std::vector<float> v(1 << 16, static_cast<float>(c.global_rank(c.rank()) + 1));
        if (rank == 2 && step == 3) {
          c.all_reduce(v, dcomm::sum, [](std::exception_ptr) {});
          std::this_thread::sleep_for(1ms);
          ::kill(::getpid(), SIGKILL);
        }
        try {
          c.all_reduce(v, dcomm::sum, dcomm::blocking);
        } catch (const dcomm::error& e) {
          if (e.code() != dcomm::errc::peer_lost && e.code() != dcomm::errc::revoked) throw;
          c = c.shrink(dcomm::blocking);
          ++recoveries;
          // Some may have finished this step before the failure: all redo
          // the earliest step not finished everywhere.
          std::vector<int> redo{step};
          c.all_reduce(redo, dcomm::min, dcomm::blocking);
          step = redo[0] - 1;
          continue;
        }
        float expected = 0;
        for (int g : c.ranks()) expected += static_cast<float>(g + 1);
        if (v[0] != expected || v.back() != expected) return 10 + step;
      }
      return c.size() == 3 && recoveries == 1 ? 0 : 20 + c.size();
    });
    INFO(dcomm::test::describe(results));
    CHECK(results[2].signal == SIGKILL);
    for (int r : {0, 1, 3}) CHECK(results[static_cast<std::size_t>(r)].exit_code == 0);
  }
}
