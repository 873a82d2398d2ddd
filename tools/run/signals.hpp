// dcomm-run's signals: SIGINT and SIGTERM noted for the job's loop to pass
// on, SIGPIPE ignored, and SIGCHLD stamping when each rank was first seen
// dead (the order in which ranks failed, even when the loop reaps several
// in one pass: a rank that died, and a survivor that exited on the lost
// peer a millisecond later). SIGCHLD also cuts the loop's poll short.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstdint>

#include "options.hpp"

namespace dcomm_run {

inline volatile std::sig_atomic_t received_signal = 0;
inline void on_signal(int sig) {
  received_signal = sig;
}

// By local rank (a slot: a restarted rank's process takes its slot over).
struct death_stamps {
  static constexpr std::size_t max_ranks = max_local_ranks;
  std::atomic<pid_t> pid[max_ranks] = {};
  std::atomic<std::int64_t> ns[max_ranks] = {};  // 0: not seen dead
  std::atomic<std::size_t> count{0};

  // The SIGCHLD handler watches slot `local`'s new process from now on.
  void watch(std::size_t local, pid_t p) noexcept {
    ns[local].store(0, std::memory_order_relaxed);
    pid[local].store(p, std::memory_order_relaxed);
  }
};
inline death_stamps deaths;

inline std::int64_t monotonic_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

inline void on_child_ended(int) {
  const int saved = errno;  // waitid may change it under the interrupted code
  const std::size_t n = deaths.count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const pid_t pid = deaths.pid[i].load(std::memory_order_relaxed);
    if (pid <= 0 || deaths.ns[i].load(std::memory_order_relaxed) != 0) continue;
    siginfo_t info{};
    // WNOWAIT: seen, not reaped (the loop reaps it).
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == pid)
      deaths.ns[i].store(monotonic_ns(), std::memory_order_relaxed);
  }
  errno = saved;
}

// SIGINT and SIGTERM are only noted here (received_signal); the job's loop
// passes them on. SIGPIPE is ignored: a closed stdout must not kill the
// launcher while its ranks run (they get the default back, fork_child).
inline void pass_signals_to_ranks() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  struct sigaction child {};
  child.sa_handler = on_child_ended;
  sigemptyset(&child.sa_mask);
  child.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  ::sigaction(SIGCHLD, &child, nullptr);
}

}  // namespace dcomm_run
