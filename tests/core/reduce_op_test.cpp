// Tests for reduce ops: which ops are valid for which element types, and the
// CPU combine kernels. Expectations are computed here independently: integer
// wrap-around with __builtin_*_overflow (which yields the wrapped result),
// floating-point results exactly in double and rounded with a <cmath>
// reference, never by calling the kernels under test.
#include <doctest/doctest.h>
#include <dcomm/backend.hpp>  // reducer
#include <dcomm/reduce_op.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>  // doctest prints std::error_code with operator<<
#include <string>
#include <type_traits>
#include <vector>

namespace {

using dcomm::bfloat16;
using dcomm::dtype;
using dcomm::float16;
using dcomm::reduce_kind;

constexpr reduce_kind all_kinds[] = {reduce_kind::sum,       reduce_kind::prod, reduce_kind::min,
                                     reduce_kind::max,       reduce_kind::avg,  reduce_kind::band,
                                     reduce_kind::bor,       reduce_kind::bxor, reduce_kind::custom,
                                     reduce_kind::premul_sum};
constexpr dtype all_dtypes[] = {dtype::int8,    dtype::uint8,    dtype::int32,   dtype::int64,
                                dtype::float16, dtype::bfloat16, dtype::float32, dtype::float64};

template <class T>
constexpr bool is_int = std::is_integral_v<T>;

// x rounded to a binary format with `digits` significand bits and smallest
// normal exponent min_exponent, ties to even, overflowing to inf.
double reference_round(double x, int digits, int min_exponent, double largest) {
  if (std::isnan(x) || x == 0 || std::isinf(x)) return x;
  int e = 0;
  std::frexp(std::fabs(x), &e);
  const double ulp = std::ldexp(1.0, std::max(e - 1, min_exponent) - (digits - 1));
  double r = std::nearbyint(std::fabs(x) / ulp) * ulp;
  if (r > largest) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

// The exact result x rounded to T. x is computed in double, which is exact
// for sums and products of halves and, having more than 2p+2 bits, rounds
// float results correctly too; for double x is the IEEE result itself.
template <class T>
T round_to(double x) {
  if constexpr (std::is_same_v<T, float16>)
    return T(static_cast<float>(reference_round(x, 11, -14, 65504.0)));
  else if constexpr (std::is_same_v<T, bfloat16>)
    return T(static_cast<float>(reference_round(x, 8, -126, std::ldexp(255.0, 120))));
  else if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(
        reference_round(x, 24, -126, static_cast<double>((std::numeric_limits<float>::max)())));
  else
    return x;
}

// Exact for every element type (halves convert to float exactly).
template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>)
    return static_cast<double>(static_cast<float>(x));
  else
    return static_cast<double>(x);
}

template <class T>
std::vector<T> samples() {
  using L = std::numeric_limits<T>;
  if constexpr (is_int<T>) {
    std::vector<T> v = {(L::min)(), (L::max)(), 0, 1, 2, 3, 7, 100, 0x55, 0x0f};
    if constexpr (std::is_signed_v<T>) {
      v.push_back(-1);
      v.push_back(-2);
      v.push_back(-100);
      v.push_back(static_cast<T>((L::min)() + 1));
    } else {
      v.push_back(200);
      v.push_back(static_cast<T>((L::max)() - 1));
    }
    if constexpr (sizeof(T) >= 4) {
      v.push_back(65536);
      v.push_back(static_cast<T>(123456789));
    }
    if constexpr (sizeof(T) == 8) v.push_back(static_cast<T>(std::int64_t{1} << 32));
    return v;
  } else {
    return {T(0.0f),       T(-0.0f),       T(1.0f),       T(-1.0f),        T(1.5f),
            T(0.1f),       T(-2.75f),      T(3.0f),       T(1000.0f),      T(1e-3f),
            (L::max)(),    L::lowest(),    (L::min)(),    L::denorm_min(), L::epsilon(),
            L::infinity(), -L::infinity(), L::quiet_NaN()};
  }
}

// Every ordered pair of samples, as the two buffers of one combine.
template <class T>
struct pair_buffers {
  std::vector<T> a;
  std::vector<T> b;
};

template <class T>
pair_buffers<T> all_pairs() {
  const std::vector<T> s = samples<T>();
  pair_buffers<T> p;
  for (T x : s)
    for (T y : s) {
      p.a.push_back(x);
      p.b.push_back(y);
    }
  return p;
}

