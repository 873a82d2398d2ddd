// The collective suite's cases, for any communicator<Backend>: every
// collective against computed expectations, every dtype, in place and out
// of place, counts 0, 1, 7, world-1 and a large count not divisible by the
// world. Inputs are small integers, exact in every dtype, so results are
// compared exactly. Run by the CPU backend's suite
// (tests/cpu/collectives_test.cpp, in thread worlds) and the MPI
// backend's (tests/mpi/mpi_collectives_test.cpp, under mpirun): one set of
// expectations for every backend.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/half.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/tensor.hpp"
#include "support/check_failed.hpp"

namespace dcomm::test {

namespace cases {

template <class T>
T from_int(std::int64_t v) {
  if constexpr (dcomm::detail::is_half<T>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double as_double(T v) {
  if constexpr (dcomm::detail::is_half<T>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

// What rank r contributes at element i for reduce kind k.
inline std::int64_t input(int r, std::size_t i, dcomm::reduce_kind k) {
  using K = dcomm::reduce_kind;
  const auto ii = static_cast<std::int64_t>(i);
  if (k == K::prod) return 1 + (r + ii) % 2;  // products stay powers of two
  if (k == K::band || k == K::bor || k == K::bxor) return ((r + 1) * 37 + ii * 5) % 120;
  return (r + 1) + ii % 5;
}

template <class T>
std::vector<T> inputs(int r, std::size_t count, dcomm::reduce_kind k, std::size_t first = 0) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = from_int<T>(input(r, first + i, k));
  return v;
}

// premul_sum's factor in these tests: a power of two, so that the scaled
// sums stay exact in every floating type.
inline constexpr double premul_factor = 0.25;

template <class T>
T expected(int world, std::size_t i, dcomm::reduce_kind k) {
  using K = dcomm::reduce_kind;
  std::int64_t acc = input(0, i, k);
  for (int r = 1; r < world; ++r) {
    std::int64_t x = input(r, i, k);
    switch (k) {
      case K::prod:
        acc *= x;
        break;
      case K::min:
        acc = std::min(acc, x);
        break;
      case K::max:
        acc = std::max(acc, x);
        break;
      case K::band:
        acc &= x;
        break;
      case K::bor:
        acc |= x;
        break;
      case K::bxor:
        acc ^= x;
        break;
      default:
        acc += x;
    }
  }
  T result = from_int<T>(acc);
  if (k == K::avg) {
    if constexpr (dcomm::detail::is_half<T>)
      result = T(static_cast<float>(result) / static_cast<float>(world));
    else if constexpr (std::is_floating_point_v<T>)
      result = result / static_cast<T>(world);
  }
  if (k == K::premul_sum) {  // the tests' factor is premul_factor
    if constexpr (dcomm::detail::is_half<T>)
      result = T(static_cast<float>(result) * static_cast<float>(premul_factor));
    else if constexpr (std::is_floating_point_v<T>)
      result = result * static_cast<T>(premul_factor);
  }
  return result;
}

template <class T>
bool same(T a, T b) {
  if constexpr (dcomm::detail::is_half<T>)
    return static_cast<float>(a) == static_cast<float>(b);
  else
    return a == b;
}

struct where {
  std::string op;
  int rank;
  int world;
  std::size_t count;
};

template <class T>
void expect_equal(const where& w, const std::vector<T>& got, const std::vector<T>& want) {
  auto describe = [&](std::string what) {
    return w.op + " " + std::string(dcomm::name(dcomm::dtype_of_v<T>)) + " world " +
           std::to_string(w.world) + " count " + std::to_string(w.count) + " rank " +
           std::to_string(w.rank) + ": " + what;
  };
  if (got.size() != want.size())
    throw check_failed(describe("size " + std::to_string(got.size()) + ", expected " +
                                std::to_string(want.size())));
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same(got[i], want[i]))
      throw check_failed(describe("element " + std::to_string(i) + " is " +
                                  std::to_string(as_double(got[i])) + ", expected " +
                                  std::to_string(as_double(want[i]))));
}

template <class T>
std::vector<T> expected_vector(int world, std::size_t count, dcomm::reduce_kind k) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = expected<T>(world, i, k);
  return v;
}

template <class T, class Op, class Comm>
asio::awaitable<void> all_reduce_case(Comm& c, std::size_t count, Op op, dcomm::op_options o) {
  constexpr auto k = dcomm::reduce_kind_of_v<Op>;
  const int n = c.size(), r = c.rank();
  auto buf = inputs<T>(r, count, k);
  co_await c.all_reduce(buf, op, o);
  expect_equal<T>({"all_reduce in place " + std::string(dcomm::name(k)), r, n, count}, buf,
                  expected_vector<T>(n, count, k));
}

template <class T, class Comm>
asio::awaitable<void> reductions(Comm& c, std::size_t count, dcomm::op_options o) {
  co_await all_reduce_case<T>(c, count, dcomm::sum, o);
  co_await all_reduce_case<T>(c, count, dcomm::prod, o);
  co_await all_reduce_case<T>(c, count, dcomm::min, o);
  co_await all_reduce_case<T>(c, count, dcomm::max, o);
  if constexpr (dcomm::is_floating(dcomm::dtype_of_v<T>)) {
    co_await all_reduce_case<T>(c, count, dcomm::avg, o);
    co_await all_reduce_case<T>(c, count, dcomm::premul_sum(premul_factor), o);
  } else {
    co_await all_reduce_case<T>(c, count, dcomm::band, o);
    co_await all_reduce_case<T>(c, count, dcomm::bor, o);
    co_await all_reduce_case<T>(c, count, dcomm::bxor, o);
  }
}

// Every collective once for element type T and `count` elements per rank.
template <class T, class Comm>
asio::awaitable<void> every_collective(Comm& c, std::size_t count) {
  using K = dcomm::reduce_kind;
  const int n = c.size(), r = c.rank();
  const auto un = static_cast<std::size_t>(n);
  const dcomm::op_options automatic{};
  co_await reductions<T>(c, count, automatic);

  {  // all_reduce out of place; the input is untouched
    const auto in = inputs<T>(r, count, K::sum);
    std::vector<T> out(count);
    co_await c.all_reduce(in, out, dcomm::sum);
    expect_equal<T>({"all_reduce out of place", r, n, count}, out,
                    expected_vector<T>(n, count, K::sum));
    expect_equal<T>({"all_reduce input", r, n, count}, in, inputs<T>(r, count, K::sum));
  }
  {  // reduce, in place at a root that varies with the count
    const int root = static_cast<int>(count % un);
    auto buf = inputs<T>(r, count, K::max);
    co_await c.reduce(buf, root, dcomm::max);
    expect_equal<T>({"reduce in place", r, n, count}, buf,
                    r == root ? expected_vector<T>(n, count, K::max) : inputs<T>(r, count, K::max));
    const auto in = inputs<T>(r, count, K::sum);
    std::vector<T> out(r == root ? count : 0);
    co_await c.reduce(in, out, root, dcomm::sum);
    if (r == root)
      expect_equal<T>({"reduce out of place", r, n, count}, out,
                      expected_vector<T>(n, count, K::sum));
  }
  {  // broadcast from the last rank
    const int root = n - 1;
    auto buf = r == root ? inputs<T>(r, count, K::sum) : std::vector<T>(count);
    co_await c.broadcast(buf, root);
    expect_equal<T>({"broadcast", r, n, count}, buf, inputs<T>(root, count, K::sum));
  }
  std::vector<T> gathered;  // every rank's input, in rank order
  for (int p = 0; p < n; ++p) {
    auto part = inputs<T>(p, count, K::sum);
    gathered.insert(gathered.end(), part.begin(), part.end());
  }
  {  // all_gather, out of place and in place
    const auto in = inputs<T>(r, count, K::sum);
    std::vector<T> out(count * un);
    co_await c.all_gather(in, out);
    expect_equal<T>({"all_gather", r, n, count}, out, gathered);
    std::vector<T> buf(count * un);
    std::copy(in.begin(), in.end(),
              buf.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)));
    co_await c.all_gather(buf);
    expect_equal<T>({"all_gather in place", r, n, count}, buf, gathered);
  }
  {  // gather and scatter at root 1 % n
    const int root = 1 % n;
    const auto in = inputs<T>(r, count, K::sum);
    std::vector<T> out(r == root ? count * un : 0);
    co_await c.gather(in, out, root);
    if (r == root) expect_equal<T>({"gather", r, n, count}, out, gathered);
    std::vector<T> piece(count);
    const auto& source = r == root ? gathered : std::vector<T>{};
    co_await c.scatter(source, piece, root);
    expect_equal<T>({"scatter", r, n, count}, piece, inputs<T>(r, count, K::sum));
    std::vector<T> buf = r == root ? gathered : std::vector<T>(count * un);
    co_await c.scatter(buf, root);
    std::vector<T> mine(
        buf.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)),
        buf.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r + 1)));
    expect_equal<T>({"scatter in place", r, n, count}, mine, inputs<T>(r, count, K::sum));
  }
  {  // reduce_scatter: rank r gets block r of the sum of everyone's n blocks
    const auto in = inputs<T>(r, count * un, K::sum);
    std::vector<T> out(count);
    co_await c.reduce_scatter(in, out, dcomm::sum);
    auto all = expected_vector<T>(n, count * un, K::sum);
    std::vector<T> want(
        all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)),
        all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r + 1)));
    expect_equal<T>({"reduce_scatter", r, n, count}, out, want);
    auto buf = in;
    co_await c.reduce_scatter(buf, dcomm::sum);
    std::vector<T> mine(
        buf.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)),
        buf.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r + 1)));
    expect_equal<T>({"reduce_scatter in place", r, n, count}, mine, want);
  }
  {  // all_to_all: block j of rank i's input becomes block i of rank j's output
    std::vector<T> in(count * un), want(count * un);
    for (std::size_t b = 0; b < un; ++b)
      for (std::size_t i = 0; i < count; ++i) {
        in[b * count + i] = from_int<T>(static_cast<std::int64_t>(
            (r * 7 + static_cast<int>(b) * 3 + static_cast<int>(i)) % 100));
        want[b * count + i] = from_int<T>(static_cast<std::int64_t>(
            (static_cast<int>(b) * 7 + r * 3 + static_cast<int>(i)) % 100));
      }
    std::vector<T> out(count * un);
    co_await c.all_to_all(in, out);
    expect_equal<T>({"all_to_all", r, n, count}, out, want);
    co_await c.all_to_all(in);
    expect_equal<T>({"all_to_all in place", r, n, count}, in, want);
  }
  {  // the _v forms: rank p contributes count + p elements
    const auto in = inputs<T>(r, count + static_cast<std::size_t>(r), K::sum);
    std::vector<T> out;
    auto counts = co_await c.all_gather_v(in, out);
    std::vector<T> want;
    for (int p = 0; p < n; ++p) {
      auto part = inputs<T>(p, count + static_cast<std::size_t>(p), K::sum);
      want.insert(want.end(), part.begin(), part.end());
      if (counts[static_cast<std::size_t>(p)] != count + static_cast<std::size_t>(p))
        throw check_failed("all_gather_v: wrong count for rank " + std::to_string(p));
    }
    expect_equal<T>({"all_gather_v", r, n, count}, out, want);
    // all_to_all_v: rank r sends (r + j) % 3 elements to rank j, valued r*100 + j.
    std::vector<std::size_t> send_counts(un);
    std::vector<T> send;
    for (int j = 0; j < n; ++j) {
      send_counts[static_cast<std::size_t>(j)] =
          static_cast<std::size_t>((r + j) % 3) * (count % 4 + 1);
      send.insert(send.end(), send_counts[static_cast<std::size_t>(j)],
                  from_int<T>((r * 10 + j) % 100));
    }
    std::vector<T> received, want_v;
    auto got_counts = co_await c.all_to_all_v(send, send_counts, received);
    for (int p = 0; p < n; ++p) {
      auto k = static_cast<std::size_t>((p + r) % 3) * (count % 4 + 1);
      want_v.insert(want_v.end(), k, from_int<T>((p * 10 + r) % 100));
      if (got_counts[static_cast<std::size_t>(p)] != k)
        throw check_failed("all_to_all_v: wrong count from rank " + std::to_string(p));
    }
    expect_equal<T>({"all_to_all_v", r, n, count}, received, want_v);
  }
  co_await c.barrier();
}

