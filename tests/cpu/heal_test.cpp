// heal (issue 43, dcomm/elastic/heal.hpp), among threads: the most advanced
// member's state reaches those behind it or holding other bits, and only
// them; buffers of other sizes fail every member before any byte moves.
// The suite is "cpu elastic" (elastic_test.cpp's): the sanitizers and the
// TCP and two-host runs take it too.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dcomm/elastic/heal.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace heal_test {

// A member's state: weights (floats, not a multiple of 4 bytes' worth of
// anything else) and a counter, both set from `seed`.
struct state {
  std::vector<float> weights;
  std::vector<std::int64_t> counters;
  std::vector<std::span<std::uint8_t>> buffers;
  explicit state(int seed, std::size_t n = 1000) : weights(n), counters(3) {
    for (std::size_t i = 0; i < n; ++i)
      weights[i] = static_cast<float>(seed) + 0.5f * static_cast<float>(i);
    for (std::size_t i = 0; i < counters.size(); ++i)
      counters[i] = seed * 100 + static_cast<int>(i);
    buffers = {dcomm::bytes_of(weights), dcomm::bytes_of(counters)};
  }
  bool is(int seed) const {
    return state(seed, weights.size()).weights == weights &&
           state(seed, weights.size()).counters == counters;
  }
};

std::string ranks(const std::vector<int>& v) {
  std::string s;
  for (int r : v) s += std::to_string(r) + " ";
  return s;
}

}  // namespace heal_test

using heal_test::ranks;
using heal_test::state;

TEST_SUITE("cpu elastic") {
  TEST_CASE("heal: the most advanced member's state reaches the members behind it, only them") {
    DCOMM_TEST_DEADLINE(60s);
    // Steps per rank: ranks 1, 2 and 3 lead, rank 1 the lowest of them;
    // rank 3 holds its bits (seed 1), rank 2 others.
    DCOMM_REQUIRE_WORLD(5, [](comm& c, int r) -> asio::awaitable<void> {
      const std::int64_t steps[] = {3, 9, 9, 9, 0};
      state s(r == 3 ? 1 : r);
      dcomm::heal_result h = co_await dcomm::heal(c, steps[r], s.buffers, {.timeout = 20s});
      require(h.source == 1, "the lowest rank of the largest step: " + std::to_string(h.source));
      require(h.step == 9, "step " + std::to_string(h.step));
      require(ranks(h.healed) == "0 2 4 ", "healed " + ranks(h.healed));
      require(s.is(1), "rank " + std::to_string(r) + " holds the source's state");
      // Healed: a second heal finds every member alike.
      dcomm::heal_result again = co_await dcomm::heal(c, h.step, s.buffers);
      require(again.healed.empty(), "again: " + ranks(again.healed));
    });
  }

  TEST_CASE("heal: same step, one member's bits drifted: it alone re-fetches") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(4, [](comm& c, int r) -> asio::awaitable<void> {
      state s(0, 1 << 16);
      if (r == 2) s.weights[12345] += 1.0f;  // one element
      dcomm::heal_result h = co_await dcomm::heal(c, 5, s.buffers);
      require(h.source == 0 && h.step == 5, "source " + std::to_string(h.source));
      require(ranks(h.healed) == "2 ", "healed " + ranks(h.healed));
      require(s.is(0), "rank " + std::to_string(r) + "'s state");
    });
  }

  TEST_CASE("heal: every member alike, a world of one, empty buffers: nothing moves") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world : {1, 3}) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int) -> asio::awaitable<void> {
        state s(4, 0);  // zero weights
        dcomm::heal_result h = co_await dcomm::heal(c, 1, s.buffers);
        require(h.healed.empty() && h.source == 0 && h.step == 1, "healed " + ranks(h.healed));
        std::vector<std::span<std::uint8_t>> none;
        h = co_await dcomm::heal(c, 2, none);
        require(h.healed.empty(), "no buffers: " + ranks(h.healed));
      });
    }
  }

  TEST_CASE("heal: buffers of other sizes fail every member with mismatch, naming both") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      state s(r, r == 1 ? 999 : 1000);
      auto [code, what] = co_await failure_of([&] { return dcomm::heal(c, r, s.buffers); });
      require(code == dcomm::errc::mismatch, "code: " + what);
      require(what.find("rank 1") != std::string::npos &&
                  what.find("2 buffers of 4000 24 bytes") != std::string::npos &&
                  what.find("2 buffers of 3996 24 bytes") != std::string::npos,
              what);
      require(s.is(r), "nothing moved");
      co_await c.barrier();  // the communicator works on
    });
  }
}
