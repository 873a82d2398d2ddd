// dcomm-run --elastic's rule for a rank that fails: its slot is restarted
// (the new process joins the running job: DCOMM_JOINING=1) while restarts
// are left and at least --min-ranks of this node's ranks still run;
// otherwise the job ends. And what happened, for the summary.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace dcomm_run {

class restart_policy {
 public:
  enum class verdict { restart, no_restarts_left, too_few_ranks };

  restart_policy(int max_restarts, int min_ranks) : max_(max_restarts), min_(min_ranks) {}

  // For a rank that failed while `survivors` of this node's ranks run.
  verdict decide(int survivors) const {
    if (survivors < min_) return verdict::too_few_ranks;
    if (used_ >= max_) return verdict::no_restarts_left;
    return verdict::restart;
  }

  // Counts a restart; returns its number (1 for the first).
  int restarted() { return ++used_; }
  int used() const noexcept { return used_; }
  int max() const noexcept { return max_; }
  int min_ranks() const noexcept { return min_; }

  // A line for the summary: "at 2.31 s: rank 2 (pid 123) was killed by
  // signal 9 (Killed); restarted (1 of 3)".
  void note(double seconds, const std::string& what) {
    char at[32];
    std::snprintf(at, sizeof at, "%.2f s", seconds);
    events_.push_back(std::string(at) + ": " + what);
  }

  // The summary dcomm-run prints when the job has ended.
  std::string summary(const std::string& ending) const {
    std::string s = "dcomm-run: elastic job: " + std::to_string(events_.size()) + " failure(s), " +
                    std::to_string(used_) + " restart(s) of --max-restarts " +
                    std::to_string(max_) + "; " + ending + "\n";
    for (const auto& e : events_) s += "dcomm-run:   at " + e + "\n";
    return s;
  }

 private:
  int max_;
  int min_;
  int used_ = 0;
  std::vector<std::string> events_;
};

}  // namespace dcomm_run
