// The CPU backend's tuning, in one place: for each collective, the
// algorithm for small and for large messages and the option that sets the
// size between them (algorithm_table); the DCOMM_ALGO overrides; which
// algorithms a call may ask for; and the choice for one call (choose). The
// algorithms themselves are in cpu/algorithms/<op>.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/error.hpp"

namespace dcomm::cpu {

// The field of cpu_backend::options that holds an op's size limit: up to
// it (bytes) the small algorithm runs, above it the large one.
enum class size_limit : std::uint8_t {
  none,  // one algorithm, whatever the size
  small_all_reduce,
  small_broadcast,
  small_all_gather,
  small_reduce_scatter,
};

// The algorithms of each collective, for small and for large messages (the
// same where it has one): chosen by size unless a call or DCOMM_ALGO asks
// for one of them. The size an op measures: its buffer (a slice's, for a
// CUDA tensor that goes slice by slice), all_gather its whole output,
// reduce_scatter its whole input.
struct algorithm_choice {
  coll_op op;
  algorithm small, large;
  size_limit limit;
  // The large algorithm gives each rank a part of the elements: with fewer
  // elements than ranks the small one runs, whatever the size.
  bool part_per_rank = false;
  // It also has algorithm::shared_memory (cpu/algorithms/shared_memory.hpp),
  // which runs, whatever the size, where the group has an arena (its ranks
  // all share a host: cpu_backend::via_arena), unless a call asks for another;
  // reduce's only up to arena_reduce_limit unless asked for (its root
  // reduces alone).
  bool shared_memory = false;
  // And algorithm::hierarchical (cpu/algorithms/hierarchical.hpp), which
  // runs, whatever the size, where the group spans hosts with several of
  // its ranks on some (host_layout::spans), unless a call asks for another.
  bool hierarchical = false;
};
// Rows: op, small algorithm, large algorithm, the option that holds the size
// limit, whether the large one needs an element per rank, whether it has a
// shared memory algorithm, whether it has a hierarchical one. Barrier has one
// message algorithm (dissemination) and no size to choose by; reduce shares
// broadcast's limit.
inline constexpr algorithm_choice algorithm_table[] = {
    {coll_op::barrier, algorithm::automatic, algorithm::automatic, size_limit::none, false, true,
     true},
    {coll_op::broadcast, algorithm::binomial_tree, algorithm::chain, size_limit::small_broadcast,
     false, true, true},
    {coll_op::reduce, algorithm::binomial_tree, algorithm::chain, size_limit::small_broadcast,
     false, true},
    {coll_op::all_reduce, algorithm::recursive_doubling, algorithm::ring,
     size_limit::small_all_reduce, true, true, true},
    {coll_op::scatter, algorithm::direct, algorithm::direct, size_limit::none},
    {coll_op::gather, algorithm::direct, algorithm::direct, size_limit::none},
    {coll_op::all_gather, algorithm::direct, algorithm::ring, size_limit::small_all_gather, false,
     true},
    {coll_op::reduce_scatter, algorithm::direct, algorithm::ring, size_limit::small_reduce_scatter},
    {coll_op::all_to_all, algorithm::direct, algorithm::direct, size_limit::none},
    {coll_op::all_gather_v, algorithm::direct, algorithm::direct, size_limit::none},
    {coll_op::all_to_all_v, algorithm::direct, algorithm::direct, size_limit::none},
};

inline const algorithm_choice& algorithms_of(coll_op op) {
  for (const auto& c : algorithm_table)
    if (c.op == op) return c;
  return algorithm_table[0];
}

// The value of `limit` in `o` (a cpu_backend::options; a template so that
// this table need not include the backend).
template <class Options>
std::size_t limit_of(const Options& o, size_limit limit) {
  switch (limit) {
    case size_limit::small_all_reduce:
      return o.small_all_reduce;
    case size_limit::small_broadcast:
      return o.small_broadcast;
    case size_limit::small_all_gather:
      return o.small_all_gather;
    case size_limit::small_reduce_scatter:
      return o.small_reduce_scatter;
    case size_limit::none:
      break;
  }
  return std::numeric_limits<std::size_t>::max();
}

// Empty if `a` may be asked of `operation` (a communicator operation's
// name), else why not.
inline std::string refuse_algorithm(std::string_view operation, algorithm a) {
  if (a == algorithm::automatic) return {};
  for (const auto& c : algorithm_table) {
    if (operation != name(c.op)) continue;
    if (a == c.small || a == c.large || (a == algorithm::shared_memory && c.shared_memory) ||
        (a == algorithm::hierarchical && c.hierarchical))
      return {};
    // Every algorithm it has, named as a call asks for it.
    std::vector<std::string> has;
    if (c.small != algorithm::automatic) has.emplace_back(dcomm::name(c.small));
    if (c.large != c.small) has.emplace_back(dcomm::name(c.large));
    if (c.shared_memory) has.emplace_back(dcomm::name(algorithm::shared_memory));
    if (c.hierarchical) has.emplace_back(dcomm::name(algorithm::hierarchical));
    std::string list;
    for (std::size_t i = 0; i < has.size(); ++i)
      list += (i == 0 ? "" : i + 1 == has.size() ? " and " : ", ") + has[i];
    if (c.small == algorithm::automatic)
      list = "one message algorithm: leave it automatic" + (list.empty() ? "" : "; or " + list);
    return "algorithm " + std::string(dcomm::name(a)) + " is not available for " +
           std::string(operation) + " (it has " + list + ")";
  }
  return "algorithm " + std::string(dcomm::name(a)) + " is not available for " +
         std::string(operation) + " (it has no algorithm to choose: leave it automatic)";
}

// "all_reduce=ring,broadcast=chain" (the DCOMM_ALGO variable) as overrides.
inline std::map<coll_op, algorithm> parse_algorithm_overrides(std::string_view spec) {
  std::map<coll_op, algorithm> out;
  auto fail = [&](std::string why) {
    throw_error(errc::invalid_argument,
                {.operation = "cpu_backend",
                 .key = "DCOMM_ALGO",
                 .seen = std::string(spec),
                 .detail = why + "; expected op=algorithm[,op=algorithm...], e.g. "
                                 "all_reduce=ring,broadcast=chain"});
  };
  while (!spec.empty()) {
    auto comma = spec.find(',');
    auto item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string_view::npos) fail("'" + std::string(item) + "' has no '='");
    auto op_name = item.substr(0, eq);
    auto a = parse_algorithm(item.substr(eq + 1));
    if (!a) fail("unknown algorithm '" + std::string(item.substr(eq + 1)) + "'");
    std::optional<coll_op> op;
    for (int i = 1; i <= static_cast<int>(coll_op::all_to_all); ++i)
      if (op_name == name(static_cast<coll_op>(i))) op = static_cast<coll_op>(i);
    if (!op) fail("unknown operation '" + std::string(op_name) + "'");
    if (auto why = refuse_algorithm(op_name, *a); !why.empty()) fail(why);
    out[*op] = *a;
  }
  return out;
}

