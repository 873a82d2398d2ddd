// The README's demo: ranks find each other through env:// and use the store
// they share, as every dcomm job does before its first collective.
//
//   rendezvous_demo --world 4     start 4 local ranks (forked, each reading
//                                 MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)
//   rendezvous_demo               one rank of a job started by mpirun, srun,
//                                 torchrun or a launcher that sets the env.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <dcomm/command_line.hpp>
#include <dcomm/rendezvous.hpp>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

int rank_main() {
  auto start = std::chrono::steady_clock::now();
  auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 60s});
  auto& store = *world.store;
  const int rank = world.rank, size = world.world_size;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                  start)
                .count();
  std::printf("[rank %d/%d] joined via %s at %s in %lld ms\n", rank, size,
              world.spec.launcher.c_str(), store.address().c_str(), static_cast<long long>(ms));

  // Publish who we are, and add rank+1 to a shared counter.
  store.set("who/" + std::to_string(rank), dcomm::detail::whoami(), dcomm::blocking);
  store.add("sum", rank + 1, dcomm::blocking);
  store.set("arrived/" + std::to_string(rank), "1", dcomm::blocking);
  std::vector<std::string> everyone;
  for (int r = 0; r < size; ++r) everyone.push_back("arrived/" + std::to_string(r));
  store.wait(everyone, dcomm::blocking);

  long long sum = std::stoll(store.get("sum", dcomm::blocking));
  long long expected = static_cast<long long>(size) * (size + 1) / 2;
  std::printf("[rank %d/%d] sum of (rank+1) over all ranks = %lld (expected %lld)\n", rank, size,
              sum, expected);

  // Exactly one rank wins a compare_set race.
  auto leader = store.compare_set("leader", "", std::to_string(rank), dcomm::blocking);
  if (leader == std::to_string(rank))
    std::printf("[rank %d/%d] won the leader election\n", rank, size);

  if (rank == 0) {
    std::printf("[rank 0/%d] the world:\n", size);
    for (int r = 0; r < size; ++r)
      std::printf("    rank %d: %s\n", r,
                  store.get("who/" + std::to_string(r), dcomm::blocking).c_str());
  }
  dcomm::depart(world, dcomm::blocking);  // rank 0 serves the store: it leaves last
  std::fflush(stdout);
  return sum == expected ? 0 : 1;
}

// Forks `size` local ranks; rank 0 inherits a listening socket on a free
// port, so no two jobs race for a port.
int spawn_local(int size) {
  asio::io_context ctx;
  asio::ip::tcp::acceptor acceptor(ctx, {asio::ip::make_address("127.0.0.1"), 0});
  auto port = acceptor.local_endpoint().port();
  std::printf("starting %d ranks, store on 127.0.0.1:%u\n", size, static_cast<unsigned>(port));
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < size; ++rank) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(size).c_str(), 1);
      if (rank == 0)
        ::setenv("DCOMM_MASTER_LISTEN_FD", std::to_string(acceptor.native_handle()).c_str(), 1);
      else
        acceptor.close();
      int code = 1;
      try {
        code = rank_main();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d/%d] %s\n", rank, size, e.what());
      }
      std::fflush(nullptr);
      std::_Exit(code);
    }
    pids.push_back(pid);
  }
  acceptor.close();
  // Wait for all, at most 90 s; one failing rank stops the others.
  int failed = 0;
  auto deadline = std::chrono::steady_clock::now() + 90s;
  std::vector<bool> done(pids.size(), false);
  for (std::size_t left = pids.size(); left > 0;) {
    for (std::size_t r = 0; r < pids.size(); ++r) {
      int status = 0;
      if (done[r] || ::waitpid(pids[r], &status, WNOHANG) <= 0) continue;
      done[r] = true;
      --left;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "rank %zu failed (%s %d); stopping the others\n", r,
                     WIFEXITED(status) ? "exit status" : "signal",
                     WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        if (!failed) failed = 1;
        for (std::size_t o = 0; o < pids.size(); ++o)
          if (!done[o]) ::kill(pids[o], SIGTERM);
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "ranks still running after 90 s; killing them\n");
      for (std::size_t o = 0; o < pids.size(); ++o)
        if (!done[o]) ::kill(pids[o], SIGKILL);
      failed = 1;
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(5ms);
  }
  if (!failed) std::printf("all %d ranks finished\n", size);
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  int world = 0;  // 0: one rank of a launched job
  dcomm::command_line cl("rendezvous_demo",
                         "Ranks find each other through env:// and use the store they share.");
  cl.option("world", world, "N",
            "start N local ranks; without it, this process is one rank of a job whose launcher "
            "set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE")
      .at_least(1)
      .at_most(256);
  cl.parse(argc, argv);
  try {
    return world > 0 ? spawn_local(world) : rank_main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
