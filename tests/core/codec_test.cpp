// dcomm/codec.hpp: every built-in codec round-trips, bytes that do not parse
// are refused before anything is allocated or a bad value is made, and the
// RPC layer's spelling names the same template.
#include "dcomm/codec.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "dcomm/rpc/codec.hpp"

namespace {

struct labelled {
  std::string label;
  std::vector<double> values;
  bool operator==(const labelled&) const = default;
};

struct plain_pair {
  std::int32_t a;
  float b;
  bool operator==(const plain_pair&) const = default;
};

struct through_rpc_spelling {
  std::int64_t v = 0;
  bool operator==(const through_rpc_spelling&) const = default;
};

}  // namespace

template <>
struct dcomm::codec<labelled> {
  static std::string name() { return "labelled"; }
  static void write(dcomm::writer& w, const labelled& l) {
    w(l.label);
    w(l.values);
  }
  static void read(dcomm::reader& r, labelled& l) {
    r(l.label);
    r(l.values);
  }
};

// Specialised under the RPC layer's name: the same template.
template <>
struct dcomm::rpc::codec<through_rpc_spelling> {
  static std::string name() { return "rpc_spelt"; }
  static void write(dcomm::rpc::writer& w, const through_rpc_spelling& x) { w(x.v + 1); }
  static void read(dcomm::rpc::reader& r, through_rpc_spelling& x) {
    r(x.v);
    x.v -= 1;
  }
};

namespace {

template <class T>
std::vector<std::uint8_t> encode(const T& v) {
  std::vector<std::uint8_t> out;
  dcomm::writer w(out);
  w(v);
  return out;
}

template <class T>
T decode(const std::vector<std::uint8_t>& b) {
  dcomm::reader r(b);
  T v{};
  r(v);
  if (r.left() != 0) throw dcomm::payload_error(std::to_string(r.left()) + " bytes left over");
  return v;
}

template <class T>
void round_trip(const T& v) {
  CAPTURE(dcomm::codec<T>::name());
  CHECK(decode<T>(encode(v)) == v);
}

}  // namespace

TEST_SUITE("codec") {
  TEST_CASE("the standard containers, nested, round-trip") {
    round_trip(std::int16_t{-7});
    round_trip(true);
    round_trip(std::string("with\0nul", 8));
    round_trip(std::vector<std::string>{"a", "", "ccc"});
    round_trip(std::vector<bool>{true, false, true});
    round_trip(std::array<std::string, 3>{"x", "y", ""});
    round_trip(std::array<float, 4>{1, 2, 3, 4});
    round_trip(std::map<std::string, std::vector<int>>{{"a", {1, 2}}, {"b", {}}});
    round_trip(std::unordered_map<int, std::string>{{1, "one"}, {2, "two"}});
    round_trip(std::set<std::string>{"b", "a"});
    round_trip(std::unordered_set<std::int64_t>{5, -5});
    round_trip(std::optional<std::string>{});
    round_trip(std::optional<std::string>{"set"});
    round_trip(std::variant<int, std::string>{std::string("second")});
    round_trip(std::variant<int, std::string>{3});
    round_trip(std::pair<int, std::string>{1, "p"});
    round_trip(std::tuple<int, std::string, std::vector<float>>{1, "t", {0.5f}});
    round_trip(labelled{"user type", {1.5, -2.0}});
    round_trip(std::vector<labelled>{{"a", {}}, {"b", {3.0}}});
    round_trip(plain_pair{-1, 2.5f});
    round_trip(std::map<int, plain_pair>{{0, {1, 1.0f}}});
  }

  TEST_CASE("names tell types apart") {
    CHECK(dcomm::codec<std::map<std::string, int>>::name() == "map<str,i32>");
    CHECK(dcomm::codec<std::set<std::string>>::name() == "set<str>");
    CHECK(dcomm::codec<std::array<std::string, 2>>::name() == "arr2<str>");
    CHECK(dcomm::codec<std::variant<int, float>>::name() == "var<i32,f32>");
    CHECK(dcomm::codec<std::vector<labelled>>::name() == "vec<labelled>");
    CHECK(dcomm::codec<std::map<int, int>>::name() != dcomm::codec<std::set<int>>::name());
  }

  TEST_CASE("the RPC layer's spelling is the same codec") {
    round_trip(through_rpc_spelling{41});
    CHECK(encode(through_rpc_spelling{41}) == encode(std::int64_t{42}));
    CHECK(dcomm::rpc::signature<through_rpc_spelling, int>() == "(rpc_spelt,i32)");
  }

  TEST_CASE("bytes that cannot be the type are refused") {
    // A bool's byte other than 0 or 1.
    CHECK_THROWS_AS(decode<bool>({2}), dcomm::payload_error);
    // A variant's index past its alternatives.
    auto v = encode(std::variant<int, std::string>{3});
    v[0] = 7;
    CHECK_THROWS_WITH_AS((decode<std::variant<int, std::string>>(v)), "a variant's index is 7 of 2",
                         dcomm::payload_error);
    // A key twice: a map would keep one and drop the other silently.
    auto twice = encode(std::vector<std::pair<int, int>>{{1, 2}, {1, 3}});
    CHECK_THROWS_WITH_AS((decode<std::map<int, int>>(twice)), "a key appears twice",
                         dcomm::payload_error);
    CHECK_THROWS_AS(decode<std::set<int>>(encode(std::vector<int>{4, 4})), dcomm::payload_error);
    // A forged count does not allocate: it must fit in what is left.
    std::vector<std::uint8_t> forged(8, 0xff);
    CHECK_THROWS_AS((decode<std::map<std::string, std::string>>(forged)), dcomm::payload_error);
    CHECK_THROWS_AS(decode<std::vector<std::string>>(forged), dcomm::payload_error);
    // Truncated anywhere: refused, never read past the end.
    const auto whole = encode(std::map<std::string, std::vector<int>>{{"key", {1, 2, 3}}});
    for (std::size_t n = 0; n < whole.size(); ++n) {
      std::vector<std::uint8_t> cut(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(n));
      CAPTURE(n);
      CHECK_THROWS_AS((decode<std::map<std::string, std::vector<int>>>(cut)), dcomm::payload_error);
    }
  }
}
