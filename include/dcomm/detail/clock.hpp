// The clock every deadline in dcomm is measured on, and the arithmetic on
// deadlines that several components share. Not in the public namespace:
// `dcomm::clock` clashed with ::clock under `using namespace dcomm`.
#pragma once

#include <algorithm>
#include <chrono>

namespace dcomm::detail {

using clock = std::chrono::steady_clock;

// What is left until a deadline, never negative: for calls that take a
// timeout where the caller holds a deadline.
inline std::chrono::milliseconds time_left(clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max(deadline - clock::now(), clock::duration::zero()));
}

}  // namespace dcomm::detail
