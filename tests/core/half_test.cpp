// Tests for dcomm::float16 / dcomm::bfloat16. Expectations come from a
// reference written here with <cmath> (ldexp, frexp, nearbyint in the default
// round-to-nearest-even mode), not from the bit tricks in half.hpp.
#include <doctest/doctest.h>
#include <dcomm/half.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

using dcomm::bfloat16;
using dcomm::float16;

// The format parameters the reference needs.
struct format {
  int digits;        // significand bits including the implicit one
  int min_exponent;  // exponent of the smallest normal, as in 2^e
  int exponent_bits;
};
constexpr format half_format{11, -14, 5};
constexpr format bf16_format{8, -126, 8};

template <class H>
constexpr format format_of() {
  return std::is_same_v<H, float16> ? half_format : bf16_format;
}

// The value a bit pattern stands for; NaN for NaN patterns.
double reference_value(std::uint16_t bits, format f) {
  const int mantissa_bits = f.digits - 1;
  const int max_biased = (1 << f.exponent_bits) - 1;
  const int bias = max_biased / 2;
  const bool negative = (bits & 0x8000u) != 0;
  const int biased = (bits >> mantissa_bits) & max_biased;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  double magnitude = 0;
  if (biased == max_biased)
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity()
                              : std::numeric_limits<double>::quiet_NaN();
  else if (biased == 0)
    magnitude = std::ldexp(mantissa, f.min_exponent - mantissa_bits);
  else
    magnitude = std::ldexp((1 << mantissa_bits) + mantissa, biased - bias - mantissa_bits);
  return negative ? -magnitude : magnitude;
}

double largest_finite(format f) {
  const int mantissa_bits = f.digits - 1;
  const int bias = ((1 << f.exponent_bits) - 1) / 2;
  return std::ldexp((1 << f.digits) - 1, bias - mantissa_bits);
}

// x rounded to the format, ties to even, overflowing to inf.
double reference_round(double x, format f) {
  if (std::isnan(x) || x == 0 || std::isinf(x)) return x;
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, f.min_exponent);
  const double ulp = std::ldexp(1.0, exponent - (f.digits - 1));
  double r = std::nearbyint(std::fabs(x) / ulp) * ulp;
  if (r > largest_finite(f)) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

// Same value and, for zeros, same sign.
bool same_value(double got, double expected) {
  if (std::isnan(expected)) return std::isnan(got);
  return got == expected && std::signbit(got) == std::signbit(expected);
}

template <class H>
std::uint16_t quiet_bit() {
  return std::is_same_v<H, float16> ? 0x0200 : 0x0040;
}

template <class H>
bool is_nan_bits(std::uint16_t b) {
  return std::isnan(reference_value(b, format_of<H>()));
}

}  // namespace

TEST_CASE_TEMPLATE("16-bit floats are trivial 2-byte value types", H, float16, bfloat16) {
  static_assert(sizeof(H) == 2);
  static_assert(alignof(H) == 2);
  static_assert(std::is_trivially_copyable_v<H>);
  static_assert(std::is_standard_layout_v<H>);
  static_assert(std::is_trivially_default_constructible_v<H>);
  static_assert(H{}.bits() == 0);
  static_assert(std::convertible_to<float, H>);
  static_assert(std::convertible_to<double, H>);
  static_assert(std::convertible_to<int, H>);
  static_assert(std::convertible_to<H, float>);
  static_assert(!std::is_arithmetic_v<H>);
  const H zero{};
  CHECK(zero.bits() == 0);
  CHECK(!std::signbit(static_cast<float>(zero)));
}