template <class T>
T expected(reduce_kind k, T x, T y) {
  if constexpr (is_int<T>) {
    T r{};
    switch (k) {
      case reduce_kind::sum:
        __builtin_add_overflow(x, y, &r);  // stores the wrapped result
        return r;
      case reduce_kind::prod:
        __builtin_mul_overflow(x, y, &r);
        return r;
      case reduce_kind::min:
        return y < x ? y : x;
      case reduce_kind::max:
        return y > x ? y : x;
      case reduce_kind::band:
        return static_cast<T>(x & y);
      case reduce_kind::bor:
        return static_cast<T>(x | y);
      case reduce_kind::bxor:
        return static_cast<T>(x ^ y);
      default:
        break;
    }
  } else {
    const double a = as_double(x);
    const double b = as_double(y);
    switch (k) {
      case reduce_kind::sum:
      case reduce_kind::avg:
      case reduce_kind::premul_sum:  // the factor comes once, at the end
        return round_to<T>(a + b);
      case reduce_kind::prod:
        return round_to<T>(a * b);
      case reduce_kind::min:  // NaN on either side wins
        return std::isnan(a) ? x : std::isnan(b) ? y : b < a ? y : x;
      case reduce_kind::max:
        return std::isnan(a) ? x : std::isnan(b) ? y : b > a ? y : x;
      default:
        break;
    }
  }
  FAIL("no expectation for " << dcomm::name(k));
  return T{};
}

template <class T>
bool same_element(T got, T want, reduce_kind k) {
  if constexpr (is_int<T>) {
    return got == want;
  } else {
    const double g = as_double(got);
    const double w = as_double(want);
    if (std::isnan(w)) return std::isnan(g);
    // min/max of +0 and -0 may return either zero.
    if (k == reduce_kind::min || k == reduce_kind::max) return g == w;
    return g == w && std::signbit(g) == std::signbit(w);
  }
}

template <class T, class Op>
void check_op_on_all_pairs(const Op& op) {
  constexpr reduce_kind k = dcomm::reduce_kind_of_v<Op>;
  CAPTURE(dcomm::name(k));
  CAPTURE(dcomm::name(dcomm::dtype_of_v<T>));
  pair_buffers<T> p = all_pairs<T>();
  const std::vector<T> original = p.a;
  dcomm::reduce_into(op, p.a.data(), p.b.data(), p.a.size());
  int mismatches = 0;
  for (std::size_t i = 0; i < p.a.size(); ++i) {
    const T want = expected(k, original[i], p.b[i]);
    if (!same_element(p.a[i], want, k) && ++mismatches <= 5)
      FAIL_CHECK("element " << i << ": " << as_double(original[i]) << " with " << as_double(p.b[i])
                            << " gave " << as_double(p.a[i]) << ", expected " << as_double(want));
  }
  CHECK(mismatches == 0);

  // The runtime-typed dispatcher gives the same bits, and so does
  // reduce_to (out = a op b, typed and at run time) into a third buffer.
  std::vector<T> again = original;
  dcomm::reduce_into(k, dcomm::dtype_of_v<T>, again.data(), p.b.data(), again.size());
  std::vector<T> typed_to(original.size()), runtime_to(original.size());
  dcomm::reduce_to(op, typed_to.data(), original.data(), p.b.data(), original.size());
  dcomm::reduce_to(k, dcomm::dtype_of_v<T>, runtime_to.data(), original.data(), p.b.data(),
                   original.size());
  for (const auto* form : {&again, &typed_to, &runtime_to})
    for (std::size_t i = 0; i < form->size(); ++i)
      if (!same_element((*form)[i], p.a[i], reduce_kind::sum)) {
        FAIL_CHECK((form == &again      ? "runtime reduce_into"
                    : form == &typed_to ? "reduce_to"
                                        : "runtime reduce_to")
                   << " differs at element " << i);
        break;
      }
}

// A struct functor with state and a const call operator.
struct scaled_add {
  float scale;
  float operator()(float a, float b) const { return a + scale * b; }
};

struct not_convertible {};

}  // namespace

