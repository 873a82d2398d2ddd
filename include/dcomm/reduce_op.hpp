// Reduction operators: the tags users pass to collectives, which ops are
// allowed for which element type (at compile time for typed tensors, at run
// time for runtime-typed ones), and the CPU kernels that combine two buffers.
//
// Semantics of the builtin combines, per element:
//  * sum, prod: signed integers wrap around modulo 2^bits, as unsigned
//    arithmetic does (computed in unsigned to avoid signed-overflow UB), so
//    every rank and every backend get the same bits;
//  * float16 / bfloat16 are converted to float, combined, and rounded once;
//  * min, max: a NaN on either side wins (like torch.minimum/maximum), so the
//    result does not depend on the order in which ranks are combined;
//  * avg combines as sum; dividing by the world size is done once at the
//    end by the backend (divide_by);
//  * premul_sum(f) (NCCL's pre-multiplied sum: the sum of f * x over the
//    ranks) combines as sum, and the backend multiplies by f once at the
//    end (scale_by), which rounds like f * sum(x); floating types only;
//  * band, bor, bxor: integral types only.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <dcomm/dtype.hpp>
#include <dcomm/error.hpp>
#include <dcomm/half.hpp>

namespace dcomm {

// Objects rather than an enum so that the op is part of the type and misuse
// (band on floats) fails at compile time. min and max are variables, so a
// function-like min/max macro does not expand them, and std::min is untouched.
struct sum_t {};
struct prod_t {};
struct min_t {};
struct max_t {};
struct avg_t {};
struct band_t {};
struct bor_t {};
struct bxor_t {};
inline constexpr sum_t sum{};
inline constexpr prod_t prod{};
inline constexpr min_t min{};
inline constexpr max_t max{};
inline constexpr avg_t avg{};
inline constexpr band_t band{};
inline constexpr bor_t bor{};
inline constexpr bxor_t bxor{};

// The sum of factor * x over the ranks (NCCL's ncclRedOpCreatePreMulSum),
// e.g. premul_sum(1.0 / world) for an average with a divisor of your own.
struct premul_sum_t {
  double factor = 1.0;
};
constexpr premul_sum_t premul_sum(double factor) noexcept {
  return {factor};
}

// The numeric values may travel between ranks: append, never reorder.
enum class reduce_kind : std::uint8_t {
  sum,
  prod,
  min,
  max,
  avg,
  band,
  bor,
  bxor,
  custom,
  premul_sum
};

constexpr std::string_view name(reduce_kind k) noexcept {
  switch (k) {
    case reduce_kind::sum:
      return "sum";
    case reduce_kind::prod:
      return "prod";
    case reduce_kind::min:
      return "min";
    case reduce_kind::max:
      return "max";
    case reduce_kind::avg:
      return "avg";
    case reduce_kind::band:
      return "band";
    case reduce_kind::bor:
      return "bor";
    case reduce_kind::bxor:
      return "bxor";
    case reduce_kind::custom:
      return "custom";
    case reduce_kind::premul_sum:
      return "premul_sum";
  }
  return "unknown";
}

namespace detail {
template <class T>
inline constexpr bool is_half = std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;

template <class Op>
inline constexpr reduce_kind reduce_kind_of = reduce_kind::custom;
template <>
inline constexpr reduce_kind reduce_kind_of<sum_t> = reduce_kind::sum;
template <>
inline constexpr reduce_kind reduce_kind_of<prod_t> = reduce_kind::prod;
template <>
inline constexpr reduce_kind reduce_kind_of<min_t> = reduce_kind::min;
template <>
inline constexpr reduce_kind reduce_kind_of<max_t> = reduce_kind::max;
template <>
inline constexpr reduce_kind reduce_kind_of<avg_t> = reduce_kind::avg;
template <>
inline constexpr reduce_kind reduce_kind_of<band_t> = reduce_kind::band;
template <>
inline constexpr reduce_kind reduce_kind_of<bor_t> = reduce_kind::bor;
template <>
inline constexpr reduce_kind reduce_kind_of<bxor_t> = reduce_kind::bxor;
template <>
inline constexpr reduce_kind reduce_kind_of<premul_sum_t> = reduce_kind::premul_sum;

// Combined as a sum; finished once at the end (a division, a scaling).
constexpr bool is_finished_sum(reduce_kind k) noexcept {
  return k == reduce_kind::avg || k == reduce_kind::premul_sum;
}

constexpr bool is_bitwise(reduce_kind k) noexcept {
  return k == reduce_kind::band || k == reduce_kind::bor || k == reduce_kind::bxor;
}

// Spelled out rather than via dtype_of_v so that asking about a non-element
// type does not fire dtype_of's static_assert.
template <class T>
inline constexpr bool is_floating_element =
    std::is_same_v<T, float16> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float> ||
    std::is_same_v<T, double>;

template <class Op, class T>
concept custom_op_for = std::invocable<const Op&, T, T> &&
    std::convertible_to<std::invoke_result_t<const Op&, T, T>, T>;
}  // namespace detail

// The builtin kind of Op (cv/ref ignored), or custom for anything else.
template <class Op>
inline constexpr reduce_kind reduce_kind_of_v = detail::reduce_kind_of<std::remove_cvref_t<Op>>;

// Op may reduce elements of type T (cv ignored).
template <class Op, class T>
concept reduce_op_for = element_type<T> &&
    (reduce_kind_of_v<Op> == reduce_kind::custom
         ? detail::custom_op_for<std::remove_cvref_t<Op>, std::remove_cv_t<T>>
     : detail::is_bitwise(reduce_kind_of_v<Op>)      ? is_integral(dtype_of_v<T>)
     : detail::is_finished_sum(reduce_kind_of_v<Op>) ? is_floating(dtype_of_v<T>)
                                                     : true);

// Compile-time check with a message that says what to do; use it where a
// collective accepts (Op, T) so the user sees this rather than a failed
// constraint.
template <class T, class Op>
constexpr void check_reduce_op() {
  if constexpr (!element_type<T>) {
    static_cast<void>(sizeof(dtype_of<T>));  // for its static_assert
  } else {
    constexpr reduce_kind k = reduce_kind_of_v<Op>;
    constexpr dtype t = dtype_of_v<T>;
    if constexpr (k == reduce_kind::custom) {
      static_assert(detail::custom_op_for<std::remove_cvref_t<Op>, std::remove_cv_t<T>>,
                    "dcomm: a custom reduce op must be callable as op(T, T) through a const "
                    "reference, returning something convertible to T");
    } else if constexpr (detail::is_bitwise(k)) {
      static_assert(is_integral(t),
                    "dcomm: bitwise reduce ops (band, bor, bxor) need an integral element type");
    } else if constexpr (k == reduce_kind::avg) {
      static_assert(is_floating(t),
                    "dcomm: avg needs a floating-point element type (use sum and divide for "
                    "integers)");
    } else if constexpr (k == reduce_kind::premul_sum) {
      static_assert(is_floating(t), "dcomm: premul_sum needs a floating-point element type");
    }
  }
}

// Run-time counterparts for runtime-typed tensors. custom is never supported
// here: a user functor needs the static element type (use visit_dtype).
constexpr bool supports(reduce_kind k, dtype t) noexcept {
  if (size_of(t) == 0) return false;  // not a dtype
  switch (k) {
    case reduce_kind::sum:
    case reduce_kind::prod:
    case reduce_kind::min:
    case reduce_kind::max:
      return true;
    case reduce_kind::avg:
    case reduce_kind::premul_sum:
      return is_floating(t);
    case reduce_kind::band:
    case reduce_kind::bor:
    case reduce_kind::bxor:
      return is_integral(t);
    case reduce_kind::custom:
      return false;
  }
  return false;
}

inline void check_reduce_op(reduce_kind k, dtype t) {
  if (supports(k, t)) return;
  std::string why;
  if (size_of(t) == 0)
    why = "dtype value " + std::to_string(static_cast<unsigned>(t)) + " is not a dcomm::dtype";
  else if (detail::is_bitwise(k))
    why = "bitwise reduce ops (band, bor, bxor) need an integral element type";
  else if (k == reduce_kind::avg)
    why = "avg needs a floating-point element type (use sum and divide for integers)";
  else if (k == reduce_kind::premul_sum)
    why = "premul_sum needs a floating-point element type";
  else if (k == reduce_kind::custom)
    why = "a custom op needs the static element type; dispatch with visit_dtype";
  else
    why = "reduce_kind value " + std::to_string(static_cast<unsigned>(k)) + " is unknown";
  throw_error(errc::invalid_argument,
              {.operation = "reduce op check",
               .detail = std::string(name(k)) + " on " + std::string(name(t)) + ": " + why});
}

namespace detail {

// Wrapping integer arithmetic: at least unsigned int, so that uint8_t does
// not promote to (signed) int and the operation is never UB. The conversion
// back to a signed type is modular since C++20.
template <class T>
using wrap_t = std::common_type_t<std::make_unsigned_t<T>, unsigned>;

template <class T>
constexpr T wrapping_add(T a, T b) noexcept {
  return static_cast<T>(
      static_cast<wrap_t<T>>(static_cast<wrap_t<T>>(a) + static_cast<wrap_t<T>>(b)));
}
template <class T>
constexpr T wrapping_mul(T a, T b) noexcept {
  return static_cast<T>(
      static_cast<wrap_t<T>>(static_cast<wrap_t<T>>(a) * static_cast<wrap_t<T>>(b)));
}

}  // namespace detail

namespace detail {

// op(a, b) for one element of a builtin or custom op, as the file's top
// comment says. The loops below inline it, so each still vectorises.
template <class Op, class T>
inline T combine_one(const Op& op, T x, T y) {
  constexpr reduce_kind k = reduce_kind_of_v<Op>;
  if constexpr (k == reduce_kind::custom) {
    return static_cast<T>(std::invoke(op, x, y));
  } else if constexpr (is_half<T>) {
    // Through float, rounding once per element; min/max pick an operand.
    const float a = static_cast<float>(x);
    const float b = static_cast<float>(y);
    if constexpr (k == reduce_kind::sum || is_finished_sum(k))
      return T(a + b);
    else if constexpr (k == reduce_kind::prod)
      return T(a * b);
    else if constexpr (k == reduce_kind::min)
      return (b < a || b != b) ? y : x;
    else
      return (b > a || b != b) ? y : x;
  } else if constexpr (std::is_floating_point_v<T>) {
    if constexpr (k == reduce_kind::sum || is_finished_sum(k))
      return x + y;
    else if constexpr (k == reduce_kind::prod)
      return x * y;
    else if constexpr (k == reduce_kind::min)
      return (y < x || y != y) ? y : x;
    else
      return (y > x || y != y) ? y : x;
  } else {
    if constexpr (k == reduce_kind::sum)
      return wrapping_add(x, y);
    else if constexpr (k == reduce_kind::prod)
      return wrapping_mul(x, y);
    else if constexpr (k == reduce_kind::min)
      return y < x ? y : x;
    else if constexpr (k == reduce_kind::max)
      return y > x ? y : x;
    else if constexpr (k == reduce_kind::band)
      return static_cast<T>(x & y);
    else if constexpr (k == reduce_kind::bor)
      return static_cast<T>(x | y);
    else
      return static_cast<T>(x ^ y);
  }
}

}  // namespace detail

// inout[i] = op(inout[i], in[i]) for i < n. The ranges must not overlap
// unless they are identical.
template <class Op, class T>
void reduce_into(const Op& op, T* inout, const std::type_identity_t<T>* in, std::size_t n) {
  check_reduce_op<T, Op>();
  if constexpr (reduce_op_for<Op, T>)
    for (std::size_t i = 0; i < n; ++i) inout[i] = detail::combine_one(op, inout[i], in[i]);
}

// out[i] = op(a[i], b[i]) for i < n: reduce_into without first copying a
// into out (one pass over memory fewer). out must not overlap a or b
// (reduce_into is the in-place form).
template <class Op, class T>
void reduce_to(const Op& op, T* out, const std::type_identity_t<T>* a,
               const std::type_identity_t<T>* b, std::size_t n) {
  check_reduce_op<T, Op>();
  if constexpr (reduce_op_for<Op, T>)
    for (std::size_t i = 0; i < n; ++i) out[i] = detail::combine_one(op, a[i], b[i]);
}

// The final step of avg: inout[i] /= world, rounded once (halves via float).
template <class T>
void divide_by(T* inout, std::size_t n, int world) {
  static_assert(detail::is_floating_element<T>,
                "dcomm: avg needs a floating-point element type (use sum and divide for "
                "integers)");
  if (world <= 0)
    throw_error(errc::invalid_argument,
                {.operation = "divide_by",
                 .detail = "world size must be positive, got " + std::to_string(world)});
  if constexpr (detail::is_half<T>) {
    const float w = static_cast<float>(world);
    for (std::size_t i = 0; i < n; ++i) inout[i] = T(static_cast<float>(inout[i]) / w);
  } else {
    const T w = static_cast<T>(world);
    for (std::size_t i = 0; i < n; ++i) inout[i] /= w;
  }
}

// The final step of premul_sum: inout[i] *= factor, rounded once.
template <class T>
void scale_by(T* inout, std::size_t n, double factor) {
  static_assert(detail::is_floating_element<T>, "dcomm: premul_sum needs a floating-point type");
  if constexpr (detail::is_half<T>) {
    const float f = static_cast<float>(factor);
    for (std::size_t i = 0; i < n; ++i) inout[i] = T(static_cast<float>(inout[i]) * f);
  } else {
    const T f = static_cast<T>(factor);
    for (std::size_t i = 0; i < n; ++i) inout[i] *= f;
  }
}

namespace detail {
template <class F>
void visit_reduce_kind(reduce_kind k, F&& f) {
  switch (k) {
    case reduce_kind::sum:
      return f(sum);
    case reduce_kind::prod:
      return f(prod);
    case reduce_kind::min:
      return f(dcomm::min);
    case reduce_kind::max:
      return f(dcomm::max);
    case reduce_kind::avg:
      return f(avg);
    case reduce_kind::band:
      return f(band);
    case reduce_kind::bor:
      return f(bor);
    case reduce_kind::bxor:
      return f(bxor);
    case reduce_kind::premul_sum:
      return f(premul_sum_t{});  // the combine is a sum; the factor comes at the end
    case reduce_kind::custom:
      break;
  }
}
}  // namespace detail

// Runtime-typed combine for the builtin ops: throws errc::invalid_argument
// (before touching memory) for a combination that supports() rejects.
inline void reduce_into(reduce_kind k, dtype t, void* inout, const void* in, std::size_t n) {
  check_reduce_op(k, t);
  visit_dtype(t, [&]<class T>(std::type_identity<T>) {
    detail::visit_reduce_kind(k, [&]<class Op>(const Op& op) {
      if constexpr (reduce_op_for<Op, T>)
        reduce_into(op, static_cast<T*>(inout), static_cast<const T*>(in), n);
    });
  });
}

// Runtime-typed reduce_to; throws like the runtime reduce_into.
inline void reduce_to(reduce_kind k, dtype t, void* out, const void* a, const void* b,
                      std::size_t n) {
  check_reduce_op(k, t);
  visit_dtype(t, [&]<class T>(std::type_identity<T>) {
    detail::visit_reduce_kind(k, [&]<class Op>(const Op& op) {
      if constexpr (reduce_op_for<Op, T>)
        reduce_to(op, static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n);
    });
  });
}

// Runtime-typed divide_by; throws errc::invalid_argument for a non-floating
// dtype.
inline void divide_by(dtype t, void* inout, std::size_t n, int world) {
  check_reduce_op(reduce_kind::avg, t);
  visit_dtype(t, [&]<class T>(std::type_identity<T>) {
    if constexpr (detail::is_floating_element<T>) divide_by(static_cast<T*>(inout), n, world);
  });
}

// Runtime-typed scale_by; throws errc::invalid_argument for a non-floating
// dtype.
inline void scale_by(dtype t, void* inout, std::size_t n, double factor) {
  check_reduce_op(reduce_kind::premul_sum, t);
  visit_dtype(t, [&]<class T>(std::type_identity<T>) {
    if constexpr (detail::is_floating_element<T>) scale_by(static_cast<T*>(inout), n, factor);
  });
}

}  // namespace dcomm