TEST_CASE("conversions are usable in constant expressions") {
  static_assert(float16(1.0f).bits() == 0x3c00);
  static_assert(float16(-2.0f).bits() == 0xc000);
  static_assert(static_cast<float>(float16::from_bits(0x3555)) == 0.333251953125f);
  static_assert(static_cast<float>(float16::from_bits(0x0001)) == 0x1p-24f);
  static_assert(float16(std::numeric_limits<float>::infinity()).bits() == 0x7c00);
  static_assert(float16(std::numeric_limits<float>::quiet_NaN()).bits() == 0x7e00);
  static_assert(bfloat16(1.0f).bits() == 0x3f80);
  static_assert(static_cast<float>(bfloat16::from_bits(0x4049)) == 3.140625f);
  static_assert((float16(1.5f) + float16(2.25f)).bits() == float16(3.75f).bits());
  static_assert(float16(1.0f) < float16(2.0f));
  CHECK(true);
}

TEST_CASE_TEMPLATE("every bit pattern converts to float exactly", H, float16, bfloat16) {
  constexpr format f = format_of<H>();
  const int mantissa_bits = f.digits - 1;
  int mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double expected = reference_value(bits, f);
    const float got = H::from_bits(bits);
    bool ok = same_value(got, expected);
    if (std::isnan(expected)) {
      // The payload moves to the top of float's significand unchanged.
      const std::uint32_t payload = bits & ((1u << mantissa_bits) - 1u);
      const std::uint32_t want =
          ((bits & 0x8000u) << 16) | 0x7f800000u | (payload << (23 - mantissa_bits));
      ok = ok && std::bit_cast<std::uint32_t>(got) == want;
    }
    if (!ok && ++mismatches <= 5)
      FAIL_CHECK("pattern " << b << ": got " << got << ", expected " << expected);
  }
  CHECK(mismatches == 0);
}

// float -> half -> float -> half is the identity on every pattern except that
// a signalling NaN comes back quiet (quiet bit set, rest of payload kept).
TEST_CASE_TEMPLATE("every bit pattern round-trips through float", H, float16, bfloat16) {
  int mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = H::from_bits(bits);
    const std::uint16_t back = H(f).bits();
    const std::uint16_t want =
        is_nan_bits<H>(bits) ? static_cast<std::uint16_t>(bits | quiet_bit<H>()) : bits;
    if (back != want && ++mismatches <= 5) FAIL_CHECK("pattern " << b << " came back as " << back);
  }
  CHECK(mismatches == 0);
}

// Midpoints between neighbours are the ties; one float step either side must
// go to the nearer neighbour. Every finite pattern is visited, both signs.
TEST_CASE_TEMPLATE("rounding from float is to nearest, ties to even, at every tie", H, float16,
                   bfloat16) {
  constexpr format fmt = format_of<H>();
  const double top = largest_finite(fmt);
  int mismatches = 0;
  int checked = 0;
  for (std::uint32_t b = 0; b < 0x7fffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double lo = reference_value(bits, fmt);
    if (!std::isfinite(lo)) continue;
    // For the largest finite value the "next" one is the power of two that
    // rounding would produce before overflowing.
    const double hi = lo == top ? std::ldexp(1.0, std::ilogb(top) + 1)
                                : reference_value(static_cast<std::uint16_t>(bits + 1), fmt);
    const auto mid = static_cast<float>((lo + hi) / 2);  // exact: 1 more bit than H
    REQUIRE(static_cast<double>(mid) == (lo + hi) / 2);
    const float probes[] = {mid, std::nextafter(mid, 0.0f),
                            std::nextafter(mid, std::numeric_limits<float>::infinity())};
    for (float p : probes) {
      for (float x : {p, -p}) {
        ++checked;
        const double expected = reference_round(x, fmt);
        const float got = H(x);
        if (!same_value(got, expected) && ++mismatches <= 5)
          FAIL_CHECK("rounding " << x << ": got " << got << ", expected " << expected);
      }
    }
    // The tie itself goes to the neighbour with an even significand (above
    // the largest finite value that neighbour is inf, also even).
    const std::uint16_t got = H(mid).bits();
    const std::uint16_t want = (bits & 1u) == 0 ? bits : static_cast<std::uint16_t>(bits + 1);
    if (got != want && ++mismatches <= 5)
      FAIL_CHECK("tie above pattern " << b << " went to " << got);
  }
  CHECK(checked > 100000);
  CHECK(mismatches == 0);
}

