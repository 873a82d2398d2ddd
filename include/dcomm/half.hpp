// 16-bit floating-point element types for the CPU side of dcomm: float16
// (IEEE 754 binary16) and bfloat16 (the top half of a binary32).
//
// They store bits and do all arithmetic in float. We do not use the
// compilers' _Float16 / __bf16 because g++ 12 and clang 14 disagree on where
// those exist and how they promote, and a reduction must give the same bits
// whichever compiler built each rank.
//
// Conversions:
//  * to float is exact for every bit pattern (NaN payloads are kept);
//  * from float rounds to nearest, ties to even; too large values become
//    +-inf, tiny ones subnormals or +-0; NaN stays NaN and comes back quiet
//    (a signalling NaN gets its quiet bit set, the rest of the payload that
//    fits is kept), so float -> half -> float -> half is the identity on
//    every pattern except signalling NaNs;
//  * from double or an integer goes through float. That is two roundings for
//    a double, which can differ from rounding the double directly in rare
//    ties; collectives only ever convert from float, so we keep one path.
//
// Arithmetic on two halves gives a half; it is computed in float and rounded
// once. For +, -, *, / this equals the correctly rounded half result, since
// float has more than 2p+2 significand bits (p = 11 or 8), so the double
// rounding cannot bite. Mixed with a floating-point type the result has the
// wider type (float16 + float is a float); mixed with an integer it stays a
// half (2 * h is a float16).
#pragma once

#include <bit>
#include <compare>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace dcomm {

namespace detail {

constexpr std::uint16_t float_to_half_bits(float value) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;

  if (ax > 0x7f800000u)  // NaN: force the quiet bit so it cannot become inf
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  // 65520 is halfway between 65504 (max, odd significand) and 65536: ties to
  // even round it up, so everything from there on is inf.
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);

  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half or zero
    // 2^-25 is the tie between 0 and the smallest subnormal; even is 0.
    if (ax <= 0x33000000u) return sign;
    const std::uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    // The value in units of 2^-24 (the subnormal step) is mantissa >> shift.
    const std::uint32_t shift = 126u - (ax >> 23);  // 14..24
    std::uint32_t r = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t half_step = 1u << (shift - 1u);
    if (rest > half_step || (rest == half_step && (r & 1u) != 0)) ++r;
    // r == 0x400 is the smallest normal, which is exactly its bit pattern.
    return static_cast<std::uint16_t>(sign | r);
  }

  // Normal: rebias the exponent (127 -> 15) and drop 13 significand bits. A
  // carry out of the significand correctly bumps the exponent; it cannot
  // reach inf because of the check above.
  std::uint32_t r = (ax - 0x38000000u) >> 13;
  const std::uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u) != 0)) ++r;
  return static_cast<std::uint16_t>(sign | r);
}

constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(magnitude) | sign);
  }
  if (exponent == 0x1f)  // inf or NaN, payload kept
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

constexpr std::uint16_t float_to_bfloat16_bits(float value) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  // Rounding a NaN would carry into the exponent (0x7f800001 -> inf,
  // 0x7fffffff -> -0), so NaNs are truncated and made quiet instead.
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  // Round to nearest even on the dropped 16 bits; a carry may ripple into the
  // exponent and up to inf, which is the right answer for huge values.
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

template <class T>
concept half_operand = std::is_arithmetic_v<T>;

// The result of half OP a: the wider floating type, or the half itself when
// the other side is an integer.
template <class Half, class A>
using half_mixed_result_t =
    std::conditional_t<std::is_floating_point_v<A>, std::common_type_t<float, A>, Half>;

