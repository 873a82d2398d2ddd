// The object collectives' payload: an object_value (communicator.hpp) as
// bytes and back, refusing bytes that cannot be one (ranks that passed
// different types).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "dcomm/error.hpp"
#include "dcomm/operation.hpp"

namespace dcomm::detail {

template <class T>
std::vector<std::uint8_t> to_bytes(const T& v) {
  std::vector<std::uint8_t> out;
  if constexpr (std::is_trivially_copyable_v<T>) {
    out.resize(sizeof(T));
    std::memcpy(out.data(), &v, sizeof(T));
  } else {
    out.resize(v.size() * sizeof(typename T::value_type));
    if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  }
  return out;
}

template <class T>
T from_bytes(const std::uint8_t* p, std::size_t n, operation op) {
  T v{};
  if constexpr (std::is_trivially_copyable_v<T>) {
    if (n != sizeof(T))
      throw_error(errc::mismatch, {.operation = name(op),
                                   .expected = std::to_string(sizeof(T)) + " bytes",
                                   .seen = std::to_string(n) + " bytes",
                                   .detail = "ranks passed objects of different types"});
    std::memcpy(&v, p, n);
  } else {
    using E = typename T::value_type;
    if (n % sizeof(E) != 0)
      throw_error(errc::mismatch, {.operation = name(op),
                                   .seen = std::to_string(n) + " bytes",
                                   .detail = "not a whole number of elements of " +
                                             std::to_string(sizeof(E)) + " bytes"});
    v.resize(n / sizeof(E));
    if (n) std::memcpy(v.data(), p, n);
  }
  return v;
}

}  // namespace dcomm::detail
