// A send/recv size mismatch under the eager limit reaches the sender too
// (issue 15): an eager send completes once written, before its receiver
// sees it, so the receiver's fail frame usually comes back after it and
// fails the sender's next operation with that peer (or the one waiting on
// it), naming the earlier send by tag and sizes; a send still pending then
// fails itself. A dtype mismatch of the same size goes the same way (issue
// 41), and every dtype matched with itself still passes. Thread worlds
// over real sockets. And the transport's record of failed collective calls
// stays bounded.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dcomm/cpu/transport/failed_calls.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

// Rank 1's side: a receive of 12 floats, where rank 0 sends 10 with tag 5,
// fails with mismatch; then it sends rank 0 a go-ahead (tag 7), which
// leaves after the fail frame on the same connection.
asio::awaitable<void> receive_too_many(comm& c) {
  std::vector<float> twelve(12);
  auto [code, what] = co_await failure_of([&] { return c.recv(twelve, 0, 5); });
  require(code == dcomm::errc::mismatch, "the receiver fails with mismatch: " + what);
  require(contains(what, "sent 40 bytes") && contains(what, "expects 48 bytes"),
          "the receiver names both sizes: " + what);
  std::vector<float> go{7.0f};
  co_await c.send(go, 0, 7);
}

// What rank 0's failure must say: mismatch, the send (tag 5 to rank 1) and
// both sizes; `later`: an operation after the send, which names it as such.
void require_names_the_send(dcomm::errc code, const std::string& what, bool later) {
  require(code == dcomm::errc::mismatch, "the sender fails with mismatch: '" + what + "'");
  require(contains(what, "tag 5") && contains(what, "40 bytes") && contains(what, "48 bytes") &&
              contains(what, "rank 1"),
          "the sender's error names the send (tag, sizes, peer): " + what);
  require(!later || contains(what, "earlier send"),
          "a later operation names the earlier send: " + what);
}

// Issue 41: a send and a receive of the same size but different dtypes.
// Rank 0 sends `n` elements of `sent` with tag 5, rank 1 receives them
// into as many bytes of `received` (by recv, or irecv where `nonblocking`),
// then sends a go-ahead with tag 7. Both fail with mismatch naming both
// dtypes: the receive at once; the send itself if it is large (it waits
// for its receive), else it or the sender's next operation with rank 1.
template <class Sent, class Received>
asio::awaitable<void> mismatched_dtypes(comm& c, std::size_t n, bool nonblocking) {
  static_assert(sizeof(Sent) == sizeof(Received));
  const std::string sent = std::string(dcomm::name(dcomm::dtype_of_v<Sent>)) + " x " +
                           std::to_string(n) + ")",
                    received = std::string(dcomm::name(dcomm::dtype_of_v<Received>)) + " x " +
                               std::to_string(n) + ")";
  const std::string bytes = std::to_string(n * sizeof(Sent)) + " bytes (";
  auto names_both = [&](const std::string& what) {
    return contains(what, bytes + sent) && contains(what, bytes + received) &&
           contains(what, "dtype mismatch");
  };
  std::vector<float> go(1);
  if (c.rank() == 1) {
    std::vector<Received> into(n);
    auto [code, what] = co_await failure_of([&]() -> asio::awaitable<void> {
      if (nonblocking)
        co_await c.irecv(into, 0, 5).async_wait();
      else
        co_await c.recv(into, 0, 5);
    });
    require(
        code == dcomm::errc::mismatch && names_both(what) &&
            contains(what, nonblocking ? "in irecv" : "in recv") && contains(what, "(rank 1)") &&
            contains(what, "peers rank 0") && contains(what, "tag 5"),
        "the receive fails with mismatch naming both dtypes, the operation and the ranks: " + what);
    go[0] = 7.0f;
    co_await c.send(go, 0, 7);
    co_return;
  }
  std::vector<Sent> out(n);
  auto [send_code, send_what] = co_await failure_of([&] { return c.send(out, 1, 5); });
  auto sender_named_both = [&](dcomm::errc code, const std::string& what) {
    require(code == dcomm::errc::mismatch && names_both(what) && contains(what, "tag 5") &&
                contains(what, "rank 1"),
            "the sender fails with mismatch naming both dtypes: '" + what + "'");
  };
  if (n * sizeof(Sent) > 64 * 1024 || send_code != dcomm::errc{}) {
    sender_named_both(send_code, send_what);
  } else {
    auto [code, what] = co_await failure_of([&] { return c.recv(go, 1, 7); });
    sender_named_both(code, what);
    require(contains(what, "earlier send"), "a later operation names the earlier send: " + what);
  }
  co_await c.recv(go, 1, 7);  // reported once: the link is in step
  require(go[0] == 7.0f, "the go-ahead arrives after the report");
}

