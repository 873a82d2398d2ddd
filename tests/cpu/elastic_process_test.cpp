// Agreement and shrink between processes (issue 43, docs/elastic.md):
// none, one or two ranks killed as the agreement starts or while it runs,
// coordinators or others: every survivor returns the same decision; ranks
// killed mid-all_reduce, one or two, at once or steps apart, in worlds 3
// to 8: the survivors shrink and go on. Apart from elastic_test.cpp: the
// TSan build, which runs that file's suite, does not fork.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/cpu_backend.hpp"
#include "dcomm/init_process_group.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"

using namespace std::chrono_literals;

// DCOMM_TEST_HOSTS=k plays k hosts of consecutive ranks (shared memory
// inside each, TCP between them), as comm_world does: meson runs the suite so.
void play_host(dcomm::cpu_backend::options& o, int rank, int world) {
  const char* hosts = std::getenv("DCOMM_TEST_HOSTS");
  const int k = hosts && *hosts ? std::max(1, std::atoi(hosts)) : 0;
  if (k > 0) o.host_id = "test-host-" + std::to_string(rank * k / world);
}

TEST_SUITE("cpu elastic processes") {
  TEST_CASE("agree: with 0, 1 or 2 ranks killed during it, every survivor decides the same") {
    DCOMM_TEST_DEADLINE(240s);
    const int world = 5;
    // Rank 0 coordinates; {0, 1} kills it and its successor.
    const std::vector<std::vector<int>> victim_sets{{}, {0}, {3}, {0, 1}, {2, 4}};
    for (const auto& victims : victim_sets)
      for (int delay_us : {0, 100, 1000}) {
        if (victims.empty() && delay_us != 0) continue;
        CAPTURE(victims.size());
        CAPTURE(victims.empty() ? -1 : victims[0]);
        CAPTURE(delay_us);
        int victim_mask = 0;
        for (int v : victims) victim_mask |= 1 << v;
        dcomm::test::listening_socket master;
        auto results = dcomm::test::fork_world(world, 60s, [&](int rank) -> int {
          dcomm::test::set_rank_environment(master, rank, world);
          dcomm::init_options<dcomm::cpu_backend> o{.timeout = 20s};
          play_host(o.backend, rank, world);
          auto c = dcomm::init_process_group<dcomm::cpu_backend>(o);
          c.barrier(dcomm::blocking);
          if (victim_mask & (1 << rank)) {
            // Killed as the agreement starts, or a little later (mid-
            // protocol, or after it decided: any decision may stand, the
            // same on every rank).
            c.agree(true, [](std::exception_ptr, dcomm::agreement) {});
            std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
            ::kill(::getpid(), SIGKILL);
          }
          const dcomm::agreement a =
              c.agree(true, dcomm::op_options{.timeout = 20s}, dcomm::blocking);
          int mask = 0;
          for (int f : a.failed) mask |= 1 << f;
          return 64 + (a.flag ? 32 : 0) + mask;  // the decision, as the exit code
        });
        INFO(dcomm::test::describe(results));
        int first = 0;
        while (victim_mask & (1 << first)) ++first;
        const int decision = results[static_cast<std::size_t>(first)].exit_code;
        CHECK(decision >= 64 + 32);                         // every flag was true
        CHECK(((decision - 64 - 32) & ~victim_mask) == 0);  // only the killed are failed
        for (int r = 0; r < world; ++r) {
          if (victim_mask & (1 << r))
            CHECK(results[static_cast<std::size_t>(r)].signal == SIGKILL);
          else
            CHECK(results[static_cast<std::size_t>(r)].exit_code == decision);
        }
      }
  }

  // The promise: a lost rank costs the job a step, not the job.
  // Each case: the world, and the ranks killed at the steps given.
  struct kill_at {
    int rank;
    int step;
  };
  void train_through(int world, const std::vector<kill_at>& kills) {
    dcomm::test::listening_socket master;
    auto results = dcomm::test::fork_world(world, 90s, [&](int rank) -> int {
      dcomm::test::set_rank_environment(master, rank, world);
      dcomm::init_options<dcomm::cpu_backend> o{.timeout = 20s};
      o.backend.revoke_on_failure = true;
      play_host(o.backend, rank, world);
      auto c = dcomm::init_process_group<dcomm::cpu_backend>(o);
      const int steps = 6;
      int recoveries = 0;
      for (int step = 0; step < steps; ++step) {
        std::vector<float> v(1 << 16, static_cast<float>(c.global_rank(c.rank()) + 1));
        for (const kill_at& k : kills)
          if (k.rank == rank && k.step == step) {
            c.all_reduce(v, dcomm::sum, [](std::exception_ptr) {});
            std::this_thread::sleep_for(1ms);
            ::kill(::getpid(), SIGKILL);
          }
        try {
          c.all_reduce(v, dcomm::sum, dcomm::blocking);
        } catch (const dcomm::error& e) {
          if (e.code() != dcomm::errc::peer_lost && e.code() != dcomm::errc::revoked) throw;
          // A second death may come while the survivors shrink or redo:
          // then shrink again, the communicator that failed.
          for (;;) {
            try {
              c = c.shrink(dcomm::blocking);
              ++recoveries;
              // Some may have finished this step before the failure: all
              // redo the earliest step not finished everywhere.
              std::vector<int> redo{step};
              c.all_reduce(redo, dcomm::min, dcomm::blocking);
              step = redo[0] - 1;
              break;
            } catch (const dcomm::error& again) {
              if (again.code() != dcomm::errc::peer_lost && again.code() != dcomm::errc::revoked)
                throw;
            }
          }
          continue;
        }
        float expected = 0;
        for (int g : c.ranks()) expected += static_cast<float>(g + 1);
        if (v[0] != expected || v.back() != expected) return 10 + step;
      }
      // Steps apart, each death is its own recovery; at once, one or two.
      std::vector<int> kill_steps;
      for (const kill_at& k : kills) kill_steps.push_back(k.step);
      std::sort(kill_steps.begin(), kill_steps.end());
      const auto distinct = std::unique(kill_steps.begin(), kill_steps.end()) - kill_steps.begin();
      const int survivors = world - static_cast<int>(kills.size());
      if (c.size() != survivors) return 30 + c.size();
      return recoveries >= distinct && recoveries <= static_cast<int>(kills.size())
                 ? 0
                 : 40 + recoveries;
    });
    INFO(dcomm::test::describe(results));
    for (int r = 0; r < world; ++r) {
      const bool killed =
          std::any_of(kills.begin(), kills.end(), [&](const kill_at& k) { return k.rank == r; });
      if (killed)
        CHECK(results[static_cast<std::size_t>(r)].signal == SIGKILL);
      else
        CHECK(results[static_cast<std::size_t>(r)].exit_code == 0);
    }
  }

  TEST_CASE("ranks killed mid-all_reduce cost the survivors a step: revoke, shrink, go on") {
    DCOMM_TEST_DEADLINE(400s);
    for (int world = 3; world <= 8; ++world) {
      CAPTURE(world);
      train_through(world, {{world - 2, 3}});          // one
      train_through(world, {{0, 2}, {world - 1, 2}});  // two at once, rank 0 one of them
      if (world == 4 || world == 8) train_through(world, {{1, 1}, {world - 1, 4}});  // steps apart
    }
  }
}
