// gradient_bucketer against per-gradient all_reduce(avg) over real loopback
// thread worlds: mixed dtypes, odd sizes, tiny buckets (many of them),
// ranks marking gradients in different orders, several steps, no_sync, and
// bad use. Also dcomm::as_request, which the bucketer is built on.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dcomm/gradient_bucketer.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::check_failed;
using dcomm::test::comm;
using dcomm::test::require;

namespace {

// A model's gradients: one buffer per dtype family, odd sizes, and an
// empty one. Values are small integers (exact in every dtype), different
// per rank, step and gradient.
struct model_grads {
  std::vector<float> w1, b1, empty;
  std::vector<double> w2;
  std::vector<dcomm::float16> w3;
  std::vector<dcomm::bfloat16> w4;
  std::vector<float> w5;

  model_grads() : w1(1001), b1(7), empty(0), w2(300'001), w3(33), w4(1), w5(70'000) {}

  void fill(int rank, int step) {
    auto value = [&](std::size_t i, int salt) {
      return static_cast<float>((rank + 1) * 3 + step + salt + static_cast<int>(i % 11));
    };
    for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = value(i, 1);
    for (std::size_t i = 0; i < b1.size(); ++i) b1[i] = value(i, 2);
    for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = value(i, 3);
    for (std::size_t i = 0; i < w3.size(); ++i) w3[i] = dcomm::float16(value(i, 4));
    for (std::size_t i = 0; i < w4.size(); ++i) w4[i] = dcomm::bfloat16(value(i, 5));
    for (std::size_t i = 0; i < w5.size(); ++i) w5[i] = value(i, 6);
  }

  template <class B>
  void add_to(B& bucketer) {
    bucketer.add(w1);
    bucketer.add(b1);
    bucketer.add(empty);
    bucketer.add(w2);
    bucketer.add(w3);
    bucketer.add(w4);
    bucketer.add(w5);
  }
  static constexpr std::size_t count = 7;

  // Each gradient averaged on its own: the expectation.
  asio::awaitable<void> average_each(comm& c) {
    co_await c.all_reduce(w1, dcomm::avg);
    co_await c.all_reduce(b1, dcomm::avg);
    co_await c.all_reduce(empty, dcomm::avg);
    co_await c.all_reduce(w2, dcomm::avg);
    co_await c.all_reduce(w3, dcomm::avg);
    co_await c.all_reduce(w4, dcomm::avg);
    co_await c.all_reduce(w5, dcomm::avg);
  }

  template <class T>
  static bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
  }
  friend bool operator==(const model_grads& a, const model_grads& b) {
    return same_bits(a.w1, b.w1) && same_bits(a.b1, b.b1) && same_bits(a.w2, b.w2) &&
           same_bits(a.w3, b.w3) && same_bits(a.w4, b.w4) && same_bits(a.w5, b.w5);
  }
};

// The order rank r marks gradients ready in, for a step: a per-rank
// shuffle, so buckets fill in different orders on different ranks.
std::vector<std::size_t> marking_order(int rank, int step) {
  std::vector<std::size_t> order(model_grads::count);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 gen(static_cast<unsigned>(rank * 7919 + step));
  std::shuffle(order.begin(), order.end(), gen);
  return order;
}

}  // namespace

