// The children of one launcher and how they are stopped: a signal (SIGTERM,
// or one the launcher passes on), then SIGKILL to those still running once
// the grace period has passed. dcomm::spawn waits for that in place
// (stop_and_reap); dcomm-run keeps forwarding the ranks' output meanwhile, so
// it calls kill_overdue() from its own loop.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <thread>
#include <vector>

#include "dcomm/launch/child_process.hpp"

namespace dcomm::launch {

class child_group {
 public:
  using clock = std::chrono::steady_clock;

  child_group(std::size_t size, clock::duration grace) : children_(size), grace_(grace) {}

  child_process& operator[](std::size_t i) { return children_[i]; }
  const child_process& operator[](std::size_t i) const { return children_[i]; }
  std::size_t size() const noexcept { return children_.size(); }

  // How many were started and are not reaped yet.
  int running() const noexcept {
    int n = 0;
    for (const auto& c : children_) n += c.running();
    return n;
  }

  // Sends sig to every child still running.
  void signal(int sig) const noexcept {
    for (const auto& c : children_) c.signal(sig);
  }

  // Asks every running child to stop with sig; the first call starts the
  // grace period, at whose end kill_overdue() sends SIGKILL.
  void stop(int sig) {
    signal(sig);
    if (!kill_at_) kill_at_ = clock::now() + grace_;
  }
  bool stopping() const noexcept { return kill_at_.has_value(); }
  bool overdue() const noexcept { return kill_at_ && clock::now() >= *kill_at_; }

  // SIGKILL to every child still running once the grace period has passed.
  void kill_overdue() const noexcept {
    if (overdue()) signal(SIGKILL);
  }

  // Reaps the children that have ended, without waiting: on_end(index,
  // child) for each, in index order, as it is reaped.
  template <typename F>
  void reap_ended(F&& on_end) {
    for (std::size_t i = 0; i < children_.size(); ++i)
      if (children_[i].reap()) on_end(i, children_[i]);
  }

  // stop(SIGTERM), then returns once every child is reaped: those still
  // running at the end of the grace period get SIGKILL, which they cannot
  // refuse, so the blocking wait after it is short.
  void stop_and_reap() {
    stop(SIGTERM);
    for (;;) {
      reap_ended([](std::size_t, const child_process&) {});
      if (running() == 0) return;
      if (overdue()) {
        signal(SIGKILL);
        for (auto& c : children_) c.reap(true);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  std::vector<child_process> children_;
  clock::duration grace_;
  std::optional<clock::time_point> kill_at_;  // set by the first stop()
};

}  // namespace dcomm::launch