template <class... Ts, class Comm>
asio::awaitable<void> every_dtype(Comm& c, std::size_t count) {
  (co_await every_collective<Ts>(c, count), ...);
}

inline std::vector<std::size_t> counts_for(int world, std::size_t large) {
  std::vector<std::size_t> counts{0, 1, 7, static_cast<std::size_t>(world - 1), large};
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

// User functors, a view typed at run time, and the object collectives
// (strings, vectors, trivially copyable structs), in any world.
template <class Comm>
asio::awaitable<void> functors_views_objects(Comm& c) {
  const int n = c.size(), r = c.rank();
  // A user functor (associative and commutative), on int32 and float.
  auto saturating_sum = [](std::int32_t a, std::int32_t b) { return std::min(a + b, 5); };
  std::vector<std::int32_t> v{1, 2, 3};
  co_await c.all_reduce(v, saturating_sum);
  expect_equal<std::int32_t>({"custom functor", r, n, 3}, v,
                             {std::min(n, 5), std::min(2 * n, 5), std::min(3 * n, 5)});
  auto larger = [](float a, float b) { return a > b ? a : b; };
  std::vector<float> f{static_cast<float>(r), -static_cast<float>(r)};
  co_await c.all_reduce(f, larger);
  expect_equal<float>({"custom functor float", r, n, 2}, f, {static_cast<float>(n - 1), 0.0f});
  // A view whose dtype is known only at run time.
  std::vector<double> d{1.5 * (r + 1), 2.0};
  dcomm::tensor_view view{d.data(), d.size(), dcomm::dtype::float64, {}};
  co_await c.all_reduce(view, dcomm::sum);
  expect_equal<double>({"runtime-typed view", r, n, 2}, d, {0.75 * n * (n + 1), 2.0 * n});
  // Objects: strings, vectors, trivially copyable structs.
  const int last = n - 1;
  std::string s = r == last ? "from the last rank" : "";
  co_await c.broadcast_object(s, last);
  if (s != "from the last rank") throw check_failed("broadcast_object: got '" + s + "'");
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(r + 1), r);
  auto all = co_await c.all_gather_object(sizes);
  for (int p = 0; p < n; ++p)
    if (all[static_cast<std::size_t>(p)] !=
        std::vector<std::int64_t>(static_cast<std::size_t>(p + 1), p))
      throw check_failed("all_gather_object: wrong vector from rank " + std::to_string(p));
  struct point {
    int x;
    double y;
  };
  auto points = co_await c.all_gather_object(point{r, r * 0.5});
  for (int p = 0; p < n; ++p)
    if (points[static_cast<std::size_t>(p)].x != p ||
        points[static_cast<std::size_t>(p)].y != p * 0.5)
      throw check_failed("all_gather_object: wrong struct");
}

}  // namespace cases
}  // namespace dcomm::test
