// Element types that dcomm can move and reduce, as a runtime tag (dtype) and
// as the C++ types they stand for.
//
// The set is closed on purpose: every backend must be able to reduce every
// dtype, and ranks must agree on the wire. Only the exact types below map;
// in particular char (std::string), bool, int16_t and long long (which is
// not int64_t on LP64 Linux) have no dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <dcomm/error.hpp>
#include <dcomm/half.hpp>

namespace dcomm {

// The numeric values are part of the wire format: append, never reorder.
enum class dtype : std::uint8_t { int8, uint8, int32, int64, float16, bfloat16, float32, float64 };

// 0 for a value outside the enumeration (e.g. read from a corrupt message).
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::int8:
    case dtype::uint8:
      return 1;
    case dtype::float16:
    case dtype::bfloat16:
      return 2;
    case dtype::int32:
    case dtype::float32:
      return 4;
    case dtype::int64:
    case dtype::float64:
      return 8;
  }
  return 0;
}

constexpr std::string_view name(dtype t) noexcept {
  switch (t) {
    case dtype::int8:
      return "int8";
    case dtype::uint8:
      return "uint8";
    case dtype::int32:
      return "int32";
    case dtype::int64:
      return "int64";
    case dtype::float16:
      return "float16";
    case dtype::bfloat16:
      return "bfloat16";
    case dtype::float32:
      return "float32";
    case dtype::float64:
      return "float64";
  }
  return "unknown";
}

constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::float16 || t == dtype::bfloat16 || t == dtype::float32 || t == dtype::float64;
}

constexpr bool is_integral(dtype t) noexcept {
  return t == dtype::int8 || t == dtype::uint8 || t == dtype::int32 || t == dtype::int64;
}

namespace detail {
template <class T>
struct dtype_map {
  static constexpr bool known = false;
  // Only so that dtype_of<T> reports its static_assert and nothing else.
  static constexpr dtype value = dtype::uint8;
};
template <dtype D>
struct dtype_entry {
  static constexpr bool known = true;
  static constexpr dtype value = D;
};
template <>
struct dtype_map<std::int8_t> : dtype_entry<dtype::int8> {};
template <>
struct dtype_map<std::uint8_t> : dtype_entry<dtype::uint8> {};
template <>
struct dtype_map<std::int32_t> : dtype_entry<dtype::int32> {};
template <>
struct dtype_map<std::int64_t> : dtype_entry<dtype::int64> {};
template <>
struct dtype_map<float16> : dtype_entry<dtype::float16> {};
template <>
struct dtype_map<bfloat16> : dtype_entry<dtype::bfloat16> {};
template <>
struct dtype_map<float> : dtype_entry<dtype::float32> {};
template <>
struct dtype_map<double> : dtype_entry<dtype::float64> {};
}  // namespace detail

// One of the eight element types, ignoring const/volatile. References,
// pointers and everything else are not.
template <class T>
concept element_type = detail::dtype_map<std::remove_cv_t<T>>::known;

template <class T>
struct dtype_of {
  static_assert(element_type<T>,
                "dcomm: no dtype for this element type; supported: int8_t, uint8_t, int32_t, "
                "int64_t, float16, bfloat16, float, double");
  static constexpr dtype value = detail::dtype_map<std::remove_cv_t<T>>::value;
};

template <class T>
inline constexpr dtype dtype_of_v = dtype_of<T>::value;

// Calls f(std::type_identity<T>{}) with T the element type of t and returns
// what it returns (every branch must return the same type). A dtype outside
// the enumeration throws errc::invalid_argument rather than being guessed.
template <class F>
constexpr decltype(auto) visit_dtype(dtype t, F&& f) {
  using result = decltype(std::forward<F>(f)(std::type_identity<std::int8_t>{}));
  switch (t) {
    case dtype::int8:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<std::int8_t>{}));
    case dtype::uint8:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<std::uint8_t>{}));
    case dtype::int32:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<std::int32_t>{}));
    case dtype::int64:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<std::int64_t>{}));
    case dtype::float16:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<float16>{}));
    case dtype::bfloat16:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<bfloat16>{}));
    case dtype::float32:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<float>{}));
    case dtype::float64:
      return static_cast<result>(std::forward<F>(f)(std::type_identity<double>{}));
  }
  throw_error(errc::invalid_argument,
              {.operation = "visit_dtype",
               .detail = "dtype value " + std::to_string(static_cast<unsigned>(t)) +
                         " is not a dcomm::dtype"});
}

}  // namespace dcomm
