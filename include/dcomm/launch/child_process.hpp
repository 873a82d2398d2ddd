// One child process of a launcher: how it is forked (tied to the launcher's
// life, its stop signals restored), reaped, and how it ended, in words.
#pragma once

#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace dcomm::launch {

// Called in a child right after fork: it is killed when the thread that
// forked it exits (PR_SET_PDEATHSIG; for a launcher that thread lives as long
// as the launcher does), and at once if the parent died before the call (the
// child was then adopted by another process, so getppid() differs).
inline void die_with_parent(pid_t parent) noexcept {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::raise(SIGKILL);
}

// Forks a child of `launcher` (the caller's getpid(), taken before the fork).
// The child dies with the forking thread (die_with_parent), and gets the
// default action back for `stop_signals`: the launcher's handlers, or an
// SIG_IGN kept across exec, must not keep it from being stopped. Those
// signals are blocked across the fork and until the child has reset them, so
// one sent at once (a rank that fails at start-up gets the others stopped)
// is not handled by the launcher's handler in the child; it takes effect when
// the child unblocks them. Then the child runs body(), which must not return:
// it execs or exits. If body returns or throws anyway, the child exits with
// 127 at once, never carrying on as a copy of the launcher (and never running
// the launcher's atexit handlers).
// Returns the child's pid, or -1 with errno set when fork() failed.
template <typename Body>
pid_t fork_child(pid_t launcher, std::initializer_list<int> stop_signals, Body&& body) {
  sigset_t blocked, before;
  ::sigemptyset(&blocked);
  for (int sig : stop_signals) ::sigaddset(&blocked, sig);
  ::pthread_sigmask(SIG_BLOCK, &blocked, &before);
  const pid_t pid = ::fork();
  if (pid != 0) {
    const int err = errno;
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    errno = err;
    return pid;
  }
  die_with_parent(launcher);
  for (int sig : stop_signals) ::signal(sig, SIG_DFL);
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  try {
    body();
  } catch (...) {
  }
  std::_Exit(127);
}

// A forked child as its launcher tracks it.
struct child_process {
  pid_t pid = -1;     // -1: not started
  bool done = false;  // reaped
  int status = 0;     // waitpid's status, once done

  bool running() const noexcept { return pid > 0 && !done; }

  // Collects the exit status if the child has ended; with `block`, waits for
  // it to end (call it after SIGKILL only: then the wait is short). True when
  // the status was collected by this call.
  bool reap(bool block = false) noexcept {
    if (!running()) return false;
    int st = 0;
    pid_t got;
    do {
      got = ::waitpid(pid, &st, block ? 0 : WNOHANG);
    } while (got < 0 && errno == EINTR && block);
    if (got <= 0) return false;
    done = true;
    status = st;
    return true;
  }

  void signal(int sig) const noexcept {
    if (running()) ::kill(pid, sig);
  }
};

// How a child ended, for messages: "exit status 3", "signal 9 (Killed)".
inline std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = ::strsignal(WTERMSIG(status));
    return "signal " + std::to_string(WTERMSIG(status)) +
           (name ? std::string(" (") + name + ")" : "");
  }
  return "status " + std::to_string(status);
}

}  // namespace dcomm::launch