TEST_SUITE("gradient bucketer") {
  TEST_CASE("every gradient ends as all_reduce(avg) of it alone: tiny and default buckets") {
    DCOMM_TEST_DEADLINE(120s);
    for (int world : {1, 2, 3, 4}) {
      for (auto options : {dcomm::bucketer_options{.first_bucket_bytes = 64, .bucket_bytes = 4096},
                           dcomm::bucketer_options{}}) {
        CAPTURE(world);
        CAPTURE(options.bucket_bytes);
        DCOMM_REQUIRE_WORLD(world, [options](comm& c, int r) -> asio::awaitable<void> {
          model_grads grads, expected;
          dcomm::gradient_bucketer bucketer(c, options);
          grads.add_to(bucketer);
          for (int step = 0; step < 3; ++step) {
            grads.fill(r, step);
            expected.fill(r, step);
            co_await expected.average_each(c);
            for (auto i : marking_order(r, step)) bucketer.mark_ready(i);
            co_await bucketer.wait();
            require(grads == expected, "step " + std::to_string(step) +
                                           ": bucketed averages differ from per-gradient");
          }
        });
      }
    }
  }

  TEST_CASE("buckets: reverse registration order, one dtype each, a small first bucket") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(1, [](comm& c, int) -> asio::awaitable<void> {
      // 4-byte floats: 100 elements = 400 bytes.
      std::vector<float> a(100), b(100), d(100), e(300);
      std::vector<double> x(10);
      dcomm::gradient_bucketer bucketer(c, {.first_bucket_bytes = 400, .bucket_bytes = 800});
      bucketer.add(a);  // 0
      bucketer.add(x);  // 1
      bucketer.add(b);  // 2
      bucketer.add(d);  // 3
      bucketer.add(e);  // 4
      // From the last: e (1200 B >= 400) closes the first bucket alone;
      // d, b make 800 B and close the second; a stays open, x too (its own
      // dtype); the open ones follow in dtype order (float32, float64).
      require(bucketer.bucket_count() == 4,
              "bucket count " + std::to_string(bucketer.bucket_count()));
      require(bucketer.bucket_members(0) == std::vector<std::size_t>{4}, "bucket 0");
      require(bucketer.bucket_members(1) == std::vector<std::size_t>{3, 2}, "bucket 1");
      require(bucketer.bucket_members(2) == std::vector<std::size_t>{0}, "bucket 2");
      require(bucketer.bucket_members(3) == std::vector<std::size_t>{1}, "bucket 3");
      co_await bucketer.wait();  // world of one: the values stay
    });
  }

  TEST_CASE("a bucket's all_reduce starts when the bucket is full, before wait()") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      std::vector<float> first(10, static_cast<float>(r)), last(10, static_cast<float>(r * 3));
      std::vector<int> signal{1};
      if (r == 0) {
        dcomm::gradient_bucketer bucketer(c, {.first_bucket_bytes = 40, .bucket_bytes = 40});
        bucketer.add(first);
        bucketer.add(last);  // bucket 0
        bucketer.mark_ready(1);
        // Rank 1 answers only once its all_reduce of `last` has completed,
        // which needs this rank's bucket 0 in flight already.
        co_await c.recv(signal, 1, 77);
        co_await bucketer.wait();  // marks `first` ready itself
      } else {
        co_await c.all_reduce(last, dcomm::avg);
        co_await c.send(signal, 0, 77);
        co_await c.all_reduce(first, dcomm::avg);
      }
      require(first[0] == 0.5f && last[9] == 1.5f, "averages");
    });
  }

  TEST_CASE("wait() alone marks everything ready, step after step") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      std::vector<float> a(1000), b(3);
      dcomm::gradient_bucketer bucketer(c, {.first_bucket_bytes = 16, .bucket_bytes = 1024});
      bucketer.add(a);
      bucketer.add(b);
      for (int step = 0; step < 4; ++step) {
        std::fill(a.begin(), a.end(), static_cast<float>(r * 3 + step));
        std::fill(b.begin(), b.end(), static_cast<float>(r * 6));
        co_await bucketer.wait();
        require(a[999] == static_cast<float>(3 + step) && b[0] == 6.0f,
                "step " + std::to_string(step));
      }
    });
  }

  TEST_CASE("no_sync: steps inside only accumulate; the next step averages the sums") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      std::vector<double> g(5000, 0.0);
      dcomm::gradient_bucketer bucketer(c, {.first_bucket_bytes = 1024, .bucket_bytes = 4096});
      bucketer.add(g);
      // Rank 0 accumulates 1 micro-batch inside no_sync, rank 1 three: if
      // no_sync sent anything the ranks' calls would not match.
      {
        auto scope = bucketer.no_sync();
        for (int micro = 0; micro < (r == 0 ? 1 : 3); ++micro) {
          for (auto& v : g) v += r + 1;
          bucketer.mark_ready(0);
          co_await bucketer.wait();
          require(g[0] == (micro + 1) * (r + 1), "no_sync changed the local gradient");
        }
      }
      for (auto& v : g) v += r + 1;  // the synchronising micro-batch
      bucketer.mark_ready(0);
      co_await bucketer.wait();
      // rank 0: 2 * 1, rank 1: 4 * 2; average 5.
      require(g[0] == 5.0 && g[4999] == 5.0, "average of the accumulated gradients");
    });
  }

  TEST_CASE("bad use fails clearly, before anything is sent") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(1, [](comm& c, int) -> asio::awaitable<void> {
      std::vector<float> g(4);
      std::vector<std::int32_t> counts(4);
      dcomm::gradient_bucketer bucketer(c);
      auto fails = [](auto f, const std::string& part) {
        try {
          f();
        } catch (const dcomm::error& e) {
          require(e.code() == dcomm::errc::invalid_argument, "code of: " + std::string(e.what()));
          require(std::string(e.what()).find(part) != std::string::npos,
                  "message lacks '" + part + "': " + e.what());
          return;
        }
        throw check_failed("no error for " + part);
      };
      fails([&] { bucketer.add(counts); }, "floating-point");
      // A CUDA gradient in a program that did not include dcomm/cuda.hpp.
      dcomm::tensor_view on_gpu{g.data(), g.size(), dcomm::dtype::float32, dcomm::device::cuda(0)};
      fails([&] { bucketer.add(on_gpu); }, "dcomm/cuda.hpp");
      bucketer.add(g);
      fails([&] { bucketer.mark_ready(1); }, "below 1");
      bucketer.mark_ready(0);
      fails([&] { bucketer.mark_ready(0); }, "already marked");
      fails([&] { bucketer.add(g); }, "registered before");
      co_await bucketer.wait();
      bucketer.mark_ready(0);  // a new step
      co_await bucketer.wait();
    });
  }
}

TEST_SUITE("as_request") {
  TEST_CASE("as_request starts a collective at once; test, wait and co_await its request") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      std::vector<std::int64_t> a(100'000, r + 1), b(10, r);
      auto ra = c.all_reduce(a, dcomm::sum, dcomm::as_request);
      auto rb = c.broadcast(b, 2, dcomm::as_request);
      co_await rb.async_wait();
      co_await ra.async_wait();
      require(ra.test() && rb.test(), "test() after completion");
      require(a[0] == 6 && a[99'999] == 6 && b[9] == 2, "results");
      co_await ra.async_wait();  // a finished request completes at once
      // Bad input: the request fails with invalid_argument; nothing is sent.
      auto bad = c.broadcast(b, 7, dcomm::as_request);
      try {
        co_await bad.async_wait();
        throw check_failed("a root out of range was accepted");
      } catch (const dcomm::error& e) {
        require(e.code() == dcomm::errc::invalid_argument, e.what());
      }
      co_await c.barrier();
    });
  }
}