TEST_CASE_TEMPLATE("rounding from float matches the reference on a spread of floats", H, float16,
                   bfloat16) {
  constexpr format fmt = format_of<H>();
  int mismatches = 0;
  // A stride co-prime with 2^32 visits every exponent and many mantissas.
  for (std::uint64_t b = 0; b <= 0xffffffffull; b += 4099) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(b));
    const double expected = reference_round(x, fmt);
    const float got = H(x);
    if (!same_value(got, expected) && ++mismatches <= 5)
      FAIL_CHECK("rounding " << x << " (bits " << b << "): got " << got << ", expected "
                             << expected);
  }
  CHECK(mismatches == 0);
}

TEST_CASE("float16 rounding at the edges") {
  // Ties to even around 1 (ulp 2^-10).
  CHECK(float16(1.0f + 0x1p-11f).bits() == 0x3c00);
  CHECK(float16(1.0f + 3 * 0x1p-11f).bits() == 0x3c02);
  CHECK(float16(1.0f + 0x1p-11f + 0x1p-20f).bits() == 0x3c01);
  // Largest finite and overflow: 65520 is the tie between 65504 and 2^16.
  CHECK(float16(65504.0f).bits() == 0x7bff);
  CHECK(float16(65519.996f).bits() == 0x7bff);
  CHECK(float16(65520.0f).bits() == 0x7c00);
  CHECK(float16(-65520.0f).bits() == 0xfc00);
  CHECK(float16(1e10f).bits() == 0x7c00);
  CHECK(float16(std::numeric_limits<float>::max()).bits() == 0x7c00);
  CHECK(float16(-std::numeric_limits<float>::infinity()).bits() == 0xfc00);
  // Subnormals: step 2^-24, smallest normal 2^-14.
  CHECK(float16(0x1p-24f).bits() == 0x0001);
  CHECK(float16(0x1p-25f).bits() == 0x0000);  // tie, to even (zero)
  CHECK(float16(-0x1p-25f).bits() == 0x8000);
  CHECK(float16(0x1.000002p-25f).bits() == 0x0001);
  CHECK(float16(3 * 0x1p-25f).bits() == 0x0002);  // tie between 1 and 2 steps
  CHECK(float16(5 * 0x1p-25f).bits() == 0x0002);  // tie between 2 and 3 steps
  CHECK(float16(1023 * 0x1p-24f).bits() == 0x03ff);
  CHECK(float16(1023.5f * 0x1p-24f).bits() == 0x0400);  // rounds up into the normals
  CHECK(float16(0x1p-14f).bits() == 0x0400);
  CHECK(float16(std::numeric_limits<float>::denorm_min()).bits() == 0x0000);
  CHECK(float16(-0.0f).bits() == 0x8000);
  CHECK(float16(0.0f).bits() == 0x0000);
  // NaNs stay NaN whatever the payload, sign kept.
  CHECK(float16(std::bit_cast<float>(0x7f800001u)).bits() == 0x7e00);
  CHECK(float16(std::bit_cast<float>(0xff800001u)).bits() == 0xfe00);
  CHECK(float16(std::bit_cast<float>(0x7fffffffu)).bits() == 0x7fff);
  CHECK(std::isnan(static_cast<float>(float16(std::numeric_limits<float>::signaling_NaN()))));
}

