// Per-operation statistics of a process's communicator (every group's
// calls): how many calls of each operation, how many failed, how many
// bytes, and how long they took (mean and quantiles), for
// communicator::stats(). Always on.
//
// Cost: counts and bytes for every call; the time of one call in 16 (a
// precise clock read costs more than the rest of the bookkeeping
// together, and a sample of one in 16 gives the same quantiles for any
// operation called often enough to matter). Where DCOMM_TRACE is set every
// call is timed anyway, and every one counts. Times go into a log-scale
// histogram (4 buckets per power of two: quantiles to within 10 %).
//
// Calls end on their backend's executor, one at a time (a strand), so
// each counter has one writer: relaxed loads and stores, no read-modify-
// write. stats() may read from any thread (a count may lag by a call).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/trace/stragglers.hpp"

namespace dcomm::trace {

// One operation's figures, as communicator::stats() returns them.
struct op_summary {
  std::string operation;     // "all_reduce", "send", ...
  std::uint64_t calls = 0;   // ended, successfully or not
  std::uint64_t failed = 0;  // of those, failed
  std::uint64_t bytes = 0;   // the calls' tensors (a collective's input on this rank)
  std::uint64_t timed = 0;   // calls whose time is in the figures below
  double mean_us = 0, p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;
};

// What communicator::stats() returns: every operation's figures, and who
// calls the collectives last (trace/stragglers.hpp).
struct comm_stats {
  std::vector<op_summary> operations;  // in the order first called
  // Collectives whose messages told of other ranks' calls (groups of more
  // than one), and of those, per world rank, how often it called last and
  // how long after the first rank.
  std::uint64_t collectives_measured = 0;
  std::vector<rank_lateness> ranks;
  double own_late_mean_us = 0;  // this rank: how long after the first rank it called

  // The figures of one operation ("all_reduce"); null if never called.
  const op_summary* operation(std::string_view name) const {
    for (const auto& s : operations)
      if (s.operation == name) return &s;
    return nullptr;
  }
  // The world rank that called last most often (-1: none measured).
  int straggler() const {
    int who = -1;
    std::uint64_t most = 0;
    for (const auto& r : ranks)
      if (r.last > most) {
        most = r.last;
        who = r.rank;
      }
    return who;
  }
};

class op_stats {
 public:
  static constexpr std::size_t max_operations = 32;
  static constexpr unsigned sub_buckets = 4;  // per power of two
  static constexpr std::size_t buckets = 48 * sub_buckets;

  // Whether the call now ending should be timed (one in 16).
  bool sample() noexcept {
    const std::uint32_t t = tick_.load(std::memory_order_relaxed) + 1;
    tick_.store(t, std::memory_order_relaxed);
    return (t & 15) == 0;
  }

  // A call's end. `operation`: the front end's name (a string literal);
  // `duration_ns` < 0: not timed.
  void ended(const char* operation, std::uint64_t bytes, bool failed, std::int64_t duration_ns) {
    entry* e = find(operation);
    if (!e) return;  // more distinct names than max_operations: not counted
    bump(e->calls, 1);
    if (failed) bump(e->failed, 1);
    bump(e->bytes, bytes);
    if (duration_ns < 0) return;
    const auto ns = static_cast<std::uint64_t>(duration_ns);
    bump(e->timed, 1);
    bump(e->total_ns, ns);
    if (ns > e->max_ns.load(std::memory_order_relaxed))
      e->max_ns.store(ns, std::memory_order_relaxed);
    bump(e->histogram[bucket_of(ns)], 1);
  }

  // Every operation called so far, in the order first seen.
  std::vector<op_summary> summary() const {
    std::vector<op_summary> out;
    const std::size_t n = used_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      const entry& e = entries_[i];
      op_summary s;
      s.operation = e.operation.load(std::memory_order_relaxed);
      s.calls = e.calls.load(std::memory_order_relaxed);
      s.failed = e.failed.load(std::memory_order_relaxed);
      s.bytes = e.bytes.load(std::memory_order_relaxed);
      s.timed = e.timed.load(std::memory_order_relaxed);
      if (s.timed) {
        s.mean_us = static_cast<double>(e.total_ns.load(std::memory_order_relaxed)) / 1e3 /
                    static_cast<double>(s.timed);
        s.max_us = static_cast<double>(e.max_ns.load(std::memory_order_relaxed)) / 1e3;
        s.p50_us = std::min(quantile(e, 0.50), s.max_us);
        s.p90_us = std::min(quantile(e, 0.90), s.max_us);
        s.p99_us = std::min(quantile(e, 0.99), s.max_us);
      }
      // The same name from two translation units (two literals): one entry.
      auto same = std::find_if(out.begin(), out.end(),
                               [&](const op_summary& o) { return o.operation == s.operation; });
      if (same == out.end()) {
        out.push_back(std::move(s));
      } else {  // rare: merge counts; times of the first kept
        same->calls += s.calls;
        same->failed += s.failed;
        same->bytes += s.bytes;
      }
    }
    return out;
  }

  // The histogram bucket of a duration: 4 per power of two.
  static std::size_t bucket_of(std::uint64_t ns) {
    if (ns < sub_buckets) return static_cast<std::size_t>(ns);
    const unsigned octave = static_cast<unsigned>(std::bit_width(ns)) - 1;  // >= 2
    const auto sub = static_cast<unsigned>((ns >> (octave - 2)) & (sub_buckets - 1));
    const std::size_t b = (octave - 1) * sub_buckets + sub;
    return b < buckets ? b : buckets - 1;
  }
  // The largest duration a bucket holds (its upper edge), in ns.
  static double bucket_top(std::size_t b) {
    if (b < sub_buckets) return static_cast<double>(b + 1);
    const std::size_t octave = b / sub_buckets + 1, sub = b % sub_buckets;
    return std::ldexp(static_cast<double>(sub_buckets + sub + 1), static_cast<int>(octave) - 2);
  }

 private:
  struct entry {
    std::atomic<const char*> operation{nullptr};
    std::atomic<std::uint64_t> calls{0}, failed{0}, bytes{0}, timed{0}, total_ns{0}, max_ns{0};
    std::array<std::atomic<std::uint64_t>, buckets> histogram{};
  };

  static void bump(std::atomic<std::uint64_t>& v, std::uint64_t by) {
    v.store(v.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }

  // The entry of `operation` (by address; a new one the first time).
  entry* find(const char* operation) {
    const std::size_t n = used_.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < n; ++i)
      if (entries_[i].operation.load(std::memory_order_relaxed) == operation) return &entries_[i];
    if (n == max_operations) return nullptr;
    entries_[n].operation.store(operation, std::memory_order_relaxed);
    used_.store(n + 1, std::memory_order_release);
    return &entries_[n];
  }

  static double quantile(const entry& e, double q) {
    const std::uint64_t total = e.timed.load(std::memory_order_relaxed);
    const auto want = static_cast<std::uint64_t>(std::ceil(q * static_cast<double>(total)));
    std::uint64_t seen = 0;
    for (std::size_t b = 0; b < buckets; ++b) {
      seen += e.histogram[b].load(std::memory_order_relaxed);
      if (seen >= want && seen > 0) return bucket_top(b) / 1e3;
    }
    return bucket_top(buckets - 1) / 1e3;
  }

  std::atomic<std::uint32_t> tick_{0};
  std::atomic<std::size_t> used_{0};
  std::array<entry, max_operations> entries_{};
};

}  // namespace dcomm::trace
