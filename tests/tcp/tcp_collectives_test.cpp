// Every collective of the CPU backend against computed expectations: every
// dtype, world sizes 1-8, counts 0, 1, 7, world-1 and a large count not
// divisible by the world size, in place and out of place, each algorithm
// forced on its own. Inputs are small integers, exact in every dtype, so
// results are compared exactly.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::check_failed;
using dcomm::test::comm;

namespace {

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
std::int64_t input(int r, std::size_t i, dcomm::reduce_kind k) {
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
constexpr double premul_factor = 0.25;

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

template <class T, class Op>
asio::awaitable<void> all_reduce_case(comm& c, std::size_t count, Op op, dcomm::op_options o) {
  constexpr auto k = dcomm::reduce_kind_of_v<Op>;
  const int n = c.size(), r = c.rank();
  auto buf = inputs<T>(r, count, k);
  co_await c.all_reduce(buf, op, o);
  expect_equal<T>({"all_reduce in place " + std::string(dcomm::name(k)), r, n, count}, buf,
                  expected_vector<T>(n, count, k));
}

template <class T>
asio::awaitable<void> reductions(comm& c, std::size_t count, dcomm::op_options o) {
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
template <class T>
asio::awaitable<void> every_collective(comm& c, std::size_t count) {
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

template <class... Ts>
asio::awaitable<void> every_dtype(comm& c, std::size_t count) {
  (co_await every_collective<Ts>(c, count), ...);
}

std::vector<std::size_t> counts_for(int world, std::size_t large) {
  std::vector<std::size_t> counts{0, 1, 7, static_cast<std::size_t>(world - 1), large};
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

// Small eager limit and chunks, so that the rendezvous protocol, chunking
// and pipelining are exercised with counts that keep the test fast.
dcomm::cpu_backend::options small_messages() {
  dcomm::cpu_backend::options o;
  o.eager_limit = 512;
  o.chunk_bytes = 1024;
  o.small_all_reduce = 256;
  o.small_broadcast = 256;
  o.small_all_gather = 256;
  o.small_reduce_scatter = 256;
  // Where the ranks share memory, the arena's collectives take several
  // steps, and all_reduce splits its reduction, at these counts too.
  o.shm_slot_bytes = 4096;
  return o;
}

}  // namespace

TEST_SUITE("tcp collectives") {
  TEST_CASE("every collective, every dtype, worlds 1 to 8, edge counts") {
    DCOMM_TEST_DEADLINE(240s);
    for (int world : {1, 2, 3, 4, 5, 8}) {
      CAPTURE(world);
      // 1001 is not divisible by any of the worlds but 1; with the small
      // limits it takes the ring, chain and rendezvous paths.
      const std::size_t large = 1001;
      DCOMM_REQUIRE_WORLD(
          world,
          [&](comm& c, int) -> asio::awaitable<void> {
            for (auto count : counts_for(world, large))
              co_await every_dtype<std::int8_t, std::uint8_t, std::int32_t, std::int64_t,
                                   dcomm::float16, dcomm::bfloat16, float, double>(c, count);
          },
          60s, small_messages());
    }
  }

  TEST_CASE("default limits: large buffers take the ring and chain at their real sizes") {
    DCOMM_TEST_DEADLINE(120s);
    for (int world : {2, 3}) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [&](comm& c, int) -> asio::awaitable<void> {
        co_await every_collective<float>(c, 300'007);  // > chunk and eager limits
        co_await every_collective<std::int64_t>(c, 70'001);
      });
    }
  }

  TEST_CASE("each algorithm forced on its own") {
    DCOMM_TEST_DEADLINE(120s);
    using A = dcomm::algorithm;
    for (int world : {2, 3, 5}) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(
          world,
          [&](comm& c, int) -> asio::awaitable<void> {
            const int n = c.size(), r = c.rank();
            // The arena's algorithms where every rank shares this host's memory.
            bool arena = true;
            for (int p = 0; p < n; ++p)
              if (p != r && c.backend().link_to(p) != "shm") arena = false;
            auto with_arena = [arena](std::vector<A> as) {
              if (arena) as.push_back(A::shared_memory);
              return as;
            };
            if (arena) co_await c.barrier({.algorithm = A::shared_memory});
            for (std::size_t count :
                 {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1001}}) {
              for (auto a : with_arena({A::recursive_doubling, A::ring})) {
                dcomm::op_options o{.algorithm = a};
                co_await reductions<std::int32_t>(c, count, o);
                co_await reductions<float>(c, count, o);
                const auto in = inputs<double>(r, count, dcomm::reduce_kind::sum);
                std::vector<double> out(count);
                co_await c.all_reduce(in, out, dcomm::sum, o);
                expect_equal<double>({"all_reduce " + std::string(dcomm::name(a)), r, n, count},
                                     out,
                                     expected_vector<double>(n, count, dcomm::reduce_kind::sum));
              }
              for (auto a : with_arena({A::binomial_tree, A::chain})) {
                dcomm::op_options o{.algorithm = a};
                for (int root = 0; root < n; ++root) {
                  auto buf = r == root ? inputs<std::int64_t>(r, count, dcomm::reduce_kind::sum)
                                       : std::vector<std::int64_t>(count);
                  co_await c.broadcast(buf, root, o);
                  expect_equal<std::int64_t>(
                      {"broadcast " + std::string(dcomm::name(a)), r, n, count}, buf,
                      inputs<std::int64_t>(root, count, dcomm::reduce_kind::sum));
                  auto red = inputs<std::int64_t>(r, count, dcomm::reduce_kind::sum);
                  co_await c.reduce(red, root, dcomm::sum, o);
                  if (r == root)
                    expect_equal<std::int64_t>(
                        {"reduce " + std::string(dcomm::name(a)), r, n, count}, red,
                        expected_vector<std::int64_t>(n, count, dcomm::reduce_kind::sum));
                }
              }
              for (auto a : with_arena({A::direct, A::ring})) {
                dcomm::op_options o{.algorithm = a};
                const auto in = inputs<std::uint8_t>(r, count, dcomm::reduce_kind::sum);
                std::vector<std::uint8_t> out(count * static_cast<std::size_t>(n)), want;
                for (int p = 0; p < n; ++p) {
                  auto part = inputs<std::uint8_t>(p, count, dcomm::reduce_kind::sum);
                  want.insert(want.end(), part.begin(), part.end());
                }
                co_await c.all_gather(in, out, o);
                expect_equal<std::uint8_t>(
                    {"all_gather " + std::string(dcomm::name(a)), r, n, count}, out, want);
                if (a == A::shared_memory) continue;  // reduce_scatter has no arena algorithm
                const auto rs_in =
                    inputs<float>(r, count * static_cast<std::size_t>(n), dcomm::reduce_kind::min);
                std::vector<float> rs_out(count);
                co_await c.reduce_scatter(rs_in, rs_out, dcomm::min, o);
                auto all = expected_vector<float>(n, count * static_cast<std::size_t>(n),
                                                  dcomm::reduce_kind::min);
                std::vector<float> mine(
                    all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)),
                    all.begin() +
                        static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r + 1)));
                expect_equal<float>({"reduce_scatter " + std::string(dcomm::name(a)), r, n, count},
                                    rs_out, mine);
              }
            }
          },
          30s, small_messages());
    }
  }

  TEST_CASE("custom functors, runtime-typed views and objects") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      const int n = c.size();
      // A user functor (associative and commutative), on int32 and float.
      auto saturating_sum = [](std::int32_t a, std::int32_t b) { return std::min(a + b, 5); };
      std::vector<std::int32_t> v{1, 2, 3};
      co_await c.all_reduce(v, saturating_sum);
      expect_equal<std::int32_t>({"custom functor", r, n, 3}, v, {3, 5, 5});
      auto larger = [](float a, float b) { return a > b ? a : b; };
      std::vector<float> f{static_cast<float>(r), -static_cast<float>(r)};
      co_await c.all_reduce(f, larger);
      expect_equal<float>({"custom functor float", r, n, 2}, f, {2.0f, 0.0f});
      // A view whose dtype is known only at run time.
      std::vector<double> d{1.5 * (r + 1), 2.0};
      dcomm::tensor_view view{d.data(), d.size(), dcomm::dtype::float64, {}};
      co_await c.all_reduce(view, dcomm::sum);
      expect_equal<double>({"runtime-typed view", r, n, 2}, d, {9.0, 6.0});
      // Objects: strings, vectors, trivially copyable structs.
      std::string s = r == 2 ? "from rank two" : "";
      co_await c.broadcast_object(s, 2);
      if (s != "from rank two") throw check_failed("broadcast_object: got '" + s + "'");
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
    });
  }

  TEST_CASE("bad input fails before anything is sent, naming the operation") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      auto expect_invalid = [&](std::string what, std::exception_ptr e, std::string needle) {
        try {
          std::rethrow_exception(e);
        } catch (const dcomm::error& err) {
          if (err.code() != dcomm::errc::invalid_argument ||
              std::string(err.what()).find(needle) == std::string::npos)
            throw check_failed(what + ": wrong error: " + err.what());
          return;
        }
      };
      auto attempt = [](auto op) -> asio::awaitable<std::exception_ptr> {
        try {
          co_await op();
        } catch (...) {
          co_return std::current_exception();
        }
        co_return nullptr;
      };
      std::vector<float> v(4), small(3), big(8);
      std::vector<double> d(4);
      auto e = co_await attempt([&] { return c.broadcast(v, 2); });
      expect_invalid("root out of range", e, "root 2 is out of range");
      e = co_await attempt([&] { return c.all_reduce(v, small, dcomm::sum); });
      expect_invalid("size mismatch", e, "all_reduce");
      e = co_await attempt([&] { return c.all_gather(v, small); });
      expect_invalid("all_gather output size", e, "must hold 2 blocks");
      e = co_await attempt([&] { return c.send(v, r); });
      expect_invalid("send to self", e, "itself");
      e = co_await attempt([&] { return c.recv(v, -1); });
      expect_invalid("negative peer", e, "out of range");
      std::span<float> head(big.data(), 4), overlapping(big.data() + 2, 4);
      e = co_await attempt([&] { return c.all_reduce(head, overlapping, dcomm::sum); });
      expect_invalid("overlap", e, "overlap");
      dcomm::tensor_view iv{v.data(), v.size(), dcomm::dtype::int32, {}};
      dcomm::tensor_view fv{d.data(), d.size(), dcomm::dtype::float64, {}};
      e = co_await attempt([&] { return c.all_reduce(fv, dcomm::band); });
      expect_invalid("bitwise on floats at run time", e, "integral");
      e = co_await attempt([&] { return c.all_reduce(iv, dcomm::avg); });
      expect_invalid("avg on ints at run time", e, "floating");
      dcomm::op_options wrong{.algorithm = dcomm::algorithm::chain};
      e = co_await attempt([&] { return c.all_reduce(v, dcomm::sum, wrong); });
      expect_invalid("an algorithm all_reduce lacks", e, "not available");
      // Never dereferenced: refused for where it lives before any byte moves.
      dcomm::tensor_view on_gpu{v.data(), v.size(), dcomm::dtype::float32, dcomm::device::cuda(0)};
      e = co_await attempt([&] { return c.all_reduce(on_gpu, dcomm::sum); });
      expect_invalid("a CUDA tensor", e, "host memory");
      e = co_await attempt([&] { return c.broadcast(on_gpu, 0); });
      expect_invalid("a CUDA tensor to broadcast", e, "nccl backend");
      dcomm::op_options on_stream{.stream = reinterpret_cast<CUstream_st*>(std::uintptr_t{8})};
      e = co_await attempt([&] { return c.all_reduce(v, dcomm::sum, on_stream); });
      expect_invalid("a stream", e, "no streams");
      // The numbering stayed in step: a real collective still works.
      std::vector<int> one{1};
      co_await c.all_reduce(one, dcomm::sum);
      if (one[0] != 2) throw check_failed("all_reduce after refused calls");
    });
  }
}