TEST_CASE("bfloat16 rounding at the edges") {
  CHECK(bfloat16(1.0f + 0x1p-8f).bits() == 0x3f80);  // tie, to even
  CHECK(bfloat16(1.0f + 3 * 0x1p-8f).bits() == 0x3f82);
  CHECK(bfloat16(1.0f + 0x1p-8f + 0x1p-23f).bits() == 0x3f81);
  CHECK(bfloat16(std::bit_cast<float>(0x7f7f0000u)).bits() == 0x7f7f);
  CHECK(bfloat16(std::bit_cast<float>(0x7f7f7fffu)).bits() == 0x7f7f);
  CHECK(bfloat16(std::bit_cast<float>(0x7f7f8000u)).bits() == 0x7f80);  // tie, to even: inf
  CHECK(bfloat16(std::numeric_limits<float>::max()).bits() == 0x7f80);
  CHECK(bfloat16(-std::numeric_limits<float>::max()).bits() == 0xff80);
  CHECK(bfloat16(std::numeric_limits<float>::denorm_min()).bits() == 0x0000);
  CHECK(bfloat16(std::bit_cast<float>(0x00008000u)).bits() == 0x0000);  // tie, to even
  CHECK(bfloat16(std::bit_cast<float>(0x00018000u)).bits() == 0x0002);  // tie, to even
  CHECK(bfloat16(std::bit_cast<float>(0x007fffffu)).bits() == 0x0080);  // up into the normals
  CHECK(bfloat16(-0.0f).bits() == 0x8000);
  // NaNs whose payload sits in the dropped bits, or whose rounding would
  // carry: a naive x + 0x7fff turns these into inf or -0.
  CHECK(bfloat16(std::bit_cast<float>(0x7f800001u)).bits() == 0x7fc0);
  CHECK(bfloat16(std::bit_cast<float>(0xff800001u)).bits() == 0xffc0);
  CHECK(bfloat16(std::bit_cast<float>(0x7fffffffu)).bits() == 0x7fff);
  CHECK(bfloat16(std::bit_cast<float>(0x7fc00000u)).bits() == 0x7fc0);
  CHECK(std::isnan(static_cast<float>(bfloat16(std::numeric_limits<float>::signaling_NaN()))));
}

TEST_CASE_TEMPLATE("construction from double and int goes through float", H, float16, bfloat16) {
  CHECK(H(0.1).bits() == H(0.1f).bits());
  CHECK(H(3).bits() == H(3.0f).bits());
  CHECK(H(-7).bits() == H(-7.0f).bits());
  CHECK(H(std::int64_t{1} << 40).bits() == H(0x1p40f).bits());
  CHECK(H(1e300).bits() == H(std::numeric_limits<float>::infinity()).bits());
  const double d = 2.5;
  const H braced{d};  // no narrowing error: the constructor takes any arithmetic type
  CHECK(static_cast<float>(braced) == 2.5f);
}

TEST_CASE("float16 and bfloat16 convert into each other explicitly, rounding once") {
  static_assert(!std::convertible_to<float16, bfloat16>);
  static_assert(!std::convertible_to<bfloat16, float16>);
  static_assert(std::constructible_from<float16, bfloat16>);
  static_assert(std::constructible_from<bfloat16, float16>);
  int mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float from_half = float16::from_bits(bits);
    const float from_bf16 = bfloat16::from_bits(bits);
    const double to_bf16 = reference_round(from_half, bf16_format);
    const double to_half = reference_round(from_bf16, half_format);
    if (!same_value(static_cast<float>(bfloat16(float16::from_bits(bits))), to_bf16) ||
        !same_value(static_cast<float>(float16(bfloat16::from_bits(bits))), to_half))
      if (++mismatches <= 5) FAIL_CHECK("pattern " << b);
  }
  CHECK(mismatches == 0);
  CHECK(float16(bfloat16(1e10f)).bits() == 0x7c00);  // out of float16's range
}

