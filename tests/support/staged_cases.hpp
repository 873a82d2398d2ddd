// CUDA tensors over the CPU backend (staged through page-locked host
// memory), as cases over a `Memory`: gpu_tests runs them on a real device
// (cuda_memory), backend_tests on emulated device memory (support/
// emulated_device.hpp) so that CI, without a GPU, runs the staging logic
// too, under the sanitizers included. A Memory has
//   template <class T> using buffer = ...;   // a tensor on device::cuda(0)
//   static buffer<T> upload(const std::vector<T>&);
//   static std::vector<T> download(const buffer<T>&);
//   static void refill(buffer<T>&, const std::vector<T>&);  // in place, same size
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "dcomm/gradient_bucketer.hpp"
#include "support/comm_world.hpp"

namespace dcomm::test::staged {

inline std::int64_t pattern(int rank, std::size_t i) {
  return static_cast<std::int64_t>(rank * 1000003 + static_cast<int>(i % 99991));
}

// Every collective and send/recv, on device buffers of three ranks, each
// staged whole (smaller than staging_slice).
template <class Memory>
void every_operation() {
  DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
    using M = Memory;
    using buffer = typename M::template buffer<std::int64_t>;
    const int n = c.size();
    const std::size_t count = 1001;  // not a multiple of the world
    std::vector<std::int64_t> mine(count);
    for (std::size_t i = 0; i < count; ++i) mine[i] = pattern(r, i);
    std::vector<std::int64_t> sum(count);
    for (std::size_t i = 0; i < count; ++i)
      for (int q = 0; q < n; ++q) sum[i] += pattern(q, i);

    auto buf = M::upload(mine);
    co_await c.all_reduce(buf, dcomm::sum);  // in place; large enough for the ring
    require(M::download(buf) == sum, "all_reduce in place");
    auto in = M::upload(mine);
    buffer out(count);
    co_await c.all_reduce(in, out, dcomm::sum);
    require(M::download(out) == sum, "all_reduce out of place");
    require(M::download(in) == mine, "all_reduce left its input alone");

    auto b = M::upload(r == 1 ? mine : std::vector<std::int64_t>(count, -1));
    co_await c.broadcast(b, 1);
    std::vector<std::int64_t> from1(count);
    for (std::size_t i = 0; i < count; ++i) from1[i] = pattern(1, i);
    require(M::download(b) == from1, "broadcast");

    auto red = M::upload(std::vector<std::int64_t>(count, 7));
    co_await c.reduce(in, red, 2, dcomm::sum);
    require(M::download(red) == (r == 2 ? sum : std::vector<std::int64_t>(count, 7)),
            "reduce: the root has the sum, the others' output is untouched");

    buffer all(count * 3);
    co_await c.all_gather(in, all);
    auto gathered = M::download(all);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < count; ++i)
        require(gathered[std::size_t(q) * count + i] == pattern(q, i), "all_gather");

    buffer part(count);
    co_await c.reduce_scatter(all, part, dcomm::sum);  // every block summed over 3 ranks
    auto got = M::download(part);
    for (std::size_t i = 0; i < count; ++i) require(got[i] == 3 * pattern(r, i), "reduce_scatter");

    co_await c.scatter(all, part, 0);
    got = M::download(part);
    for (std::size_t i = 0; i < count; ++i) require(got[i] == pattern(r, i), "scatter");

    auto g = M::upload(std::vector<std::int64_t>(count * 3, -5));
    co_await c.gather(in, g, 0);
    auto gv = M::download(g);
    if (r == 0)
      require(gv == gathered, "gather at the root");
    else
      require(gv == std::vector<std::int64_t>(count * 3, -5), "gather left the others alone");

    // all_to_all in place: block j of rank i goes to block i of rank j.
    std::vector<std::int64_t> blocks(count * 3);
    for (int j = 0; j < n; ++j)
      for (std::size_t i = 0; i < count; ++i)
        blocks[std::size_t(j) * count + i] = pattern(r, i) * 10 + j;
    auto a2a = M::upload(blocks);
    co_await c.all_to_all(a2a);
    auto av = M::download(a2a);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < count; ++i)
        require(av[std::size_t(q) * count + i] == pattern(q, i) * 10 + r, "all_to_all in place");

    std::vector<std::int64_t> v;
    auto counts = co_await c.all_gather_v(in, v);
    require(counts == std::vector<std::size_t>(3, count) && v == gathered, "all_gather_v");

    // send/recv around the ring, into device memory.
    auto next = (r + 1) % n, prev = (r + n - 1) % n;
    buffer incoming(count);
    auto req = c.irecv(incoming, prev, 3);
    co_await c.send(in, next, 3);
    co_await req.async_wait();
    got = M::download(incoming);
    for (std::size_t i = 0; i < count; ++i) require(got[i] == pattern(prev, i), "send/recv");

    typename M::template buffer<float> empty;
    co_await c.all_reduce(empty, dcomm::sum);
  });
}

