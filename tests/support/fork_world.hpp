// Runs a function in N forked processes (one per rank) and collects how each
// ended, killing the ones still running at the deadline. Multi-process tests
// use it to exercise real process boundaries: separate address spaces, file
// locks held per process, a rank that dies.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace dcomm::test {

struct child_result {
  int rank = -1;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;
  bool ok() const { return exit_code == 0 && !timed_out; }
};

// fn(rank) returns the child's exit code; an exception prints its what()
// and exits 1.
inline std::vector<child_result> fork_world(int n, std::chrono::milliseconds limit,
                                            const std::function<int(int)>& fn) {
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      std::perror("fork");
      std::abort();
    }
    if (pid == 0) {
      int code = 1;
      try {
        code = fn(rank);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      } catch (...) {
        std::fprintf(stderr, "rank %d: unknown exception\n", rank);
      }
      std::fflush(nullptr);
      std::_Exit(code);  // no atexit handlers: they belong to the parent
    }
    pids.push_back(pid);
  }
  std::vector<child_result> results(static_cast<std::size_t>(n));
  auto deadline = std::chrono::steady_clock::now() + limit;
  int remaining = n;
  while (remaining > 0) {
    for (int rank = 0; rank < n; ++rank) {
      auto& r = results[static_cast<std::size_t>(rank)];
      if (r.rank >= 0) continue;
      int status = 0;
      if (::waitpid(pids[static_cast<std::size_t>(rank)], &status, WNOHANG) > 0) {
        r.rank = rank;
        if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
        --remaining;
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (int rank = 0; rank < n; ++rank) {
        auto& r = results[static_cast<std::size_t>(rank)];
        if (r.rank >= 0) continue;
        ::kill(pids[static_cast<std::size_t>(rank)], SIGKILL);
        ::waitpid(pids[static_cast<std::size_t>(rank)], nullptr, 0);
        r.rank = rank;
        r.timed_out = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return results;
}

inline std::string describe(const std::vector<child_result>& results) {
  std::string s;
  for (const auto& r : results)
    s += "rank " + std::to_string(r.rank) + ": " +
         (r.timed_out ? std::string("timed out")
          : r.signal  ? "signal " + std::to_string(r.signal)
                      : "exit " + std::to_string(r.exit_code)) +
         "; ";
  return s;
}

}  // namespace dcomm::test