// Sends n elements of T from rank 0 to rank 1 and checks them there.
template <class T>
asio::awaitable<void> matching_dtype(comm& c, std::size_t n) {
  std::vector<T> v(n);
  if (c.rank() == 0) {
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(static_cast<float>(i % 100));
    co_await c.send(v, 1, 3);
  } else {
    co_await c.recv(v, 0, 3);
    for (std::size_t i = 0; i < n; ++i)
      require(static_cast<float>(v[i]) == static_cast<float>(i % 100),
              std::string(dcomm::name(dcomm::dtype_of_v<T>)) + " element " + std::to_string(i) +
                  " of " + std::to_string(n) + " differs");
  }
}

}  // namespace

TEST_SUITE("cpu point to point") {
  TEST_CASE("dtype mismatch of the same size fails both sides with mismatch naming both dtypes") {
    DCOMM_TEST_DEADLINE(120s);
    // Eager (10 elements) and large (100,000: over eager_limit), received
    // by recv and by irecv.
    for (std::size_t n : {std::size_t{10}, std::size_t{100'000}})
      for (bool nonblocking : {false, true}) {
        const std::string by = nonblocking ? "irecv" : "recv";
        INFO("n = " << n << ", by " << by);
        DCOMM_REQUIRE_WORLD(
            2,
            [&](comm& c, int) -> asio::awaitable<void> {
              co_await mismatched_dtypes<float, std::int32_t>(c, n, nonblocking);
              co_await mismatched_dtypes<std::uint8_t, std::int8_t>(c, n, nonblocking);
              co_await mismatched_dtypes<dcomm::float16, dcomm::bfloat16>(c, n, nonblocking);
              co_await mismatched_dtypes<std::int64_t, double>(c, n, nonblocking);
            },
            10s);
      }
  }

  TEST_CASE("every dtype sent and received as itself still passes, eager and large") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int) -> asio::awaitable<void> {
      for (std::size_t n : {std::size_t{0}, std::size_t{10}, std::size_t{100'000}}) {
        co_await matching_dtype<std::int8_t>(c, n);
        co_await matching_dtype<std::uint8_t>(c, n);
        co_await matching_dtype<std::int32_t>(c, n);
        co_await matching_dtype<std::int64_t>(c, n);
        co_await matching_dtype<dcomm::float16>(c, n);
        co_await matching_dtype<dcomm::bfloat16>(c, n);
        co_await matching_dtype<float>(c, n);
        co_await matching_dtype<double>(c, n);
      }
    });
  }

  TEST_CASE("eager size mismatch: a blocking send, or the sender's next wait on that peer, fails") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(
        2,
        [](comm& c, int r) -> asio::awaitable<void> {
          if (r == 1) co_return co_await receive_too_many(c);
          std::vector<float> ten(10, 1.0f), go(1);
          // Written, the send is done before rank 1 has seen it, unless its
          // coroutine has not resumed yet when the report comes back.
          auto [send_code, send_what] = co_await failure_of([&] { return c.send(ten, 1, 5); });
          if (send_code != dcomm::errc{}) {
            require_names_the_send(send_code, send_what, false);
          } else {
            auto [code, what] = co_await failure_of([&] { return c.recv(go, 1, 7); });
            require_names_the_send(code, what, true);
          }
          // Reported once: the go-ahead is still there, and the link usable.
          co_await c.recv(go, 1, 7);
          require(go[0] == 7.0f, "the go-ahead arrives after the report");
        },
        10s);
  }

  TEST_CASE("eager size mismatch: isend's request, or the next request on that peer, fails") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(
        2,
        [](comm& c, int r) -> asio::awaitable<void> {
          if (r == 1) co_return co_await receive_too_many(c);
          std::vector<float> ten(10, 1.0f), go(1);
          auto tx = c.isend(ten, 1, 5);
          auto rx = c.irecv(go, 1, 7);
          // The send is written before rank 1's answer can come back, so its
          // request is done by then, unless its coroutine has not resumed
          // yet: then the request fails and the receive gets the go-ahead.
          auto [tx_code, tx_what] = co_await failure_of([&] { return tx.async_wait(); });
          auto [rx_code, rx_what] = co_await failure_of([&] { return rx.async_wait(); });
          require((tx_code == dcomm::errc{}) != (rx_code == dcomm::errc{}),
                  "exactly one request fails: send '" + tx_what + "', receive '" + rx_what + "'");
          if (tx_code != dcomm::errc{}) {
            require_names_the_send(tx_code, tx_what, false);
          } else {
            require_names_the_send(rx_code, rx_what, true);
            co_await c.recv(go, 1, 7);
          }
          require(go[0] == 7.0f, "the go-ahead arrives");
        },
        10s);
  }

  TEST_CASE("eager size mismatch: a send that completed fails the sender's next collective") {
    DCOMM_TEST_DEADLINE(60s);
    auto errors = dcomm::test::comm_world(
        2,
        [](comm& c, int r) -> asio::awaitable<void> {
          std::vector<float> one{1.0f};
          if (r == 1) {
            std::vector<float> twelve(12);
            auto [code, what] = co_await failure_of([&] { return c.recv(twelve, 0, 5); });
            require(code == dcomm::errc::mismatch, "the receiver fails with mismatch: " + what);
            // Its all_reduce may finish (rank 0's part came before the
            // report was read there) or fail (rank 0 gave up on it).
            co_await failure_of([&] { return c.all_reduce(one, dcomm::sum); });
            co_await c.barrier();
            co_return;
          }
          std::vector<float> ten(10, 1.0f);
          auto [send_code, send_what] = co_await failure_of([&] { return c.send(ten, 1, 5); });
          if (send_code != dcomm::errc{}) {
            require_names_the_send(send_code, send_what, false);  // still pending: it failed itself
            co_await c.all_reduce(one, dcomm::sum);
          } else {
            // Posted before the report arrives or after: either way it fails.
            auto [code, what] = co_await failure_of([&] { return c.all_reduce(one, dcomm::sum); });
            require_names_the_send(code, what, true);
          }
          // Reported once: the next collective works.
          co_await c.barrier();
        },
        10s);
    INFO(dcomm::test::summary(errors));
    CHECK(errors[0].empty());
    CHECK(errors[1].empty());
  }
}

