// Tests for dcomm::dtype and the mapping between element types and dtypes.
#include <doctest/doctest.h>
#include <dcomm/dtype.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>  // doctest prints std::error_code with operator<<
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

namespace {

using dcomm::dtype;

constexpr std::array all_dtypes = {dtype::int8,    dtype::uint8,    dtype::int32,   dtype::int64,
                                   dtype::float16, dtype::bfloat16, dtype::float32, dtype::float64};

}  // namespace

TEST_CASE("dtype values are fixed (they go on the wire)") {
  static_assert(std::is_same_v<std::underlying_type_t<dtype>, std::uint8_t>);
  static_assert(sizeof(dtype) == 1);
  CHECK(static_cast<int>(dtype::int8) == 0);
  CHECK(static_cast<int>(dtype::uint8) == 1);
  CHECK(static_cast<int>(dtype::int32) == 2);
  CHECK(static_cast<int>(dtype::int64) == 3);
  CHECK(static_cast<int>(dtype::float16) == 4);
  CHECK(static_cast<int>(dtype::bfloat16) == 5);
  CHECK(static_cast<int>(dtype::float32) == 6);
  CHECK(static_cast<int>(dtype::float64) == 7);
}

TEST_CASE("size_of, name, is_floating, is_integral") {
  static_assert(dcomm::size_of(dtype::int8) == 1);
  static_assert(dcomm::name(dtype::bfloat16) == "bfloat16");
  static_assert(dcomm::is_floating(dtype::float16));
  static_assert(dcomm::is_integral(dtype::uint8));

  struct row {
    dtype t;
    std::size_t size;
    std::string_view name;
    bool floating;
  };
  const row table[] = {
      {dtype::int8, 1, "int8", false},      {dtype::uint8, 1, "uint8", false},
      {dtype::int32, 4, "int32", false},    {dtype::int64, 8, "int64", false},
      {dtype::float16, 2, "float16", true}, {dtype::bfloat16, 2, "bfloat16", true},
      {dtype::float32, 4, "float32", true}, {dtype::float64, 8, "float64", true},
  };
  for (const row& r : table) {
    CAPTURE(r.name);
    CHECK(dcomm::size_of(r.t) == r.size);
    CHECK(dcomm::name(r.t) == r.name);
    CHECK(dcomm::is_floating(r.t) == r.floating);
    CHECK(dcomm::is_integral(r.t) == !r.floating);
  }

  const auto bogus = static_cast<dtype>(200);
  CHECK(dcomm::size_of(bogus) == 0);
  CHECK(dcomm::name(bogus) == "unknown");
  CHECK_FALSE(dcomm::is_floating(bogus));
  CHECK_FALSE(dcomm::is_integral(bogus));
}

TEST_CASE("dtype_of_v maps exactly the eight element types") {
  static_assert(dcomm::dtype_of_v<std::int8_t> == dtype::int8);
  static_assert(dcomm::dtype_of_v<std::uint8_t> == dtype::uint8);
  static_assert(dcomm::dtype_of_v<std::int32_t> == dtype::int32);
  static_assert(dcomm::dtype_of_v<std::int64_t> == dtype::int64);
  static_assert(dcomm::dtype_of_v<dcomm::float16> == dtype::float16);
  static_assert(dcomm::dtype_of_v<dcomm::bfloat16> == dtype::bfloat16);
  static_assert(dcomm::dtype_of_v<float> == dtype::float32);
  static_assert(dcomm::dtype_of_v<double> == dtype::float64);
  // cv-qualifiers are ignored.
  static_assert(dcomm::dtype_of_v<const float> == dtype::float32);
  static_assert(dcomm::dtype_of_v<volatile std::int32_t> == dtype::int32);
  static_assert(dcomm::dtype_of_v<const volatile dcomm::bfloat16> == dtype::bfloat16);
  static_assert(dcomm::dtype_of<double>::value == dtype::float64);
  CHECK(true);
}

TEST_CASE("element_type accepts the eight types and nothing else") {
  static_assert(dcomm::element_type<std::int8_t>);
  static_assert(dcomm::element_type<std::uint8_t>);
  static_assert(dcomm::element_type<std::int32_t>);
  static_assert(dcomm::element_type<std::int64_t>);
  static_assert(dcomm::element_type<dcomm::float16>);
  static_assert(dcomm::element_type<dcomm::bfloat16>);
  static_assert(dcomm::element_type<float>);
  static_assert(dcomm::element_type<double>);
  static_assert(dcomm::element_type<const float>);
  static_assert(dcomm::element_type<const volatile std::int64_t>);

  static_assert(!dcomm::element_type<char>);  // distinct from int8_t and uint8_t
  static_assert(!dcomm::element_type<bool>);
  static_assert(!dcomm::element_type<std::int16_t>);
  static_assert(!dcomm::element_type<std::uint16_t>);
  static_assert(!dcomm::element_type<std::uint32_t>);
  static_assert(!dcomm::element_type<std::uint64_t>);
  static_assert(!dcomm::element_type<long double>);
  static_assert(!dcomm::element_type<std::byte>);
  static_assert(!dcomm::element_type<wchar_t>);
  static_assert(!dcomm::element_type<char8_t>);
  static_assert(!dcomm::element_type<void>);
  static_assert(!dcomm::element_type<float&>);
  static_assert(!dcomm::element_type<const float&>);
  static_assert(!dcomm::element_type<float*>);
  static_assert(!dcomm::element_type<float[2]>);
  static_assert(!dcomm::element_type<std::string>);
  static_assert(!dcomm::element_type<std::pair<float, float>>);
  static_assert(!dcomm::element_type<dtype>);
  // long long and long are distinct types even when both are 64 bits; only
  // the one that is std::int64_t maps.
  static_assert(dcomm::element_type<long long> == std::is_same_v<long long, std::int64_t>);
  static_assert(dcomm::element_type<long> == std::is_same_v<long, std::int64_t>);
  CHECK(true);
}

namespace {
struct dtype_probe {
  template <class T>
  std::pair<dtype, std::size_t> operator()(std::type_identity<T>) const {
    return {dcomm::dtype_of_v<T>, sizeof(T)};
  }
};
}  // namespace

TEST_CASE("visit_dtype calls f with the matching element type") {
  for (dtype t : all_dtypes) {
    CAPTURE(dcomm::name(t));
    const auto [seen, size] = dcomm::visit_dtype(t, dtype_probe{});
    CHECK(seen == t);
    CHECK(size == dcomm::size_of(t));
  }

  // Results pass through, including references and void.
  int calls = 0;
  dcomm::visit_dtype(dtype::float16, [&]<class T>(std::type_identity<T>) {
    static_assert(dcomm::element_type<T>);
    ++calls;
  });
  CHECK(calls == 1);
  int target = 0;
  int& ref = dcomm::visit_dtype(dtype::int64, [&](auto) -> int& { return target; });
  CHECK(&ref == &target);

  // Usable in constant expressions.
  static_assert(dcomm::visit_dtype(dtype::float64,
                                   []<class T>(std::type_identity<T>) { return sizeof(T); }) == 8);
}

TEST_CASE("visit_dtype rejects a value outside the enumeration") {
  bool called = false;
  try {
    dcomm::visit_dtype(static_cast<dtype>(42), [&](auto) { called = true; });
    FAIL("visit_dtype did not throw");
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::invalid_argument);
    CHECK(std::string(e.what()).find("42") != std::string::npos);
  }
  CHECK_FALSE(called);
}