// Arithmetic and comparisons shared by float16 and bfloat16, as hidden
// friends so they are found only through ADL and never hijack other types.
// Each mixed overload exists because with an implicit operator float and an
// implicit constructor from float, `h + 1.0f` would otherwise be ambiguous
// between the half operator and the built-in float one.
template <class Half>
struct half_arithmetic {
// One definition for the four operators so that they cannot drift apart.
#define DCOMM_DETAIL_HALF_BINARY_OP(OP)                                             \
  friend constexpr Half operator OP(Half a, Half b) noexcept {                      \
    return Half(static_cast<float>(a) OP static_cast<float>(b));                    \
  }                                                                                 \
  template <half_operand A>                                                         \
  friend constexpr half_mixed_result_t<Half, A> operator OP(Half a, A b) noexcept { \
    using result = half_mixed_result_t<Half, A>;                                    \
    if constexpr (std::is_floating_point_v<A>)                                      \
      return static_cast<result>(static_cast<float>(a)) OP static_cast<result>(b);  \
    else                                                                            \
      return Half(static_cast<float>(a) OP static_cast<float>(b));                  \
  }                                                                                 \
  template <half_operand A>                                                         \
  friend constexpr half_mixed_result_t<Half, A> operator OP(A a, Half b) noexcept { \
    using result = half_mixed_result_t<Half, A>;                                    \
    if constexpr (std::is_floating_point_v<A>)                                      \
      return static_cast<result>(a) OP static_cast<result>(static_cast<float>(b));  \
    else                                                                            \
      return Half(static_cast<float>(a) OP static_cast<float>(b));                  \
  }                                                                                 \
  constexpr Half& operator OP##=(float b) noexcept {                                \
    Half& self = static_cast<Half&>(*this);                                         \
    self = Half(static_cast<float>(self) OP b);                                     \
    return self;                                                                    \
  }

  DCOMM_DETAIL_HALF_BINARY_OP(+)
  DCOMM_DETAIL_HALF_BINARY_OP(-)
  DCOMM_DETAIL_HALF_BINARY_OP(*)
  DCOMM_DETAIL_HALF_BINARY_OP(/)
#undef DCOMM_DETAIL_HALF_BINARY_OP

  // Negation flips the sign bit only, so it is exact and keeps NaN payloads.
  friend constexpr Half operator-(Half a) noexcept {
    return Half::from_bits(static_cast<std::uint16_t>(a.bits() ^ 0x8000u));
  }
  friend constexpr Half operator+(Half a) noexcept {
    return a;
  }

  // Compared as floats: -0 == +0, NaN is unordered with everything.
  friend constexpr bool operator==(Half a, Half b) noexcept {
    return static_cast<float>(a) == static_cast<float>(b);
  }
  friend constexpr std::partial_ordering operator<=>(Half a, Half b) noexcept {
    return static_cast<float>(a) <=> static_cast<float>(b);
  }
  template <half_operand A>
  friend constexpr bool operator==(Half a, A b) noexcept {
    using common = std::common_type_t<float, A>;
    return static_cast<common>(static_cast<float>(a)) == static_cast<common>(b);
  }
  template <half_operand A>
  friend constexpr std::partial_ordering operator<=>(Half a, A b) noexcept {
    using common = std::common_type_t<float, A>;
    return static_cast<common>(static_cast<float>(a)) <=> static_cast<common>(b);
  }
};

}  // namespace detail

class bfloat16;

// IEEE 754 binary16: 1 sign, 5 exponent, 10 significand bits.
class float16 : public detail::half_arithmetic<float16> {
 public:
  // Trivial so that arrays of float16 stay trivially copyable and cheap;
  // value-initialisation (float16{}) gives +0.
  float16() = default;

  // Implicit both ways so that float16 drops into code written for float.
  template <detail::half_operand A>
  constexpr float16(A value) noexcept
      : bits_(detail::float_to_half_bits(static_cast<float>(value))) {}
  // Explicit: it rounds (and may overflow), so it should be visible.
  constexpr explicit float16(bfloat16 value) noexcept;

  constexpr operator float() const noexcept { return detail::half_bits_to_float(bits_); }

  static constexpr float16 from_bits(std::uint16_t bits) noexcept {
    float16 h{};
    h.bits_ = bits;
    return h;
  }
  constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

// bfloat16: the upper 16 bits of a binary32 (1 sign, 8 exponent, 7
// significand bits), so it has float's range with less precision.
class bfloat16 : public detail::half_arithmetic<bfloat16> {
 public:
  bfloat16() = default;

  template <detail::half_operand A>
  constexpr bfloat16(A value) noexcept
      : bits_(detail::float_to_bfloat16_bits(static_cast<float>(value))) {}
  constexpr explicit bfloat16(float16 value) noexcept
      : bits_(detail::float_to_bfloat16_bits(static_cast<float>(value))) {}

  constexpr operator float() const noexcept { return detail::bfloat16_bits_to_float(bits_); }