// The algorithm a call asks for: its own (op_options::algorithm), else
// DCOMM_ALGO's for the op, else automatic. The call's signature carries it,
// so ranks that ask for different ones fail with errc::mismatch.
inline algorithm requested(coll_op op, algorithm asked,
                           const std::map<coll_op, algorithm>& overrides) {
  if (asked != algorithm::automatic) return asked;
  auto o = overrides.find(op);
  return o == overrides.end() ? algorithm::automatic : o->second;
}

// A call's size as the table's limits measure it.
struct call_size {
  std::size_t bytes = 0;
  std::size_t count = 0;  // elements
};

// What a call of `op` runs: the algorithm it asked for (requested()), else
// the table's by size, with the limits of `o` (cpu_backend::options). A
// world of one runs the small algorithm, which does without messages (the
// large ones assume a ring or chain of two ranks or more). Empty: `asked`
// is not one of the op's (refuse_algorithm says why; the front end refuses
// such a call before it starts, by the operation's name). `across_hosts`:
// the group spans hosts with several of its ranks on some.
template <class Options>
std::optional<algorithm> choose(coll_op op, algorithm asked, call_size size, int world,
                                const Options& o, bool across_hosts = false) {
  const auto& c = algorithms_of(op);
  const bool hierarchical = c.hierarchical && asked == algorithm::hierarchical;
  if (asked != algorithm::automatic && asked != c.small && asked != c.large && !hierarchical)
    return std::nullopt;
  if (world <= 1) return c.small;
  if (asked != algorithm::automatic) return asked;
  if (c.hierarchical && across_hosts) return algorithm::hierarchical;
  const bool small = size.bytes <= limit_of(o, c.limit) ||
                     (c.part_per_rank && size.count < static_cast<std::size_t>(world));
  return small ? c.small : c.large;
}

}  // namespace dcomm::cpu