TEST_CASE("reduce tags and kinds") {
  static_assert(dcomm::reduce_kind_of_v<dcomm::sum_t> == reduce_kind::sum);
  static_assert(dcomm::reduce_kind_of_v<decltype(dcomm::prod)> == reduce_kind::prod);
  static_assert(dcomm::reduce_kind_of_v<decltype(dcomm::min)> == reduce_kind::min);
  static_assert(dcomm::reduce_kind_of_v<const dcomm::max_t&> == reduce_kind::max);
  static_assert(dcomm::reduce_kind_of_v<dcomm::avg_t&&> == reduce_kind::avg);
  static_assert(dcomm::reduce_kind_of_v<dcomm::band_t> == reduce_kind::band);
  static_assert(dcomm::reduce_kind_of_v<dcomm::bor_t> == reduce_kind::bor);
  static_assert(dcomm::reduce_kind_of_v<dcomm::bxor_t> == reduce_kind::bxor);
  static_assert(dcomm::reduce_kind_of_v<decltype(dcomm::premul_sum(0.5))> ==
                reduce_kind::premul_sum);
  static_assert(dcomm::premul_sum(0.25).factor == 0.25);
  static_assert(dcomm::reduce_kind_of_v<scaled_add> == reduce_kind::custom);
  static_assert(dcomm::reduce_kind_of_v<std::plus<>> == reduce_kind::custom);
  constexpr auto lambda = [](int a, int b) { return a + b; };
  static_assert(dcomm::reduce_kind_of_v<decltype(lambda)> == reduce_kind::custom);

  CHECK(dcomm::name(reduce_kind::sum) == "sum");
  CHECK(dcomm::name(reduce_kind::band) == "band");
  CHECK(dcomm::name(reduce_kind::custom) == "custom");
  CHECK(dcomm::name(reduce_kind::premul_sum) == "premul_sum");
  // Kinds travel between ranks: appended, never renumbered.
  static_assert(static_cast<int>(reduce_kind::custom) == 8);
  static_assert(static_cast<int>(reduce_kind::premul_sum) == 9);
  CHECK(dcomm::name(static_cast<reduce_kind>(99)) == "unknown");
}

TEST_CASE("dcomm::min and dcomm::max do not get in the way of std::min / std::max") {
  using namespace dcomm;
  CHECK(std::min(3, 4) == 3);
  CHECK(std::max(3.0, 4.0) == 4.0);
  CHECK(std::min({5, 2, 9}) == 2);
  CHECK((std::numeric_limits<int>::max)() == INT32_MAX);
  static_assert(std::is_same_v<std::remove_cv_t<decltype(dcomm::min)>, dcomm::min_t>);
}

TEST_CASE_TEMPLATE("reduce_op_for per element type", T, std::int8_t, std::uint8_t, std::int32_t,
                   std::int64_t, float16, bfloat16, float, double) {
  constexpr bool integral = is_int<T>;
  static_assert(dcomm::reduce_op_for<dcomm::sum_t, T>);
  static_assert(dcomm::reduce_op_for<dcomm::prod_t, T>);
  static_assert(dcomm::reduce_op_for<dcomm::min_t, T>);
  static_assert(dcomm::reduce_op_for<dcomm::max_t, T>);
  static_assert(dcomm::reduce_op_for<const dcomm::sum_t&, const T>);
  static_assert(dcomm::reduce_op_for<dcomm::avg_t, T> == !integral);
  static_assert(dcomm::reduce_op_for<dcomm::premul_sum_t, T> == !integral);
  static_assert(dcomm::reduce_op_for<dcomm::band_t, T> == integral);
  static_assert(dcomm::reduce_op_for<dcomm::bor_t, T> == integral);
  static_assert(dcomm::reduce_op_for<dcomm::bxor_t, T> == integral);

  // User functors: anything callable as op(T, T) -> convertible to T.
  static_assert(dcomm::reduce_op_for<std::plus<>, T>);
  static_assert(dcomm::reduce_op_for<scaled_add, T>);  // via float, both ways
  constexpr auto generic = [](auto a, auto b) { return a < b ? b : a; };
  static_assert(dcomm::reduce_op_for<decltype(generic), T>);
  constexpr auto to_void = [](T, T) {};
  static_assert(!dcomm::reduce_op_for<decltype(to_void), T>);
  constexpr auto to_struct = [](T, T) { return not_convertible{}; };
  static_assert(!dcomm::reduce_op_for<decltype(to_struct), T>);
  constexpr auto three_args = [](T a, T, T) { return a; };
  static_assert(!dcomm::reduce_op_for<decltype(three_args), T>);
  auto non_const = [n = 0](T a, T) mutable {
    ++n;
    return a;
  };
  static_assert(!dcomm::reduce_op_for<decltype(non_const), T>);  // called through const&
  (void)non_const(T{}, T{});
  CHECK(true);
}