TEST_CASE_TEMPLATE("arithmetic is computed in float and rounded once", H, float16, bfloat16) {
  constexpr format fmt = format_of<H>();
  static_assert(std::same_as<decltype(H{} + H{}), H>);
  static_assert(std::same_as<decltype(H{} * 2), H>);
  static_assert(std::same_as<decltype(2 * H{}), H>);
  static_assert(std::same_as<decltype(H{} + 1.0f), float>);
  static_assert(std::same_as<decltype(1.0f - H{}), float>);
  static_assert(std::same_as<decltype(H{} / 1.0), double>);
  static_assert(std::same_as<decltype(-H{}), H>);
  static_assert(std::same_as<decltype(float16{} + bfloat16{}), float>);

  // Exhaustive over a grid of operands, against rounding the exact result.
  int mismatches = 0;
  for (std::uint32_t i = 0; i <= 0xffff; i += 97) {
    for (std::uint32_t j = 0; j <= 0xffff; j += 89) {
      const H a = H::from_bits(static_cast<std::uint16_t>(i));
      const H b = H::from_bits(static_cast<std::uint16_t>(j));
      const double x = static_cast<float>(a);
      const double y = static_cast<float>(b);
      // Sums and products of two halves are exact in double.
      const double expected[] = {reference_round(x + y, fmt), reference_round(x - y, fmt),
                                 reference_round(x * y, fmt)};
      const H got[] = {a + b, a - b, a * b};
      for (int k = 0; k < 3; ++k)
        if (!same_value(static_cast<float>(got[k]), expected[k]) && ++mismatches <= 5)
          FAIL_CHECK("op " << k << " on patterns " << i << ", " << j);
    }
  }
  CHECK(mismatches == 0);

  CHECK(static_cast<float>(H(1.5f) + H(2.25f)) == 3.75f);
  CHECK(static_cast<float>(H(1.5f) - H(2.25f)) == -0.75f);
  CHECK(static_cast<float>(H(1.5f) * H(-2.0f)) == -3.0f);
  CHECK(static_cast<float>(H(3.0f) / H(4.0f)) == 0.75f);
  CHECK(static_cast<float>(H(1.0f) / H(3.0f)) ==
        static_cast<float>(reference_round(1.0 / 3.0, fmt)));
  CHECK(static_cast<float>(H(1.5f) * 2) == 3.0f);
  CHECK(H(1.5f) + 0.25f == 1.75f);
  CHECK(H(1.5f) + 0.1 == 1.5 + 0.1);
  CHECK(std::isinf(static_cast<float>(H(1.0f) / H(0.0f))));
  CHECK(std::isnan(static_cast<float>(H(0.0f) / H(0.0f))));

  H h = 1.0f;
  h += H(2.0f);
  CHECK(h == 3.0f);
  h -= 0.5f;
  CHECK(h == 2.5f);
  h *= 4;
  CHECK(h == 10.0f);
  h /= 4.0;
  CHECK(h == 2.5f);

  // Negation is exact, including zeros and NaN payloads.
  CHECK((-H(0.0f)).bits() == 0x8000);
  CHECK((-H::from_bits(0x7f81)).bits() == 0xff81);
  CHECK((+H(2.0f)).bits() == H(2.0f).bits());
}

TEST_CASE_TEMPLATE("comparisons follow float semantics", H, float16, bfloat16) {
  const H one(1.0f);
  const H two(2.0f);
  const H nan = std::numeric_limits<H>::quiet_NaN();
  CHECK(one < two);
  CHECK(one <= two);
  CHECK(two > one);
  CHECK(two >= one);
  CHECK(one != two);
  CHECK(one == H(1.0f));
  CHECK(H(0.0f) == H(-0.0f));
  CHECK(H(0.0f).bits() != H(-0.0f).bits());
  CHECK_FALSE(nan == nan);
  CHECK(nan != nan);
  CHECK_FALSE(nan < one);
  CHECK_FALSE(nan > one);
  CHECK_FALSE(nan <= nan);
  // Mixed with built-in types, both orders.
  CHECK(one == 1);
  CHECK(1 == one);
  CHECK(one == 1.0f);
  CHECK(1.0 == one);
  CHECK(one < 1.5f);
  CHECK(1.5 > one);
  CHECK(0 < one);
  CHECK(std::isnan(nan));
  CHECK(std::isinf(std::numeric_limits<H>::infinity()));
}

