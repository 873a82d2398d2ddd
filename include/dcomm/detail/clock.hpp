// The clock every deadline in dcomm is measured on, and the arithmetic on
// deadlines that several components share. Not in the public namespace:
// `dcomm::clock` clashed with ::clock under `using namespace dcomm`.
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace dcomm::detail {

using clock = std::chrono::steady_clock;

// What is left until a deadline, never negative: for calls that take a
// timeout where the caller holds a deadline.
inline std::chrono::milliseconds time_left(clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max(deadline - clock::now(), clock::duration::zero()));
}

// The clock's time in nanoseconds, read cheaply: CLOCK_MONOTONIC_COARSE
// (the clock steady_clock reads, as of the last tick: a few milliseconds
// behind at most, at a fifth of the cost). For times that need no more:
// when a recorded operation ended, what a rank's board says.
inline std::int64_t coarse_steady_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

}  // namespace dcomm::detail
