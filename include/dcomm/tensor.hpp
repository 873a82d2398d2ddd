// What dcomm accepts as a buffer: the tensor concepts, the tensor_traits
// customisation point, and the type-erased views that backends work on.
//
// How a type T is read, first match wins:
//  1. a specialisation dcomm::tensor_traits<T> (cv-qualifiers dropped);
//  2. data() and size() members (std::vector, std::array, std::span, user
//     classes);
//  3. a std::ranges::contiguous_range that is also a sized_range (C arrays).
// The element type must be one of the eight dtype types; a traits
// specialisation may instead return void* and report the dtype at run time.
//
// A tensor is writable (mutable_tensor) when the pointer it yields for the
// given constness is non-const. So const std::vector<float> is read-only,
// while const std::span<float> is writable: constness of a view type is
// shallow, exactly as the type itself says through data().
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <ranges>
#include <type_traits>
#include <utility>

#include <dcomm/dtype.hpp>

namespace dcomm {

struct device {
  enum class kind : std::uint8_t { cpu, cuda } type = kind::cpu;
  int index = 0;

  static constexpr device cpu() noexcept { return {}; }
  static constexpr device cuda(int ordinal = 0) noexcept { return {kind::cuda, ordinal}; }

  friend constexpr bool operator==(const device&, const device&) = default;
};

// Specialise for your tensor type:
//
//   template <> struct dcomm::tensor_traits<my_tensor> {
//     static float* data(my_tensor& t);              // or void*, or const E*
//     static std::size_t size(const my_tensor& t);   // elements, not bytes
//     static dcomm::dtype dtype(const my_tensor& t); // required for void*
//     static dcomm::device device(const my_tensor& t);  // optional, cpu
//   };
//
// data() is called with a non-const reference when the object is non-const.
// For a const object it is called with a const reference if that compiles;
// otherwise the const is cast away for the call (so data must not modify the
// object) and the pointer is treated as read-only. Qualify dcomm::device and
// dcomm::dtype inside the specialisation, since the members reuse the names.
//
// Left undefined: a complete tensor_traits<T> is how we tell that the user
// specialised it.
template <class T>
struct tensor_traits;

// A borrowed, type-erased description of a tensor's memory.
struct const_tensor_view {
  const void* data = nullptr;
  std::size_t count = 0;  // elements
  dcomm::dtype type = dcomm::dtype::uint8;
  dcomm::device device = {};

  constexpr std::size_t bytes() const noexcept { return count * size_of(type); }
};

struct tensor_view {
  void* data = nullptr;
  std::size_t count = 0;  // elements
  dcomm::dtype type = dcomm::dtype::uint8;
  dcomm::device device = {};

  constexpr std::size_t bytes() const noexcept { return count * size_of(type); }

