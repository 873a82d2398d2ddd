// The job's store under dcomm-run --elastic: dcomm-store (installed, or
// built, beside dcomm-run) in a child of its own, so that the store outlives
// every rank, rank 0 included, as torchrun's agent's store does
// (docs/elastic.md). It serves on the socket dcomm-run picked for the job
// (the ranks connect to it: DCOMM_STORE_SERVED=1), or binds --master-port,
// and dies with dcomm-run.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/launch/child_process.hpp"
#include "output.hpp"
#include "trace_tool.hpp"

namespace dcomm_run {

class store_process {
 public:
  static constexpr std::chrono::seconds stop_grace{2};

  // Starts dcomm-store on `listen_fd` (-1: bound to `port` on every
  // interface), authenticated by `token` where there is one. False, having
  // said why, when it cannot be started.
  bool start(int listen_fd, int port, const std::optional<std::string>& token, pid_t launcher) {
    const std::string program = beside_this_program("dcomm-store");
    if (::access(program.c_str(), X_OK) != 0) {
      std::fprintf(stderr,
                   "dcomm-run: --elastic serves the job's store with dcomm-store, which is not "
                   "beside dcomm-run (%s: %s); build or install it with dcomm-run\n",
                   program.c_str(), std::strerror(errno));
      return false;
    }
    std::vector<std::string> args{program};
    if (listen_fd >= 0) {
      args.insert(args.end(), {"--listen-fd", std::to_string(listen_fd)});
    } else {
      args.insert(args.end(), {"--port", std::to_string(port)});
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::fflush(nullptr);
    // A process group of its own: a Ctrl-C at the terminal is dcomm-run's
    // to pass on to the ranks; the store stays until they have ended, then
    // gets SIGTERM.
    pid_ = dcomm::launch::fork_child(launcher, {SIGINT, SIGTERM, SIGPIPE, SIGCHLD}, [&] {
      ::setpgid(0, 0);
      if (listen_fd >= 0) ::fcntl(listen_fd, F_SETFD, 0);
      if (token)
        ::setenv("DCOMM_JOB_TOKEN", token->c_str(), 1);
      else
        ::unsetenv("DCOMM_JOB_TOKEN");
      // Its one line ("serving on ...") is dcomm-run's to print, not the job's output.
      const int null = ::open("/dev/null", O_WRONLY);
      if (null >= 0) ::dup2(null, 1);
      ::execv(argv[0], argv.data());
      write_all(2, "dcomm-run: cannot run " + args[0] + ": " + std::strerror(errno) + "\n");
      ::_exit(127);
    });
    if (pid_ < 0) {
      std::perror("dcomm-run: fork");
      return false;
    }
    return true;
  }

  pid_t pid() const noexcept { return pid_; }

  // How it ended, where it has (without waiting): a store that ends before
  // the ranks do ends the job.
  std::optional<int> ended() {
    if (pid_ <= 0 || status_) return status_;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) status_ = st;
    return status_;
  }

  // SIGTERM (its loop ends at once), and SIGKILL where it has not ended
  // within stop_grace (stopped, or stuck): then the wait is short.
  void stop() {
    if (pid_ <= 0 || ended()) return;
    ::kill(pid_, SIGTERM);
    const auto until = std::chrono::steady_clock::now() + stop_grace;
    while (!ended() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (ended()) return;
    ::kill(pid_, SIGKILL);
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    status_ = st;
  }

  ~store_process() { stop(); }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

}  // namespace dcomm_run