// Tensors larger than staging_slice (4 KiB here): 150001 int64 (1.1 MiB)
// go in 255 slices (the most there are, so 589 elements each, more than
// 4 KiB), 1001 in 2;
// the ring, the chain and recursive doubling run per slice, as their sizes
// choose; send and recv go in one message, its data sent and landed slice
// by slice, in order with the other messages of the same tag.
template <class Memory>
void slice_by_slice() {
  for (std::size_t count : {std::size_t{1001}, std::size_t{150001}}) {
    CAPTURE(count);
    cpu_backend::options o;
    o.staging_slice = 4096;
    DCOMM_REQUIRE_WORLD(
        3,
        [count](comm& c, int r) -> asio::awaitable<void> {
          using M = Memory;
          using buffer = typename M::template buffer<std::int64_t>;
          const int n = c.size();
          std::vector<std::int64_t> mine(count), sum(count), from1(count);
          for (std::size_t i = 0; i < count; ++i) {
            mine[i] = pattern(r, i);
            from1[i] = pattern(1, i);
            for (int q = 0; q < n; ++q) sum[i] += pattern(q, i);
          }
          auto buf = M::upload(mine);
          co_await c.all_reduce(buf, dcomm::sum);
          require(M::download(buf) == sum, "all_reduce in place");
          auto in = M::upload(mine);
          buffer out(count);
          co_await c.all_reduce(in, out, dcomm::sum);
          require(M::download(out) == sum && M::download(in) == mine, "all_reduce out of place");

          auto b = M::upload(r == 1 ? mine : std::vector<std::int64_t>(count, -1));
          co_await c.broadcast(b, 1);
          require(M::download(b) == from1, "broadcast");

          auto red = M::upload(std::vector<std::int64_t>(count, 7));
          co_await c.reduce(in, red, 2, dcomm::sum);
          require(M::download(red) == (r == 2 ? sum : std::vector<std::int64_t>(count, 7)),
                  "reduce: the root has the sum, the others' output is untouched");
          auto red_in_place = M::upload(mine);
          co_await c.reduce(red_in_place, 0, dcomm::max);
          if (r == 0) {
            std::vector<std::int64_t> top(count);
            for (std::size_t i = 0; i < count; ++i) top[i] = pattern(n - 1, i);
            require(M::download(red_in_place) == top, "reduce in place at the root");
          }

          // Three messages with one tag arrive in the order they were sent:
          // a sliced one, a smaller one staged whole (it is ready at once,
          // and must not overtake the first), one from host memory.
          const int next = (r + 1) % n, prev = (r + n - 1) % n;
          const std::size_t half_count = count / 2;
          buffer first(count), second(half_count);
          std::vector<std::int64_t> third(3);
          auto r1 = c.irecv(first, prev, 5);
          auto r2 = c.irecv(second, prev, 5);
          auto r3 = c.irecv(third, prev, 5);
          auto half = M::upload(
              std::vector<std::int64_t>(mine.begin(), mine.begin() + std::ptrdiff_t(half_count)));
          const std::vector<std::int64_t> tail{mine[0], mine[1], mine[2]};
          auto s1 = c.isend(in, next, 5);
          auto s2 = c.isend(half, next, 5);
          auto s3 = c.isend(tail, next, 5);
          co_await r1.async_wait();
          co_await r2.async_wait();
          co_await r3.async_wait();
          co_await s1.async_wait();
          co_await s2.async_wait();
          co_await s3.async_wait();
          auto got = M::download(first), got2 = M::download(second);
          for (std::size_t i = 0; i < count; ++i) require(got[i] == pattern(prev, i), "send 1");
          for (std::size_t i = 0; i < half_count; ++i)
            require(got2[i] == pattern(prev, i), "send 2");
          for (std::size_t i = 0; i < 3; ++i) require(third[i] == pattern(prev, i), "send 3");

          // Slices are not seen on the wire: a sliced send lands in host
          // memory, and host memory in a sliced receive.
          std::vector<std::int64_t> on_host(count);
          auto to_host = c.irecv(on_host, prev, 6);
          co_await c.send(in, next, 6);
          co_await to_host.async_wait();
          require(
              on_host ==
                  [&] {
                    std::vector<std::int64_t> want(count);
                    for (std::size_t i = 0; i < count; ++i) want[i] = pattern(prev, i);
                    return want;
                  }(),
              "a sliced send into host memory");
          buffer on_device(count);
          auto from_host = c.irecv(on_device, prev, 7);
          co_await c.send(mine, next, 7);
          co_await from_host.async_wait();
          got = M::download(on_device);
          for (std::size_t i = 0; i < count; ++i)
            require(got[i] == pattern(prev, i), "host memory into a sliced receive");

          // A size mismatch is caught by the receiver; the sender of an
          // eager message may not hear of it.
          if (r < 2) {
            buffer wrong(r == 0 ? count : count + 1);
            try {
              if (r == 0) {
                co_await c.send(wrong, 1, 9);
              } else {
                co_await c.recv(wrong, 0, 9);
                require(false, "a size mismatch went through");
              }
            } catch (const dcomm::error& e) {
              require(e.code() == dcomm::errc::mismatch, e.what());
            }
          }
        },
        std::chrono::seconds(60), o);
  }
}

