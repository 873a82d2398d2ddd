// dcomm::nccl::completion_estimate, the NCCL backend's record of how long
// its waited-for operations usually take. Plain C++ (no CUDA or NCCL
// header), so it runs in the unit tests, without a GPU.
//
// The expectations are worked out here from what the estimate promises
// (docs/gpu.md): asleep until 100 us + 1/32 of the typical duration before
// the typical finish, and not at all for less than 50 us; polled for the
// spin, or for operations typically longer than it, for the spin and twice
// that margin; a finish moves the typical duration a quarter of the way to
// it, an oversleep cuts it by an eighth; one record per operation name and
// bit width of the byte count. Durations are in nanoseconds, and the inputs
// are chosen so that the divisions come out whole.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "dcomm/nccl/completion_estimate.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;

namespace {

using estimate = dcomm::nccl::completion_estimate;
using ns = std::chrono::nanoseconds;
constexpr ns spin = 50us;  // options::spin's default
constexpr std::size_t mib = std::size_t{1} << 20;

// An estimate that has seen one `operation` of `bytes` take `typical`.
estimate seen(ns typical, const char* operation = "all_reduce", std::size_t bytes = mib) {
  estimate e;
  e.finished(operation, bytes, typical);
  return e;
}

}  // namespace

TEST_SUITE("completion_estimate") {
  TEST_CASE("nothing seen: no sleep, the spin only") {
    DCOMM_TEST_DEADLINE(60s);
    estimate e;
    CHECK(e.typical("all_reduce", mib) == ns(0));
    CHECK(e.sleep_for("all_reduce", mib) == ns(0));
    CHECK(e.poll_for("all_reduce", mib, spin) == spin);
    CHECK(e.poll_for("all_reduce", mib, ns(0)) == ns(0));
    CHECK(estimate::min_sleep == 50us);
  }

  TEST_CASE("the first finish is taken whole") {
    DCOMM_TEST_DEADLINE(60s);
    CHECK(seen(12us).typical("all_reduce", mib) == 12us);
    CHECK(seen(ns(1'234'567)).typical("all_reduce", mib) == ns(1'234'567));
  }

  TEST_CASE("a 1 ms operation sleeps to its margin before the finish and polls past it") {
    DCOMM_TEST_DEADLINE(60s);
    const estimate e = seen(1ms);
    // margin: 100 us + 1000 us / 32 = 131.25 us.
    CHECK(e.sleep_for("all_reduce", mib) == ns(868'750));        // 1000 - 131.25 us
    CHECK(e.poll_for("all_reduce", mib, spin) == ns(312'500));   // 50 + 2 * 131.25 us
    CHECK(e.poll_for("all_reduce", mib, ns(0)) == ns(262'500));  // 2 * 131.25 us
    CHECK(estimate::margin(1ms) == ns(131'250));
    CHECK(estimate::margin(ns(0)) == 100us);
  }

  TEST_CASE("operations up to the spin never sleep and poll for the spin only") {
    DCOMM_TEST_DEADLINE(60s);
    for (ns t : {ns(1), ns(12'000), ns(49'999), ns(50'000)}) {
      CAPTURE(t.count());
      const estimate e = seen(t);
      CHECK(e.sleep_for("all_reduce", mib) == ns(0));
      CHECK(e.poll_for("all_reduce", mib, spin) == spin);
    }
    // Just past the spin: polled for the spin and twice the margin
    // (100 us + 64 us / 32 = 102 us).
    CHECK(seen(64us).poll_for("all_reduce", mib, spin) == ns(50'000 + 2 * 102'000));
  }

  TEST_CASE("a sleep shorter than 50 us is not taken") {
    DCOMM_TEST_DEADLINE(60s);
    // 100 us: the margin (103.125 us) is longer than the operation. Polled
    // to well past its end instead: 50 + 2 * 103.125 us, or without a spin
    // 2 * 103.125 us.
    const estimate e100 = seen(100us);
    CHECK(e100.sleep_for("all_reduce", mib) == ns(0));
    CHECK(e100.poll_for("all_reduce", mib, spin) == ns(256'250));
    CHECK(e100.poll_for("all_reduce", mib, ns(0)) == ns(206'250));
    // The sleep would be t - 100 us - t/32: 50 us at t = 154.84 us.
    // 154'816 ns = 32 * 4'838: 154'816 - 100'000 - 4'838 = 49'978 ns: no.
    CHECK(seen(ns(154'816)).sleep_for("all_reduce", mib) == ns(0));
    // 154'848 ns = 32 * 4'839: 154'848 - 100'000 - 4'839 = 50'009 ns: yes.
    CHECK(seen(ns(154'848)).sleep_for("all_reduce", mib) == ns(50'009));
    // 160 us: 160 - 100 - 5 = 55 us.
    CHECK(seen(160us).sleep_for("all_reduce", mib) == 55us);
  }

  TEST_CASE("a finish moves the typical duration a quarter of the way to it") {
    DCOMM_TEST_DEADLINE(60s);
    estimate e = seen(1ms);
    e.finished("all_reduce", mib, 2ms);
    CHECK(e.typical("all_reduce", mib) == ns(1'250'000));
    e.finished("all_reduce", mib, 2ms);
    CHECK(e.typical("all_reduce", mib) == ns(1'437'500));
    e.finished("all_reduce", mib, 2ms);
    CHECK(e.typical("all_reduce", mib) == ns(1'578'125));
    // Downwards as well: 1 ms, then 200 us: 1000 - 800 / 4 = 800 us.
    estimate down = seen(1ms);
    down.finished("all_reduce", mib, 200us);
    CHECK(down.typical("all_reduce", mib) == 800us);
  }

  TEST_CASE("repeated finishes close the gap to a new duration by a quarter each") {
    DCOMM_TEST_DEADLINE(60s);
    // From 2^20 ns towards 2^21 ns: the gap after k finishes is
    // 2^20 * (3/4)^k, whole for k <= 10.
    const ns from(std::int64_t{1} << 20), to(std::int64_t{1} << 21);
    estimate e = seen(from);
    std::int64_t gap = std::int64_t{1} << 20;
    for (int k = 1; k <= 10; ++k) {
      e.finished("all_reduce", mib, to);
      gap = gap / 4 * 3;
      CAPTURE(k);
      CHECK(e.typical("all_reduce", mib) == to - ns(gap));
    }
    CHECK(gap == 59'049);  // 2^20 * 3^10 / 4^10 = 3^10
  }

  TEST_CASE("an oversleep cuts the typical duration by an eighth") {
    DCOMM_TEST_DEADLINE(60s);
    estimate e = seen(ns(1'048'576));  // 4 * 8^6: whole after six cuts
    const std::int64_t expected[] = {917'504, 802'816, 702'464, 614'656, 537'824, 470'596};
    for (std::int64_t want : expected) {
      e.overslept("all_reduce", mib);
      CHECK(e.typical("all_reduce", mib) == ns(want));
    }
    // An operation never seen: nothing to cut, and the first finish is
    // still taken whole.
    estimate fresh;
    fresh.overslept("broadcast", mib);
    CHECK(fresh.typical("broadcast", mib) == ns(0));
    CHECK(fresh.sleep_for("broadcast", mib) == ns(0));
    fresh.finished("broadcast", mib, 300us);
    CHECK(fresh.typical("broadcast", mib) == 300us);
  }

  TEST_CASE("one record per operation and bit width of the byte count") {
    DCOMM_TEST_DEADLINE(60s);
    estimate e;
    e.finished("all_reduce", 1024, 100us);  // bit width 11: 1024 to 2047 bytes
    CHECK(e.typical("all_reduce", 1024) == 100us);
    CHECK(e.typical("all_reduce", 2047) == 100us);
    CHECK(e.typical("all_reduce", 1023) == ns(0));
    CHECK(e.typical("all_reduce", 2048) == ns(0));
    CHECK(e.typical("broadcast", 1024) == ns(0));
    // Empty operations and one byte are classes of their own.
    e.finished("all_reduce", 0, 7us);
    e.finished("all_reduce", 1, 9us);
    CHECK(e.typical("all_reduce", 0) == 7us);
    CHECK(e.typical("all_reduce", 1) == 9us);
    CHECK(e.typical("all_reduce", 2) == ns(0));
    // The widest class: 2^63 up to the largest size.
    const std::size_t top = std::numeric_limits<std::size_t>::max();
    e.finished("all_reduce", top, 5ms);
    CHECK(e.typical("all_reduce", std::size_t{1} << 63) == 5ms);
    CHECK(e.typical("all_reduce", (std::size_t{1} << 63) - 1) == ns(0));
    // The other records are untouched.
    CHECK(e.typical("all_reduce", 1024) == 100us);
    CHECK(e.typical("all_reduce", 0) == 7us);
  }

  TEST_CASE("operation names are compared by content, not by address") {
    DCOMM_TEST_DEADLINE(60s);
    estimate e = seen(400us, "all_reduce", 4096);
    const std::string copy = "all_reduce";
    CHECK(e.typical(copy.c_str(), 4096) == 400us);
    e.finished(copy.c_str(), 4096, 800us);  // the same record: 400 + 400 / 4
    CHECK(e.typical("all_reduce", 4096) == 500us);
    const std::string other = "all_reduce_v";
    CHECK(e.typical(other.c_str(), 4096) == ns(0));
  }

  TEST_CASE("over a range of durations: awake before the typical finish, polled past it") {
    DCOMM_TEST_DEADLINE(60s);
    // Every duration from 1 us to about 1 s, by a factor of 1.25.
    for (double t = 1'000; t < 1e9; t *= 1.25) {
      const ns typical(static_cast<std::int64_t>(t));
      CAPTURE(typical.count());
      const estimate e = seen(typical);
      const ns sleep = e.sleep_for("all_reduce", mib);
      const ns poll = e.poll_for("all_reduce", mib, spin);
      const ns margin = 100us + typical / 32;
      // Either no sleep or at least 50 us of it, ending a margin before
      // the typical finish.
      CHECK((sleep == ns(0) || sleep >= 50us));
      if (sleep > ns(0)) CHECK(sleep + margin == typical);
      // Never less polling than the spin; past the typical finish by the
      // margin at least, once the operation outlasts the spin.
      CHECK(poll >= spin);
      if (typical > spin) CHECK(sleep + poll >= typical + margin);
    }
  }
}