  // Anything one can write may also be read (a send from a receive buffer).
  constexpr operator const_tensor_view() const noexcept { return {data, count, type, device}; }
};

// The views are tensors themselves (runtime-typed), so code that takes a
// tensor also takes a view. Like std::span, their constness is shallow.
template <>
struct tensor_traits<tensor_view> {
  static void* data(const tensor_view& v) noexcept { return v.data; }
  static std::size_t size(const tensor_view& v) noexcept { return v.count; }
  static dcomm::dtype dtype(const tensor_view& v) noexcept { return v.type; }
  static dcomm::device device(const tensor_view& v) noexcept { return v.device; }
};

template <>
struct tensor_traits<const_tensor_view> {
  static const void* data(const const_tensor_view& v) noexcept { return v.data; }
  static std::size_t size(const const_tensor_view& v) noexcept { return v.count; }
  static dcomm::dtype dtype(const const_tensor_view& v) noexcept { return v.type; }
  static dcomm::device device(const const_tensor_view& v) noexcept { return v.device; }
};

namespace detail {

template <class>
inline constexpr bool dependent_false = false;

enum class tensor_route { none, traits, members, range };

template <class U>
concept has_tensor_traits = requires {
  sizeof(tensor_traits<U>);
};

// Obj is the (possibly const) object type, never a reference.
template <class Obj>
constexpr tensor_route route_of() {
  if constexpr (!std::is_object_v<Obj>)
    return tensor_route::none;
  else if constexpr (has_tensor_traits<std::remove_cv_t<Obj>>)
    return tensor_route::traits;
  else if constexpr (requires(Obj & o) {
                       o.data();
                       o.size();
                     })
    return tensor_route::members;
  else if constexpr (std::ranges::range<Obj&>)
    return tensor_route::range;
  else
    return tensor_route::none;
}

// The data pointer as the chosen route gives it, one constrained overload
// per route so that asking "is there a pointer?" never hard-errors.
template <class Obj>
concept traits_data_direct = route_of<Obj>()
== tensor_route::traits&& requires(Obj& o) {
  {tensor_traits<std::remove_cv_t<Obj>>::data(o)};
  requires std::is_pointer_v<decltype(tensor_traits<std::remove_cv_t<Obj>>::data(o))>;
};

// A const object whose traits only take U&.
template <class Obj>
concept traits_data_cast = route_of<Obj>()
== tensor_route::traits && !traits_data_direct<Obj> && std::is_const_v<Obj> &&
    requires(std::remove_cv_t<Obj> & u) {
  {tensor_traits<std::remove_cv_t<Obj>>::data(u)};
  requires std::is_pointer_v<decltype(tensor_traits<std::remove_cv_t<Obj>>::data(u))>;
};

template <class Obj>
requires traits_data_direct<Obj>
constexpr auto raw_data(Obj& o) {
  return tensor_traits<std::remove_cv_t<Obj>>::data(o);
}

template <class Obj>
requires traits_data_cast<Obj>
constexpr auto raw_data(Obj& o) {
  using U = std::remove_cv_t<Obj>;
  auto* p = tensor_traits<U>::data(const_cast<U&>(o));
  return static_cast<const std::remove_pointer_t<decltype(p)>*>(p);
}

template <class Obj>
requires(route_of<Obj>() == tensor_route::members) && requires(Obj& o) {
  requires std::is_pointer_v<decltype(o.data())>;
}
constexpr auto raw_data(Obj& o) {
  return o.data();
}

template <class Obj>
requires(route_of<Obj>() == tensor_route::range) && requires(Obj& o) {
  std::ranges::data(o);
}
constexpr auto raw_data(Obj& o) {
  return std::ranges::data(o);
}

template <class Obj>
concept data_pointer_valid = requires(Obj& o) {
  raw_data(o);
};

template <class Obj, tensor_route Route = route_of<Obj>()>
struct size_valid : std::false_type {};
template <class Obj>
    struct size_valid<Obj, tensor_route::traits> : std::bool_constant <
                                                   requires(const std::remove_cv_t<Obj>& o) {
  { tensor_traits<std::remove_cv_t<Obj>>::size(o) } -> std::convertible_to<std::size_t>;
} > {};
template <class Obj>
    struct size_valid<Obj, tensor_route::members> : std::bool_constant < requires(Obj& o) {
  { o.size() } -> std::convertible_to<std::size_t>;
} > {};
template <class Obj>
struct size_valid<Obj, tensor_route::range>
    : std::bool_constant<std::ranges::contiguous_range<Obj&> && std::ranges::sized_range<Obj&>> {};

template <class Obj>
concept has_runtime_dtype = requires(const std::remove_cv_t<Obj>& o) {
  { tensor_traits<std::remove_cv_t<Obj>>::dtype(o) } -> std::convertible_to<dtype>;
};

template <class Obj>
concept has_traits_device = requires(const std::remove_cv_t<Obj>& o) {
  { tensor_traits<std::remove_cv_t<Obj>>::device(o) } -> std::convertible_to<device>;
};

// Everything the concepts and views need to know about Obj.
template <class Obj, bool = data_pointer_valid<Obj>>
struct tensor_info {
  static constexpr tensor_route route = route_of<Obj>();
  static constexpr bool has_pointer = false;
  static constexpr bool valid = false;
  static constexpr bool writable = false;
};

template <class Obj>
struct tensor_info<Obj, true> {
  static constexpr tensor_route route = route_of<Obj>();
  static constexpr bool has_pointer = true;
  using pointer = decltype(raw_data(std::declval<Obj&>()));
  using pointee = std::remove_pointer_t<pointer>;
  using element = std::remove_cv_t<pointee>;
  static constexpr bool runtime_typed = std::is_void_v<element>;
  static constexpr bool element_ok =
      !std::is_volatile_v<pointee> &&
      (runtime_typed ? route == tensor_route::traits && has_runtime_dtype<Obj>
                     : element_type<element>);
  static constexpr bool valid = element_ok && size_valid<Obj>::value;
  static constexpr bool writable = valid && !std::is_const_v<pointee>;
};

template <class T>
using tensor_info_t = tensor_info<std::remove_reference_t<T>>;

}  // namespace detail

// Readable as a send buffer. T may be a reference; an rvalue is treated like
// the lvalue it will be bound to.
template <class T>
concept tensor = detail::tensor_info_t<T>::valid;

// Writable as a receive buffer.
template <class T>
concept mutable_tensor = tensor<T> && detail::tensor_info_t<T>::writable;

// The static element type, or void when the dtype is only known at run time.
template <tensor T>
using element_t = typename detail::tensor_info_t<T>::element;

namespace detail {

// Says, as a readable static_assert, why Obj is not a tensor. The checks are
// ordered so that exactly one fires.
template <class Obj>
constexpr void diagnose_tensor() {
  using info = tensor_info<Obj>;
  if constexpr (!info::valid) {
    constexpr tensor_route route = route_of<Obj>();
    if constexpr (route == tensor_route::none) {
      static_assert(dependent_false<Obj>,
                    "dcomm: not a tensor: specialise dcomm::tensor_traits<T>, or give T data() "
                    "and size() members, or use a contiguous sized range");
    } else if constexpr (route == tensor_route::range && !size_valid<Obj>::value) {
      static_assert(dependent_false<Obj>,
                    "dcomm: not a tensor: a range must be contiguous and sized (std::list, "
                    "std::deque, views that skip are not); copy it into a std::vector first");
    } else if constexpr (!info::has_pointer) {
      static_assert(dependent_false<Obj>,
                    "dcomm: not a tensor: data() must return a pointer to the elements "
                    "(for tensor_traits<T>: static data(T&))");
    } else if constexpr (std::is_volatile_v<typename info::pointee>) {
      static_assert(dependent_false<Obj>, "dcomm: not a tensor: volatile elements");
    } else if constexpr (info::runtime_typed) {
      static_assert(dependent_false<Obj>,
                    "dcomm: tensor_traits<T>::data returns void*, so it also needs "
                    "static dcomm::dtype dtype(const T&)");
    } else if constexpr (!element_type<typename info::element>) {
      // Instantiates dtype_of for its static_assert, the one message listing
      // the types; sizeof avoids a second error about the failed constant.
      static_cast<void>(sizeof(dtype_of<typename info::element>));
    } else {
      static_assert(dependent_false<Obj>,
                    "dcomm: not a tensor: size() must return the element count "
                    "(for tensor_traits<T>: static std::size_t size(const T&))");
    }
  }
}

template <class Obj>
std::size_t tensor_count(Obj& o) {
  using U = std::remove_cv_t<Obj>;
  constexpr tensor_route route = route_of<Obj>();
  if constexpr (route == tensor_route::traits)
    return static_cast<std::size_t>(tensor_traits<U>::size(std::as_const(o)));
  else if constexpr (route == tensor_route::members)
    return static_cast<std::size_t>(o.size());
  else
    return static_cast<std::size_t>(std::ranges::size(o));
}

template <class Obj>
dtype tensor_dtype(Obj& o) {
  using info = tensor_info<Obj>;
  if constexpr (info::runtime_typed)
    return static_cast<dtype>(tensor_traits<std::remove_cv_t<Obj>>::dtype(std::as_const(o)));
  else
    return dtype_of_v<typename info::element>;
}

template <class Obj>
device tensor_device(Obj& o) {
  if constexpr (route_of<Obj>() == tensor_route::traits && has_traits_device<Obj>)
    return static_cast<device>(tensor_traits<std::remove_cv_t<Obj>>::device(std::as_const(o)));
  else
    return device::cpu();
}

}  // namespace detail

// A read-only view of any tensor. Not SFINAE-friendly on purpose: a
// non-tensor gets a static_assert saying why; test with dcomm::tensor<T>.
template <class T>
const_tensor_view view(T&& t) {
  using Obj = std::remove_reference_t<T>;
  detail::diagnose_tensor<Obj>();
  if constexpr (tensor<T>) {
    Obj& o = t;
    return {static_cast<const void*>(detail::raw_data(o)), detail::tensor_count(o),
            detail::tensor_dtype(o), detail::tensor_device(o)};
  } else {
    return {};
  }
}

// A writable view, for receive buffers. An rvalue non-const container is
// accepted: whether the result outlives the call is the caller's business.
template <class T>
tensor_view mutable_view(T&& t) {
  using Obj = std::remove_reference_t<T>;
  detail::diagnose_tensor<Obj>();
  if constexpr (tensor<T>) {
    static_assert(mutable_tensor<T>,
                  "dcomm: cannot receive into a const tensor (its data is read-only)");
    if constexpr (mutable_tensor<T>) {
      Obj& o = t;
      return {static_cast<void*>(detail::raw_data(o)), detail::tensor_count(o),
              detail::tensor_dtype(o), detail::tensor_device(o)};
    } else {
      return {};
    }
  } else {
    return {};
  }
}

}  // namespace dcomm
