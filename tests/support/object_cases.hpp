// The object collectives against computed expectations, for any backend
// (the CPU backend's thread worlds and processes, the MPI backend): values
// of every kind of codec (strings, nested containers, maps, sets, optional,
// variant, tuples, a struct with its own codec, a trivially copyable one),
// sizes that differ per rank, empty values, every root.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "dcomm/codec.hpp"
#include "dcomm/detail/asio.hpp"
#include "support/check_failed.hpp"

namespace dcomm::test {

// A type of the tests' own, with its codec.
struct sample {
  std::string label;
  std::vector<float> pixels;
  std::optional<std::int32_t> weight;
  bool operator==(const sample&) const = default;
};

}  // namespace dcomm::test

template <>
struct dcomm::codec<dcomm::test::sample> {
  static std::string name() { return "sample"; }
  static void write(dcomm::writer& w, const dcomm::test::sample& s) {
    w(s.label);
    w(s.pixels);
    w(s.weight);
  }
  static void read(dcomm::reader& r, dcomm::test::sample& s) {
    r(s.label);
    r(s.pixels);
    r(s.weight);
  }
};

namespace dcomm::test {
namespace cases {

// Rank r's value of each kind: sizes grow with r, rank 0's are empty.
using stats = std::map<std::string, std::vector<std::int64_t>>;
inline stats stats_of(int r) {
  stats s;
  for (int i = 0; i < r; ++i)
    s["key " + std::to_string(i)] = std::vector<std::int64_t>(static_cast<std::size_t>(i + 1), r);
  return s;
}
inline sample sample_of(int r) {
  sample s{"rank " + std::to_string(r),
           std::vector<float>(static_cast<std::size_t>(3 * r), 0.5f * r), std::nullopt};
  if (r % 2) s.weight = r;
  return s;
}
using mixed = std::tuple<std::set<std::string>, std::variant<std::int32_t, std::string>, double>;
inline mixed mixed_of(int r) {
  std::set<std::string> words;
  for (int i = 0; i <= r; ++i) words.insert(std::string(static_cast<std::size_t>(i), 'w'));
  std::variant<std::int32_t, std::string> v;
  if (r % 2)
    v = std::string(static_cast<std::size_t>(r * 100), 'v');
  else
    v = r;
  return {words, v, r * 0.25};
}
struct plain {
  std::int32_t a;
  double b;
  bool operator==(const plain&) const = default;
};

template <class Comm>
asio::awaitable<void> object_collectives(Comm& c) {
  const int n = c.size(), r = c.rank();
  for (int root = 0; root < n; ++root) {
    const std::string at = " (root " + std::to_string(root) + ", world " + std::to_string(n) + ")";
    // broadcast_object: containers change size on the receivers.
    stats s = r == root ? stats_of(root + 1) : stats_of(0);
    co_await c.broadcast_object(s, root);
    if (s != stats_of(root + 1)) throw check_failed("broadcast_object: map" + at);
    std::string empty = r == root ? "" : "not empty";
    co_await c.broadcast_object(empty, root);
    if (!empty.empty()) throw check_failed("broadcast_object: empty string" + at);
    // broadcast_object_list: lists of one length everywhere.
    std::vector<sample> list(3);
    if (r == root) list = {sample_of(root), sample_of(root + 1), sample_of(0)};
    co_await c.broadcast_object_list(list, root);
    if (list != std::vector<sample>{sample_of(root), sample_of(root + 1), sample_of(0)})
      throw check_failed("broadcast_object_list" + at);
    // gather_object: everyone's on the root only.
    auto gathered = co_await c.gather_object(mixed_of(r), root);
    if (r == root) {
      if (gathered.size() != static_cast<std::size_t>(n))
        throw check_failed("gather_object: " + std::to_string(gathered.size()) + " values" + at);
      for (int p = 0; p < n; ++p)
        if (gathered[static_cast<std::size_t>(p)] != mixed_of(p))
          throw check_failed("gather_object: rank " + std::to_string(p) + "'s value" + at);
    } else if (!gathered.empty()) {
      throw check_failed("gather_object: values on a rank that is not the root" + at);
    }
    // scatter_object: rank p gets the root's in[p]; the others pass {}.
    std::vector<sample> in;
    if (r == root)
      for (int p = 0; p < n; ++p) in.push_back(sample_of(p + root));
    const sample mine = co_await c.scatter_object(in, root);
    if (mine != sample_of(r + root)) throw check_failed("scatter_object" + at);
  }
  // all_gather_object: every rank's, everywhere.
  auto all = co_await c.all_gather_object(stats_of(r));
  if (all.size() != static_cast<std::size_t>(n)) throw check_failed("all_gather_object: size");
  for (int p = 0; p < n; ++p)
    if (all[static_cast<std::size_t>(p)] != stats_of(p))
      throw check_failed("all_gather_object: rank " + std::to_string(p) + "'s map");
  auto plains = co_await c.all_gather_object(plain{r, r * 0.5});
  for (int p = 0; p < n; ++p)
    if (plains[static_cast<std::size_t>(p)] != plain{p, p * 0.5})
      throw check_failed("all_gather_object: trivially copyable struct");
  auto lists =
      co_await c.all_gather_object(std::vector<std::string>(static_cast<std::size_t>(r), "x"));
  for (int p = 0; p < n; ++p)
    if (lists[static_cast<std::size_t>(p)] !=
        std::vector<std::string>(static_cast<std::size_t>(p), "x"))
      throw check_failed("all_gather_object: vector of strings");
}

}  // namespace cases
}  // namespace dcomm::test