TEST_CASE("reduce_op_for needs an element type") {
  static_assert(!dcomm::reduce_op_for<dcomm::sum_t, std::int16_t>);
  static_assert(!dcomm::reduce_op_for<dcomm::sum_t, char>);
  static_assert(!dcomm::reduce_op_for<dcomm::sum_t, bool>);
  static_assert(!dcomm::reduce_op_for<dcomm::sum_t, float&>);
  static_assert(!dcomm::reduce_op_for<std::plus<>, long double>);
  static_assert(!dcomm::reduce_op_for<int, float>);  // not callable
  static_assert(!dcomm::reduce_op_for<std::string, float>);
  CHECK(true);
}

TEST_CASE("check_reduce_op accepts valid combinations at compile time") {
  dcomm::check_reduce_op<float, dcomm::sum_t>();
  dcomm::check_reduce_op<float16, dcomm::avg_t>();
  dcomm::check_reduce_op<std::int8_t, dcomm::bxor_t>();
  dcomm::check_reduce_op<double, scaled_add>();
  CHECK(true);
}

TEST_CASE_TEMPLATE("reduce_into: every builtin op on every pair of samples", T, std::int8_t,
                   std::uint8_t, std::int32_t, std::int64_t, float16, bfloat16, float, double) {
  check_op_on_all_pairs<T>(dcomm::sum);
  check_op_on_all_pairs<T>(dcomm::prod);
  check_op_on_all_pairs<T>(dcomm::min);
  check_op_on_all_pairs<T>(dcomm::max);
  if constexpr (is_int<T>) {
    check_op_on_all_pairs<T>(dcomm::band);
    check_op_on_all_pairs<T>(dcomm::bor);
    check_op_on_all_pairs<T>(dcomm::bxor);
  } else {
    check_op_on_all_pairs<T>(dcomm::avg);
    check_op_on_all_pairs<T>(dcomm::premul_sum(0.5));
  }
}

TEST_CASE("integer sum and prod wrap around") {
  auto sum1 = [](auto a, auto b) {
    dcomm::reduce_into(dcomm::sum, &a, &b, 1);
    return a;
  };
  auto prod1 = [](auto a, auto b) {
    dcomm::reduce_into(dcomm::prod, &a, &b, 1);
    return a;
  };
  CHECK(sum1(std::int8_t{100}, std::int8_t{100}) == -56);
  CHECK(sum1(std::int8_t{-128}, std::int8_t{-1}) == 127);
  CHECK(sum1(std::uint8_t{200}, std::uint8_t{100}) == 44);
  CHECK(sum1(INT32_MAX, std::int32_t{1}) == INT32_MIN);
  CHECK(sum1(INT64_MAX, std::int64_t{1}) == INT64_MIN);
  CHECK(sum1(INT64_MIN, INT64_MIN) == 0);
  CHECK(prod1(std::int8_t{-128}, std::int8_t{-1}) == -128);
  CHECK(prod1(std::uint8_t{16}, std::uint8_t{16}) == 0);
  CHECK(prod1(std::uint8_t{255}, std::uint8_t{255}) == 1);
  CHECK(prod1(std::int32_t{65536}, std::int32_t{65536}) == 0);
  CHECK(prod1(INT32_MIN, std::int32_t{-1}) == INT32_MIN);
  CHECK(prod1(std::int64_t{1} << 32, std::int64_t{1} << 32) == 0);
  CHECK(prod1(INT64_MAX, INT64_MAX) == 1);
  CHECK(prod1(INT64_MIN, std::int64_t{-1}) == INT64_MIN);
}