// A collective's ranks must agree on slicing: a CUDA tensor beyond
// staging_slice on one rank and host memory on the others is a mismatch
// on every rank (naming the slices), not a hang or mixed data.
template <class Memory>
void slicing_must_agree() {
  cpu_backend::options o;
  o.staging_slice = 4096;
  auto errors = comm_world(
      3,
      [](comm& c, int r) -> asio::awaitable<void> {
        const std::size_t count = 10000;
        if (r == 0) {
          auto d = Memory::upload(std::vector<std::int64_t>(count, 1));
          co_await c.all_reduce(d, dcomm::sum);
        } else {
          std::vector<std::int64_t> h(count, 1);
          co_await c.all_reduce(h, dcomm::sum);
        }
      },
      std::chrono::seconds(20), o);
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "mismatch"));
  }
  CHECK(contains(errors[0] + errors[1] + errors[2], "slices"));
}

// gradient_bucketer on CUDA gradients (packed on their GPU), beside one in
// host memory, over three ranks: tiny buckets (of both kinds, one going
// slice by slice), two steps marked in a different order on each rank;
// every gradient ends as its average over the ranks.
template <class Memory>
void bucketer_on_device() {
  cpu_backend::options o;
  o.staging_slice = 4096;
  DCOMM_REQUIRE_WORLD(
      3,
      [](comm& c, int r) -> asio::awaitable<void> {
        using M = Memory;
        const int n = c.size();
        // (rank + 1) * 3 averages to 6 over three ranks: exact averages.
        auto value = [&](int rank, int step, int salt, std::size_t i) {
          return (rank + 1) * 3 + step + salt + static_cast<int>(i % 11);
        };
        auto make = [&]<class T>(std::size_t count, int step, int salt, T) {
          std::vector<T> v(count);
          for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<T>(value(r, step, salt, i));
          return v;
        };
        auto average = [&]<class T>(std::size_t count, int step, int salt, T) {
          std::vector<T> v(count);
          for (std::size_t i = 0; i < count; ++i) {
            int sum = 0;
            for (int q = 0; q < n; ++q) sum += value(q, step, salt, i);
            v[i] = static_cast<T>(sum / n);
          }
          return v;
        };
        auto d1 = M::upload(make(1001, 0, 1, float{}));
        auto d2 = M::upload(make(20001, 0, 2, double{}));
        auto d3 = M::upload(make(7, 0, 3, float{}));
        typename M::template buffer<float> d4;  // empty
        auto h1 = make(777, 0, 4, float{});
        dcomm::gradient_bucketer bucketer(
            c, dcomm::bucketer_options{.first_bucket_bytes = 64, .bucket_bytes = 4096});
        bucketer.add(d1);
        bucketer.add(h1);
        bucketer.add(d2);
        bucketer.add(d3);
        bucketer.add(d4);
        for (std::size_t b = 0; b < bucketer.bucket_count(); ++b) {
          auto members = bucketer.bucket_members(b);
          const bool on_host = members[0] == 1;
          for (auto m : members)
            require((m == 1) == on_host, "a bucket mixes host and device gradients");
        }
        // From the last registered: [d2] (closed at the 64 B first limit;
        // sliced by the staging), then what is open at the end: [h1] in
        // host memory, [d4 d3 d1] on the GPU (staged whole).
        require(bucketer.bucket_count() == 3, "three buckets");
        for (int step = 0; step < 2; ++step) {
          if (step > 0) {  // in place: the bucketer keeps the addresses it was given
            M::refill(d1, make(1001, step, 1, float{}));
            M::refill(d2, make(20001, step, 2, double{}));
            M::refill(d3, make(7, step, 3, float{}));
            auto h = make(777, step, 4, float{});
            std::copy(h.begin(), h.end(), h1.begin());
          }
          std::vector<std::size_t> order{0, 1, 2, 3, 4};
          std::rotate(order.begin(), order.begin() + r, order.end());
          for (auto i : order) bucketer.mark_ready(i);
          co_await bucketer.wait();
          require(M::download(d1) == average(1001, step, 1, float{}), "d1");
          require(M::download(d2) == average(20001, step, 2, double{}), "d2");
          require(M::download(d3) == average(7, step, 3, float{}), "d3");
          require(h1 == average(777, step, 4, float{}), "h1");
        }
      },
      std::chrono::seconds(60), o);
}

}  // namespace dcomm::test::staged