TEST_CASE("numeric_limits<float16>") {
  using L = std::numeric_limits<float16>;
  static_assert(L::is_specialized && L::is_signed && !L::is_integer && !L::is_exact);
  static_assert(L::has_infinity && L::has_quiet_NaN && L::has_signaling_NaN);
  static_assert(L::digits == 11 && L::radix == 2);
  static_assert(L::min_exponent == -13 && L::max_exponent == 16);
  static_assert(L::is_iec559);
  CHECK(static_cast<float>((L::min)()) == 0x1p-14f);
  CHECK(static_cast<float>((L::max)()) == 65504.0f);
  CHECK(static_cast<float>(L::lowest()) == -65504.0f);
  CHECK(static_cast<float>(L::epsilon()) == 0x1p-10f);
  CHECK(static_cast<float>(L::round_error()) == 0.5f);
  CHECK(static_cast<float>(L::denorm_min()) == 0x1p-24f);
  CHECK(std::isinf(static_cast<float>(L::infinity())));
  CHECK(static_cast<float>(L::infinity()) > 0);
  CHECK(std::isnan(static_cast<float>(L::quiet_NaN())));
  CHECK(std::isnan(static_cast<float>(L::signaling_NaN())));
  // epsilon is the gap between 1 and the next value.
  CHECK(float16(1.0f) + L::epsilon() == float16::from_bits(0x3c01));
  // digits10: decimal digits that survive a round trip; max_digits10: needed
  // to tell every value apart. The classic formulas:
  CHECK(L::digits10 == static_cast<int>(std::floor((L::digits - 1) * std::log10(2.0))));
  CHECK(L::max_digits10 == static_cast<int>(std::ceil(1 + L::digits * std::log10(2.0))));
  CHECK(L::min_exponent10 == static_cast<int>(std::ceil(std::log10(0x1p-14))));
  CHECK(L::max_exponent10 == static_cast<int>(std::floor(std::log10(65504.0))));
  // cv-qualified versions forward to it.
  CHECK(static_cast<float>((std::numeric_limits<const float16>::max)()) == 65504.0f);
}

TEST_CASE("numeric_limits<bfloat16>") {
  using L = std::numeric_limits<bfloat16>;
  static_assert(L::is_specialized && L::is_signed && !L::is_integer && !L::is_exact);
  static_assert(L::digits == 8 && L::radix == 2);
  // Same exponent range as float.
  static_assert(L::min_exponent == std::numeric_limits<float>::min_exponent);
  static_assert(L::max_exponent == std::numeric_limits<float>::max_exponent);
  static_assert(L::min_exponent10 == std::numeric_limits<float>::min_exponent10);
  static_assert(L::max_exponent10 == std::numeric_limits<float>::max_exponent10);
  CHECK(static_cast<float>((L::min)()) == (std::numeric_limits<float>::min)());
  CHECK(static_cast<double>((L::max)()) == std::ldexp(255.0, 127 - 7));
  CHECK(static_cast<double>(L::lowest()) == -std::ldexp(255.0, 127 - 7));
  CHECK(static_cast<float>(L::epsilon()) == 0x1p-7f);
  CHECK(static_cast<float>(L::round_error()) == 0.5f);
  CHECK(static_cast<float>(L::denorm_min()) == 0x1p-133f);
  CHECK(std::isinf(static_cast<float>(L::infinity())));
  CHECK(std::isnan(static_cast<float>(L::quiet_NaN())));
  CHECK(std::isnan(static_cast<float>(L::signaling_NaN())));
  CHECK(bfloat16(1.0f) + L::epsilon() == bfloat16::from_bits(0x3f81));
  CHECK(L::digits10 == static_cast<int>(std::floor((L::digits - 1) * std::log10(2.0))));
  CHECK(L::max_digits10 == static_cast<int>(std::ceil(1 + L::digits * std::log10(2.0))));
}
