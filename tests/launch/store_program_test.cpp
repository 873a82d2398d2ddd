// dcomm-store (the one meson names in DCOMM_STORE): a job's store in a
// process of its own. Ranks of env:// with DCOMM_STORE_SERVED=1 meet
// through it, rank 0 among them as a client; rank 0 dies, the survivors
// shrink, and a replacement joins through env:// at their grow(); a
// restarted rank whose place the job has not yet claimed takes it.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/cpu_backend.hpp"
#include "dcomm/elastic.hpp"
#include "dcomm/init_process_group.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"

using namespace std::chrono_literals;

namespace store_program {

// dcomm-store --port 0, started and waited for; stopped with SIGTERM.
struct store_server {
  pid_t pid = -1;
  int port = 0;
  std::string folder;

  store_server() {
    const char* program = std::getenv("DCOMM_STORE");
    REQUIRE_MESSAGE(program, "DCOMM_STORE is not set (run the tests through meson)");
    char name[] = "/tmp/dcomm-store-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    folder = name;
    const std::string port_file = folder + "/port";
    std::fflush(nullptr);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::execl(program, program, "--port", "0", "--bind-host", "127.0.0.1", "--port-file",
              port_file.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    for (int i = 0; i < 1000 && !std::filesystem::exists(port_file); ++i)
      std::this_thread::sleep_for(10ms);
    std::ifstream(port_file) >> port;
    REQUIRE(port > 0);
  }
  // SIGTERM; its exit status (-1 if it had to be killed).
  int stop() {
    ::kill(pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < 500; ++i) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }
  ~store_server() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    std::filesystem::remove_all(folder);
  }
};

}  // namespace store_program

TEST_SUITE("store program") {
  TEST_CASE("dcomm-store outlives rank 0: the survivors shrink, a replacement joins over env://") {
    DCOMM_TEST_DEADLINE(90s);
    store_program::store_server server;
    const int world = 4;
    auto results = dcomm::test::fork_world(world + 1, 60s, [&](int index) -> int {
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(server.port).c_str(), 1);
      ::setenv("DCOMM_STORE_SERVED", "1", 1);
      dcomm::init_options<dcomm::cpu_backend> o{.timeout = 20s};
      o.backend.bind_host = "127.0.0.1";
      o.backend.revoke_on_failure = true;
      if (index == world) {
        // The replacement: no rank of its own; admitted at the survivors' grow.
        auto c = dcomm::join<dcomm::cpu_backend>(o);
        std::vector<int> sums{1, c.rank()};
        c.all_reduce(sums, dcomm::sum, dcomm::blocking);
        return c.rank() == world - 1 && sums[0] == world && sums[1] == 6 ? 0 : 2;
      }
      ::setenv("RANK", std::to_string(index).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      auto c = dcomm::init_process_group<dcomm::cpu_backend>(o);
      std::vector<float> v(1 << 12, 1.0f);
      c.all_reduce(v, dcomm::sum, dcomm::blocking);
      if (index == 0) {
        c.all_reduce(v, dcomm::sum, [](std::exception_ptr) {});
        std::this_thread::sleep_for(1ms);
        ::kill(::getpid(), SIGKILL);
      }
      // Rank 0 dies in this all_reduce, or (done before its death) the next.
      for (int step = 0;; ++step) {
        if (step > 1000) return 3;
        try {
          c.all_reduce(v, dcomm::sum, dcomm::blocking);
        } catch (const dcomm::error& e) {
          if (e.code() != dcomm::errc::peer_lost && e.code() != dcomm::errc::revoked) throw;
          break;
        }
      }
      c = c.shrink(dcomm::blocking);
      for (int tries = 0; c.size() < world; ++tries) {
        if (tries > 4000) return 4;
        c = dcomm::grow(c, o, dcomm::blocking);
        std::this_thread::sleep_for(1ms);
      }
      std::vector<int> sums{1, c.rank()};
      c.all_reduce(sums, dcomm::sum, dcomm::blocking);
      return c.rank() == index - 1 && sums[0] == world && sums[1] == 6 ? 0 : 5;
    });
    INFO(dcomm::test::describe(results));
    CHECK(results[0].signal == SIGKILL);
    for (int i = 1; i <= world; ++i) CHECK(results[static_cast<std::size_t>(i)].exit_code == 0);
    CHECK(server.stop() == 0);
  }

  TEST_CASE("join with a RANK not yet claimed (the job still starting) takes that place") {
    DCOMM_TEST_DEADLINE(60s);
    store_program::store_server server;
    auto results = dcomm::test::fork_world(3, 40s, [&](int rank) -> int {
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(server.port).c_str(), 1);
      ::setenv("DCOMM_STORE_SERVED", "1", 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "3", 1);
      dcomm::init_options<dcomm::cpu_backend> o{.timeout = 20s};
      o.backend.bind_host = "127.0.0.1";
      // Rank 1's slot restarted before its first process reached the
      // rendezvous: told to join, it meets ranks 0 and 2 as rank 1.
      auto c = rank == 1 ? dcomm::join<dcomm::cpu_backend>(o)
                         : dcomm::init_process_group<dcomm::cpu_backend>(o);
      std::vector<int> sums{1, c.rank()};
      c.all_reduce(sums, dcomm::sum, dcomm::blocking);
      return c.rank() == rank && c.size() == 3 && sums[0] == 3 && sums[1] == 3 ? 0 : 2;
    });
    INFO(dcomm::test::describe(results));
    for (const auto& r : results) CHECK(r.exit_code == 0);
  }
}
