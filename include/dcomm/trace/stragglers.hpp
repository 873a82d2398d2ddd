// Stragglers: which rank calls the collectives last, and how late, for
// communicator::stats() and a warning. Measured from each call's own
// messages (detail/arrivals.hpp: every message carries when the call's
// ranks called it, as far as its sender knew), so no extra round: once a
// collective ends, this rank knows which rank called it last and how long
// after the first (for a call whose result needs every rank's input; the
// rooted ones hear of every rank through their confirmation).
//
// The warning: world rank 0 prints one (DCOMM_LOG_LEVEL warning, the
// default) when one rank called last in at least 48 of the last 64
// collectives it measured, on average at least DCOMM_STRAGGLER_MS (default
// 1; 0: never) after the first rank; then at most once a minute.
//
// Calls end on their backend's executor, one at a time, so each counter
// has one writer (relaxed loads and stores, as op_stats); the window
// behind the warning is the writer's alone.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "dcomm/backend.hpp"

namespace dcomm::trace {

// One rank's figures, as communicator::stats() returns them.
struct rank_lateness {
  int rank = 0;             // world rank
  std::uint64_t last = 0;   // measured collectives it called last
  double late_mean_us = 0;  // then, how long after the first rank (mean, max)
  double late_max_us = 0;
};

class straggler_stats {
 public:
  static constexpr std::size_t window = 64;
  static constexpr std::size_t warn_count = 48;  // of `window`
  static constexpr std::int64_t warn_every_ns = 60'000'000'000;

  // Made once the world is known: per-rank counters (the only allocation).
  void set_world(int world, int rank) {
    rank_ = rank;
    ranks_ = std::make_unique<counters[]>(static_cast<std::size_t>(world));
    world_ = world;
    in_window_.assign(static_cast<std::size_t>(world), 0);
    window_late_.assign(static_cast<std::size_t>(world), 0);
    warn_after_ns_ = threshold_from_environment();
  }

  // A collective ended, with what its messages told of its arrivals
  // (a.others: of another rank's call) and this rank's own call time.
  // True when the warning is due (warning() says it).
  bool measured(const detail::arrivals& a, std::int64_t own_ns, std::int64_t now_ns) {
    if (!a.others || a.last_rank < 0 || a.last_rank >= world_) return false;
    const auto late = static_cast<std::uint64_t>(std::max<std::int64_t>(a.spread_ns(), 0));
    counters& c = ranks_[static_cast<std::size_t>(a.last_rank)];
    bump(c.last, 1);
    bump(c.late_ns, late);
    if (late > c.late_max_ns.load(std::memory_order_relaxed))
      c.late_max_ns.store(late, std::memory_order_relaxed);
    bump(measured_, 1);
    bump(own_late_ns_, static_cast<std::uint64_t>(std::max<std::int64_t>(own_ns - a.first_ns, 0)));
    return rank_ == 0 && warn_after_ns_ > 0 && slide(a.last_rank, late, now_ns);
  }

  // The warning measured() found due.
  std::string warning() const {
    char line[320];
    std::snprintf(line, sizeof line,
                  "rank %d called last in %zu of the last %zu collectives, on average %.3f ms "
                  "after the first rank: a straggler (slower data loading, compute or host?); "
                  "comm.stats() has the figures, DCOMM_STRAGGLER_MS=0 silences this",
                  warned_rank_, warned_count_, window, static_cast<double>(warned_mean_ns_) / 1e6);
    return line;
  }

  std::uint64_t collectives_measured() const { return measured_.load(std::memory_order_relaxed); }
  // This rank: how long after the first rank it called, on average.
  double own_late_mean_us() const {
    const auto n = collectives_measured();
    return n ? static_cast<double>(own_late_ns_.load(std::memory_order_relaxed)) / 1e3 /
                   static_cast<double>(n)
             : 0.0;
  }
  std::vector<rank_lateness> ranks() const {
    std::vector<rank_lateness> out;
    for (int r = 0; r < world_; ++r) {
      const counters& c = ranks_[static_cast<std::size_t>(r)];
      rank_lateness l{.rank = r, .last = c.last.load(std::memory_order_relaxed)};
      if (l.last) {
        l.late_mean_us = static_cast<double>(c.late_ns.load(std::memory_order_relaxed)) / 1e3 /
                         static_cast<double>(l.last);
        l.late_max_us = static_cast<double>(c.late_max_ns.load(std::memory_order_relaxed)) / 1e3;
      }
      out.push_back(l);
    }
    return out;
  }

  // DCOMM_STRAGGLER_MS, else 1 ms; 0 (or less): no warning.
  static std::int64_t threshold_from_environment() {
    if (const char* v = std::getenv("DCOMM_STRAGGLER_MS"); v && *v) {
      char* end = nullptr;
      const double ms = std::strtod(v, &end);
      if (end != v && *end == '\0') return ms > 0 ? static_cast<std::int64_t>(ms * 1e6) : 0;
    }
    return 1'000'000;
  }

 private:
  struct counters {
    std::atomic<std::uint64_t> last{0}, late_ns{0}, late_max_ns{0};
  };

  static void bump(std::atomic<std::uint64_t>& v, std::uint64_t by) {
    v.store(v.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }

  // The window moves on by one call; true where one rank dominates it and
  // no warning was given in the last minute.
  bool slide(int last, std::uint64_t late, std::int64_t now_ns) {
    slot& s = slots_[next_ % window];
    if (next_ >= window) {
      --in_window_[static_cast<std::size_t>(s.rank)];
      window_late_[static_cast<std::size_t>(s.rank)] -= s.late_ns;
    }
    s = {last, late};
    ++next_;
    const auto r = static_cast<std::size_t>(last);
    ++in_window_[r];
    window_late_[r] += late;
    if (next_ < window || in_window_[r] < warn_count) return false;
    const std::uint64_t mean = window_late_[r] / in_window_[r];
    if (mean < static_cast<std::uint64_t>(warn_after_ns_)) return false;
    if (warned_ && now_ns - last_warning_ns_ < warn_every_ns) return false;
    warned_ = true;
    last_warning_ns_ = now_ns;
    warned_rank_ = last;
    warned_count_ = in_window_[r];
    warned_mean_ns_ = mean;
    return true;
  }

  int rank_ = 0, world_ = 0;
  std::unique_ptr<counters[]> ranks_;
  std::atomic<std::uint64_t> measured_{0}, own_late_ns_{0};
  // The warning's window (the writer's alone).
  struct slot {
    int rank = 0;
    std::uint64_t late_ns = 0;
  };
  std::array<slot, window> slots_{};
  std::size_t next_ = 0;
  std::vector<std::size_t> in_window_;
  std::vector<std::uint64_t> window_late_;
  std::int64_t warn_after_ns_ = 1'000'000;
  bool warned_ = false;
  std::int64_t last_warning_ns_ = 0;
  int warned_rank_ = -1;  // what the last warning said
  std::size_t warned_count_ = 0;
  std::uint64_t warned_mean_ns_ = 0;
};

}  // namespace dcomm::trace