TEST_CASE("16-bit float combines are computed in float and rounded once") {
  // 2048 + 1 is a tie in float16 (ulp 2 there): even gives 2048; 2048 + 3
  // is a tie going up to 2052.
  std::vector<float16> acc = {float16(2048.0f), float16(2048.0f), float16(0.1f)};
  const std::vector<float16> in = {float16(1.0f), float16(3.0f), float16(0.2f)};
  dcomm::reduce_into(dcomm::sum, acc.data(), in.data(), acc.size());
  CHECK(acc[0].bits() == float16(2048.0f).bits());
  CHECK(acc[1].bits() == float16(2052.0f).bits());
  // 0.1 + 0.2 in float16: the exact sum of the two halves, rounded once.
  const double exact = static_cast<double>(static_cast<float>(float16(0.1f))) +
                       static_cast<double>(static_cast<float>(float16(0.2f)));
  CHECK(static_cast<float>(acc[2]) == static_cast<float>(reference_round(exact, 11, -14, 65504.0)));

  // A running sum of many small values: each step rounds to the element
  // type, as a ring of bfloat16 buffers would.
  std::vector<bfloat16> total(1, bfloat16(256.0f));
  const std::vector<bfloat16> one(1, bfloat16(1.0f));
  for (int i = 0; i < 10; ++i) dcomm::reduce_into(dcomm::sum, total.data(), one.data(), 1);
  CHECK(static_cast<float>(total[0]) == 256.0f);  // 257 is a tie (ulp 2), to even

  // Overflow goes to inf rather than wrapping.
  std::vector<float16> big = {float16(60000.0f)};
  const std::vector<float16> more = {float16(60000.0f)};
  dcomm::reduce_into(dcomm::sum, big.data(), more.data(), 1);
  CHECK(std::isinf(static_cast<float>(big[0])));
}

TEST_CASE("min and max propagate NaN whichever side it is on") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> a = {nan, 1.0f, 2.0f};
  std::vector<float> b = {1.0f, nan, 1.0f};
  std::vector<float> a2 = a;
  dcomm::reduce_into(dcomm::min, a.data(), b.data(), a.size());
  dcomm::reduce_into(dcomm::max, a2.data(), b.data(), a2.size());
  CHECK(std::isnan(a[0]));
  CHECK(std::isnan(a[1]));
  CHECK(a[2] == 1.0f);
  CHECK(std::isnan(a2[0]));
  CHECK(std::isnan(a2[1]));
  CHECK(a2[2] == 2.0f);
}

TEST_CASE_TEMPLATE("divide_by finishes avg with one rounding", T, float16, bfloat16, float,
                   double) {
  const std::vector<T> s = samples<T>();
  for (int world : {1, 2, 3, 7, 1000}) {
    CAPTURE(world);
    std::vector<T> v = s;
    dcomm::divide_by(v.data(), v.size(), world);
    for (std::size_t i = 0; i < v.size(); ++i) {
      const T want = round_to<T>(as_double(s[i]) / world);
      CHECK_MESSAGE(same_element(v[i], want, reduce_kind::avg),
                    as_double(s[i]) << " / " << world << " gave " << as_double(v[i]));
    }
    std::vector<T> w = s;
    dcomm::divide_by(dcomm::dtype_of_v<T>, w.data(), w.size(), world);
    for (std::size_t i = 0; i < w.size(); ++i) CHECK(same_element(w[i], v[i], reduce_kind::avg));
  }
  std::vector<T> v = s;
  CHECK_THROWS_AS(dcomm::divide_by(v.data(), v.size(), 0), dcomm::error);
  CHECK_THROWS_AS(dcomm::divide_by(v.data(), v.size(), -2), dcomm::error);
}

