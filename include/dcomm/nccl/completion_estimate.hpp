// How long an NCCL operation that is waited for usually takes, by kind and
// size, so that the wait can sleep through most of it
// (nccl_backend::wait_gpu, nccl/impl/wait.hpp). Plain C++: no CUDA or NCCL
// header, so its unit test runs without them, in the unit tests
// (tests/nccl/completion_estimate_test.cpp).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

namespace dcomm::nccl {

// When a waiting operation looks for its completion. Polling the event
// (options::spin) finishes small operations within a microsecond or two of
// NCCL's own, but a long operation cannot be polled throughout without
// busy-waiting a core, and the ways of sleeping are slow to wake: a host
// function's post to the executor and a timer both wake tens of
// microseconds late (docs/performance.md, "Figures behind the code"). So
// an operation whose kind and size class (bit
// width of its byte count) has been seen sleeps through most of its
// typical duration and polls only the tail, as Linux's hybrid polling of
// NVMe does. The typical duration adapts: a finish seen while polling moves
// it a quarter of the way to the elapsed time, a finish found at once on
// waking (overslept) cuts it by an eighth.
class completion_estimate {
 public:
  using duration = std::chrono::nanoseconds;
  // Asleep no less than this, or not at all.
  static constexpr duration min_sleep = std::chrono::microseconds(50);

  // The margin kept before the typical finish: a timer's lateness and the
  // spread of durations.
  static duration margin(duration typical) { return std::chrono::microseconds(100) + typical / 32; }
  // How long to sleep first; zero without a typical duration long enough.
  duration sleep_for(const char* operation, std::size_t bytes) const {
    const duration t = find(operation, bytes);
    const duration d = t - margin(t);
    return d >= min_sleep ? d : duration::zero();
  }
  // How long to poll (after the sleep, if any) before falling back to the
  // host function's wake-up: `spin`, and for operations typically longer
  // than that, until well past their typical finish.
  duration poll_for(const char* operation, std::size_t bytes, duration spin) const {
    const duration t = find(operation, bytes);
    return t > spin ? spin + 2 * margin(t) : spin;
  }
  void finished(const char* operation, std::size_t bytes, duration elapsed) {
    duration& t = slot(operation, bytes);
    t = t == duration::zero() ? elapsed : t + (elapsed - t) / 4;
  }
  void overslept(const char* operation, std::size_t bytes) {
    duration& t = slot(operation, bytes);
    t -= t / 8;
  }
  duration typical(const char* operation, std::size_t bytes) const {
    return find(operation, bytes);
  }

 private:
  using classes = std::array<duration, 65>;  // by std::bit_width of the byte count
  duration find(const char* operation, std::size_t bytes) const {
    for (auto& [name, c] : kinds_)
      if (name == operation || std::strcmp(name, operation) == 0)
        return c[static_cast<std::size_t>(std::bit_width(bytes))];
    return duration::zero();
  }
  duration& slot(const char* operation, std::size_t bytes) {
    auto it = std::find_if(kinds_.begin(), kinds_.end(), [&](auto& k) {
      return k.first == operation || std::strcmp(k.first, operation) == 0;
    });
    if (it == kinds_.end()) it = kinds_.insert(kinds_.end(), {operation, classes{}});
    return it->second[static_cast<std::size_t>(std::bit_width(bytes))];
  }
  std::vector<std::pair<const char*, classes>> kinds_;  // operation names are literals
};

}  // namespace dcomm::nccl
