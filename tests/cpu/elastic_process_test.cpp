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
}