// Every pattern, so that a shortcut such as multiplying by 1/world (off by
// one ulp near ties) cannot hide.
TEST_CASE_TEMPLATE("divide_by on every 16-bit pattern", T, float16, bfloat16) {
  std::vector<T> all;
  for (std::uint32_t b = 0; b <= 0xffff; ++b)
    all.push_back(T::from_bits(static_cast<std::uint16_t>(b)));
  for (int world : {3, 7, 10, 48}) {
    CAPTURE(world);
    std::vector<T> v = all;
    dcomm::divide_by(v.data(), v.size(), world);
    int mismatches = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const T want = round_to<T>(as_double(all[i]) / world);
      if (!same_element(v[i], want, reduce_kind::avg) && ++mismatches <= 5)
        FAIL_CHECK("pattern " << i << " / " << world << " gave " << as_double(v[i]));
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("avg = sum then divide_by, e.g. over three ranks") {
  std::vector<float> acc = {1.0f, 2.0f, -4.0f};
  const std::vector<float> r1 = {2.0f, 2.0f, 0.5f};
  const std::vector<float> r2 = {3.0f, 2.0f, 0.5f};
  dcomm::reduce_into(dcomm::avg, acc.data(), r1.data(), 3);
  dcomm::reduce_into(dcomm::avg, acc.data(), r2.data(), 3);
  dcomm::divide_by(acc.data(), acc.size(), 3);
  CHECK(acc[0] == 2.0f);
  CHECK(acc[1] == 2.0f);
  CHECK(acc[2] == -1.0f);
}

TEST_CASE("user functors are applied elementwise") {
  std::vector<std::int32_t> a = {1, 2, 3, -4};
  const std::vector<std::int32_t> b = {5, 6, 7, 8};
  dcomm::reduce_into([](std::int32_t x, std::int32_t y) { return x * 10 + y; }, a.data(), b.data(),
                     a.size());
  CHECK(a == std::vector<std::int32_t>{15, 26, 37, -32});

  std::vector<float> f = {1.0f, 2.0f};
  const std::vector<float> g = {10.0f, 20.0f};
  dcomm::reduce_into(scaled_add{0.5f}, f.data(), g.data(), f.size());
  CHECK(f == std::vector<float>{6.0f, 12.0f});

  // On float16 through float, the result rounded back.
  std::vector<float16> h = {float16(1.0f), float16(5.0f)};
  const std::vector<float16> k = {float16(4.0f), float16(2.0f)};
  dcomm::reduce_into([](float x, float y) { return x > y ? x - y : y - x; }, h.data(), k.data(), 2);
  CHECK(static_cast<float>(h[0]) == 3.0f);
  CHECK(static_cast<float>(h[1]) == 3.0f);

  // A generic lambda on bytes; the int result is narrowed back to uint8_t.
  std::vector<std::uint8_t> u = {0xf0, 0x0f};
  const std::vector<std::uint8_t> w = {0x0f, 0x0f};
  dcomm::reduce_into([](auto x, auto y) { return x + y; }, u.data(), w.data(), 2);
  CHECK(u == std::vector<std::uint8_t>{0xff, 0x1e});

  // n == 0 touches nothing.
  dcomm::reduce_into(dcomm::sum, u.data(), w.data(), 0);
  CHECK(u == std::vector<std::uint8_t>{0xff, 0x1e});
}

TEST_CASE("a reducer's combine_to is a copy and a combine in one pass, in every form") {
  const std::vector<float> a = {1.0f, -2.0f, 3.5f, 0.25f}, b = {10.0f, 20.0f, -30.0f, 0.5f};
  std::vector<float> want = a;
  dcomm::reduce_into(scaled_add{2.0f}, want.data(), b.data(), want.size());
  const scaled_add custom{2.0f};
  dcomm::reducer typed = dcomm::make_reducer<float>(custom);
  dcomm::reducer fallback = typed;
  fallback.combine_to_fn = nullptr;  // a backend's own reducer: memcpy, then combine
  for (const dcomm::reducer* r : {&typed, &fallback}) {
    std::vector<float> out(a.size(), -1.0f);
    r->combine_to(out.data(), a.data(), b.data(), out.size());
    CHECK(out == want);
    r->combine_to(out.data(), b.data(), a.data(), 0);  // nothing: nothing touched
    CHECK(out == want);
  }
  // The runtime-typed reducer (builtin ops on a dtype known at run time).
  const std::vector<std::int8_t> x = {127, -5, 7}, y = {1, -6, 8};
  dcomm::reducer runtime = dcomm::make_reducer(dcomm::sum, dcomm::dtype::int8);
  std::vector<std::int8_t> out(3);
  runtime.combine_to(out.data(), x.data(), y.data(), out.size());
  CHECK(out == std::vector<std::int8_t>{-128, -11, 15});
}

TEST_CASE("premul_sum = sum then scale_by its factor, typed and at run time") {
  std::vector<double> acc = {1.0, 2.0, -4.0};
  const std::vector<double> r1 = {2.0, 2.0, 0.5};
  const auto op = dcomm::premul_sum(0.25);
  dcomm::reduce_into(op, acc.data(), r1.data(), 3);  // the factor plays no part here
  CHECK(acc == std::vector<double>{3.0, 4.0, -3.5});
  dcomm::scale_by(acc.data(), acc.size(), op.factor);
  CHECK(acc == std::vector<double>{0.75, 1.0, -0.875});
  std::vector<bfloat16> h = {bfloat16(3.0f), bfloat16(-8.0f)};
  dcomm::scale_by(dtype::bfloat16, h.data(), h.size(), 0.5);
  CHECK(static_cast<float>(h[0]) == 1.5f);
  CHECK(static_cast<float>(h[1]) == -4.0f);
  std::vector<std::int32_t> ints = {1, 2};
  CHECK_THROWS_AS(dcomm::scale_by(dtype::int32, ints.data(), ints.size(), 0.5), dcomm::error);
  CHECK(ints == std::vector<std::int32_t>{1, 2});
}

TEST_CASE("supports() and the runtime check_reduce_op") {
  for (reduce_kind k : all_kinds) {
    for (dtype t : all_dtypes) {
      CAPTURE(dcomm::name(k));
      CAPTURE(dcomm::name(t));
      const bool floating =
          t == dtype::float16 || t == dtype::bfloat16 || t == dtype::float32 || t == dtype::float64;
      bool want = true;
      if (k == reduce_kind::band || k == reduce_kind::bor || k == reduce_kind::bxor)
        want = !floating;
      else if (k == reduce_kind::avg || k == reduce_kind::premul_sum)
        want = floating;
      else if (k == reduce_kind::custom)
        want = false;
      CHECK(dcomm::supports(k, t) == want);
      if (want)
        CHECK_NOTHROW(dcomm::check_reduce_op(k, t));
      else
        CHECK_THROWS_AS(dcomm::check_reduce_op(k, t), dcomm::error);
    }
  }
  CHECK_FALSE(dcomm::supports(reduce_kind::sum, static_cast<dtype>(77)));
  CHECK_FALSE(dcomm::supports(static_cast<reduce_kind>(77), dtype::float32));
  CHECK_THROWS_AS(dcomm::check_reduce_op(reduce_kind::sum, static_cast<dtype>(77)), dcomm::error);
  CHECK_THROWS_AS(dcomm::check_reduce_op(static_cast<reduce_kind>(77), dtype::int8), dcomm::error);
}

TEST_CASE("runtime check names the op and the dtype") {
  struct expectation {
    reduce_kind kind;
    dtype type;
    std::string op;
    std::string type_name;
  };
  for (const expectation& e :
       {expectation{reduce_kind::band, dtype::float32, "band", "float32"},
        expectation{reduce_kind::avg, dtype::int32, "avg", "int32"},
        expectation{reduce_kind::bxor, dtype::bfloat16, "bxor", "bfloat16"}}) {
    try {
      dcomm::check_reduce_op(e.kind, e.type);
      FAIL("no exception for " << e.op << " on " << e.type_name);
    } catch (const dcomm::error& err) {
      const std::string what = err.what();
      CHECK(err.code() == dcomm::errc::invalid_argument);
      CHECK(err.context().operation == "reduce op check");
      CHECK(what.find(e.op) != std::string::npos);
      CHECK(what.find(e.type_name) != std::string::npos);
    }
  }
}

TEST_CASE("runtime-typed reduce_into rejects invalid combinations before writing") {
  std::vector<float> a = {1.0f, 2.0f};
  const std::vector<float> b = {3.0f, 4.0f};
  CHECK_THROWS_AS(dcomm::reduce_into(reduce_kind::band, dtype::float32, a.data(), b.data(), 2),
                  dcomm::error);
  CHECK(a == std::vector<float>{1.0f, 2.0f});
  std::vector<std::int32_t> i = {1, 2};
  const std::vector<std::int32_t> j = {3, 4};
  CHECK_THROWS_AS(dcomm::reduce_into(reduce_kind::avg, dtype::int32, i.data(), j.data(), 2),
                  dcomm::error);
  CHECK_THROWS_AS(dcomm::reduce_into(reduce_kind::custom, dtype::int32, i.data(), j.data(), 2),
                  dcomm::error);
  CHECK_THROWS_AS(dcomm::divide_by(dtype::int32, i.data(), 2, 2), dcomm::error);
  CHECK(i == std::vector<std::int32_t>{1, 2});
  dcomm::reduce_into(reduce_kind::bor, dtype::int32, i.data(), j.data(), 2);
  CHECK(i == std::vector<std::int32_t>{3, 6});
}