// The transport's record of failed collective calls (issue 15: it grew by
// one per failed call for the life of the backend).
TEST_SUITE("cpu failures") {
  using dcomm::cpu::call_id;
  using dcomm::cpu::failed_call;
  using dcomm::cpu::failed_call_record;

  TEST_CASE("the record of failed calls stays bounded and keeps what is still needed") {
    failed_call_record record;
    auto none = [](const call_id&) { return false; };
    constexpr std::uint64_t keep = failed_call_record::keep_calls;
    // A long job whose every collective fails (group 1): bounded, and the
    // last `keep` calls' records are there for their late frames.
    std::size_t most = 0;
    for (std::uint64_t seq = 0; seq < 10'000; ++seq) {
      record.enter({1, seq}, none);
      record.add({1, seq}, failed_call{.code = dcomm::errc::mismatch}, true, none);
      most = std::max(most, record.size());
      REQUIRE(record.find({1, seq}) != nullptr);
      REQUIRE(record.find({1, seq})->code == dcomm::errc::mismatch);
      if (seq >= keep - 1) REQUIRE(record.contains({1, seq - (keep - 1)}));
    }
    CHECK(most <= 2 * keep);
    CHECK(!record.contains({1, 0}));

    // Failures of calls this rank has not entered yet (group 2) stay, however
    // many other calls it makes meanwhile: it still needs them to fail those.
    for (std::uint64_t seq = 0; seq < 10; ++seq)
      record.add({2, seq}, failed_call{.code = dcomm::errc::timeout}, false, none);
    for (std::uint64_t seq = 10'000; seq < 11'000; ++seq) record.enter({1, seq}, none);
    for (std::uint64_t seq = 0; seq < 10; ++seq) REQUIRE(record.contains({2, seq}));
    // Entered, they go `keep` calls later.
    for (std::uint64_t seq = 0; seq < 10; ++seq) record.enter({2, seq}, none);
    for (std::uint64_t seq = 11'000; seq < 11'000 + 2 * keep; ++seq) record.enter({1, seq}, none);
    for (std::uint64_t seq = 0; seq < 10; ++seq) CHECK(!record.contains({2, seq}));

    // A call still in progress here keeps its record (its fail frames need it).
    auto group_3_active = [](const call_id& c) { return c.group == 3; };
    record.enter({3, 0}, group_3_active);
    record.add({3, 0}, failed_call{}, true, group_3_active);
    for (std::uint64_t seq = 20'000; seq < 21'000; ++seq) record.enter({1, seq}, group_3_active);
    CHECK(record.contains({3, 0}));

    // Reports of calls never entered (group 4): at most max_records, the
    // newest kept.
    for (std::uint64_t seq = 0; seq < 5'000; ++seq) {
      record.add({4, seq}, failed_call{}, false, group_3_active);
      REQUIRE(record.size() <= failed_call_record::max_records);
    }
    CHECK(record.contains({4, 4'999}));
    CHECK(!record.contains({4, 0}));
    CHECK(record.contains({3, 0}));
  }

  TEST_CASE(
      "many failed collectives in a row: each fails with mismatch on every rank, then one works") {
    DCOMM_TEST_DEADLINE(120s);
    // More than failed_call_record::keep_calls of them, so that records
    // are pruned while calls keep failing.
    DCOMM_REQUIRE_WORLD(
        2,
        [](comm& c, int r) -> asio::awaitable<void> {
          for (int i = 0; i < 150; ++i) {
            std::vector<float> v(static_cast<std::size_t>(10 + r), 1.0f);
            auto [code, what] =
                co_await failure_of([&] { return c.all_reduce(v, dcomm::sum, {.timeout = 10s}); });
            require(
                code == dcomm::errc::mismatch && contains(what, "float32 x 10") &&
                    contains(what, "float32 x 11"),
                "call " + std::to_string(i) + " fails with mismatch naming both calls: " + what);
          }
          std::vector<float> v(4, static_cast<float>(r));
          co_await c.all_reduce(v, dcomm::sum);
          require(v[0] == 1.0f && v[3] == 1.0f, "the call after them works");
        },
        20s);
  }
}