  static constexpr bfloat16 from_bits(std::uint16_t bits) noexcept {
    bfloat16 b{};
    b.bits_ = bits;
    return b;
  }
  constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

// Exact to float, then rounded once.
constexpr float16::float16(bfloat16 value) noexcept
    : bits_(detail::float_to_half_bits(static_cast<float>(value))) {}

static_assert(sizeof(float16) == 2 && sizeof(bfloat16) == 2);
static_assert(std::is_trivially_copyable_v<float16> && std::is_trivially_copyable_v<bfloat16>);
static_assert(std::is_standard_layout_v<float16> && std::is_standard_layout_v<bfloat16>);

}  // namespace dcomm

// min and max are parenthesised so that a function-like min/max macro
// (windows.h) cannot expand them.
template <>
struct std::numeric_limits<dcomm::float16> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr std::float_denorm_style has_denorm = std::denorm_present;
  static constexpr bool has_denorm_loss = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr bool is_iec559 = true;
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr int digits = 11;
  static constexpr int digits10 = 3;
  static constexpr int max_digits10 = 5;
  static constexpr int radix = 2;
  static constexpr int min_exponent = -13;
  static constexpr int min_exponent10 = -4;
  static constexpr int max_exponent = 16;
  static constexpr int max_exponent10 = 4;
  static constexpr bool traps = false;
  static constexpr bool tinyness_before = false;

  static constexpr dcomm::float16(min)() noexcept { return dcomm::float16::from_bits(0x0400); }
  static constexpr dcomm::float16 lowest() noexcept { return dcomm::float16::from_bits(0xfbff); }
  static constexpr dcomm::float16(max)() noexcept { return dcomm::float16::from_bits(0x7bff); }
  static constexpr dcomm::float16 epsilon() noexcept { return dcomm::float16::from_bits(0x1400); }
  static constexpr dcomm::float16 round_error() noexcept {
    return dcomm::float16::from_bits(0x3800);
  }
  static constexpr dcomm::float16 infinity() noexcept { return dcomm::float16::from_bits(0x7c00); }
  static constexpr dcomm::float16 quiet_NaN() noexcept { return dcomm::float16::from_bits(0x7e00); }
  static constexpr dcomm::float16 signaling_NaN() noexcept {
    return dcomm::float16::from_bits(0x7d00);
  }
  static constexpr dcomm::float16 denorm_min() noexcept {
    return dcomm::float16::from_bits(0x0001);
  }
};

// bfloat16 is not an IEEE 754 interchange format, hence is_iec559 = false,
// although it follows the same rules for zeros, subnormals, inf and NaN.
template <>
struct std::numeric_limits<dcomm::bfloat16> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr std::float_denorm_style has_denorm = std::denorm_present;
  static constexpr bool has_denorm_loss = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr bool is_iec559 = false;
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr int digits = 8;
  static constexpr int digits10 = 2;
  static constexpr int max_digits10 = 4;
  static constexpr int radix = 2;
  static constexpr int min_exponent = -125;
  static constexpr int min_exponent10 = -37;
  static constexpr int max_exponent = 128;
  static constexpr int max_exponent10 = 38;
  static constexpr bool traps = false;
  static constexpr bool tinyness_before = false;

  static constexpr dcomm::bfloat16(min)() noexcept { return dcomm::bfloat16::from_bits(0x0080); }
  static constexpr dcomm::bfloat16 lowest() noexcept { return dcomm::bfloat16::from_bits(0xff7f); }
  static constexpr dcomm::bfloat16(max)() noexcept { return dcomm::bfloat16::from_bits(0x7f7f); }
  static constexpr dcomm::bfloat16 epsilon() noexcept { return dcomm::bfloat16::from_bits(0x3c00); }
  static constexpr dcomm::bfloat16 round_error() noexcept {
    return dcomm::bfloat16::from_bits(0x3f00);
  }
  static constexpr dcomm::bfloat16 infinity() noexcept {
    return dcomm::bfloat16::from_bits(0x7f80);
  }
  static constexpr dcomm::bfloat16 quiet_NaN() noexcept {
    return dcomm::bfloat16::from_bits(0x7fc0);
  }
  static constexpr dcomm::bfloat16 signaling_NaN() noexcept {
    return dcomm::bfloat16::from_bits(0x7fa0);
  }
  static constexpr dcomm::bfloat16 denorm_min() noexcept {
    return dcomm::bfloat16::from_bits(0x0001);
  }
};
