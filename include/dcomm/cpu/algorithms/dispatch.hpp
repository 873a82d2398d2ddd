// The CPU backend's dispatch: every collective's algorithms, the rule that
// picks one for a call, and every size that rule reads, in one place.
//   algorithm_table: per op, its small and large message algorithms, the
//     option whose size divides them, and whether it also meets in a host's
//     arena (shared_memory) or goes through the hosts (hierarchical);
//   arena_all_reduce_thresholds, and the table's arena_max: the sizes the
//     arena's algorithms choose their way by (fixed; the messages' are
//     options: backend_options' small_*);
//   choose / dispatcher::in_arena: the rule; dispatcher: the rule applied to
//     a call, and the algorithm run (cpu/algorithms/<op>.hpp and
//     shared_memory.hpp hold the algorithms themselves);
//   describe_algorithms: the table in force, which DCOMM_LOG_LEVEL=info
//     prints at start-up (as NCCL_DEBUG=INFO prints NCCL's).
// Every default size here and in backend_options is one measured on the
// machines in docs/performance.md ("The thresholds" says which run set which).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cpu/algorithms/all_gather.hpp"
#include "dcomm/cpu/algorithms/all_reduce.hpp"
#include "dcomm/cpu/algorithms/all_to_all.hpp"
#include "dcomm/cpu/algorithms/barrier.hpp"
#include "dcomm/cpu/algorithms/broadcast.hpp"
#include "dcomm/cpu/algorithms/gather.hpp"
#include "dcomm/cpu/algorithms/hierarchical.hpp"
#include "dcomm/cpu/algorithms/reduce.hpp"
#include "dcomm/cpu/algorithms/reduce_scatter.hpp"
#include "dcomm/cpu/algorithms/scatter.hpp"
#include "dcomm/cpu/algorithms/shared_memory.hpp"
#include "dcomm/cpu/backend_options.hpp"
#include "dcomm/cpu/call.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/error.hpp"

namespace dcomm::cpu {

inline constexpr std::size_t no_limit = std::numeric_limits<std::size_t>::max();

// The arena's all_reduce (shm_all_reduce): one step up to 16 KiB; one copy
// (process_vm_readv) from 1 to 16 MiB, in place from 4 MiB only (below, and
// above 16 MiB, the slots measured faster: docs/performance.md, "The
// thresholds").
inline constexpr arena_all_reduce_sizes arena_all_reduce_thresholds{.one_pass_max = 16 * 1024,
                                                                    .direct_min = 1 << 20,
                                                                    .direct_max = 16 << 20,
                                                                    .direct_in_place_min = 4 << 20};

// One row of the table: the algorithms of a collective, for small and for
// large messages (the same where it has one), chosen by size unless a call
// or DCOMM_ALGO asks for one of them. The size an op measures: its buffer
// (a slice's, for a CUDA tensor that goes slice by slice), all_gather its
// whole output, reduce_scatter its whole input.
struct algorithm_choice {
  operation op;
  algorithm small = algorithm::direct, large = algorithm::direct;
  // The option that holds the size up to which `small` runs (bytes);
  // none: one algorithm, whatever the size.
  std::size_t backend_options::*limit = nullptr;
  // The large algorithm gives each rank a part of the elements: with fewer
  // elements than ranks the small one runs, whatever the size.
  bool part_per_rank = false;
  // It also has algorithm::shared_memory (cpu/algorithms/shared_memory.hpp),
  // which runs, up to arena_max bytes, where the group has an arena (its
  // ranks all share a host: dispatcher::in_arena), unless a call asks for
  // another (asked for, at any size).
  bool shared_memory = false;
  std::size_t arena_max = no_limit;
  // And algorithm::hierarchical (cpu/algorithms/hierarchical.hpp), which
  // runs, whatever the size, where the group spans hosts with several of
  // its ranks on some (host_layout::spans), unless a call asks for another.
  bool hierarchical = false;
};

// Barrier has one message algorithm (dissemination, named automatic) and
// no size to choose by; reduce shares broadcast's limit, and meets in the
// arena up to 64 KiB only (its root reduces alone: above, the messages'
// algorithms measured faster; docs/performance.md, "The thresholds").
inline constexpr algorithm_choice algorithm_table[] = {
    {.op = operation::barrier,
     .small = algorithm::automatic,
     .large = algorithm::automatic,
     .shared_memory = true,
     .hierarchical = true},
    {.op = operation::broadcast,
     .small = algorithm::binomial_tree,
     .large = algorithm::chain,
     .limit = &backend_options::small_broadcast,
     .shared_memory = true,
     .hierarchical = true},
    {.op = operation::reduce,
     .small = algorithm::binomial_tree,
     .large = algorithm::chain,
     .limit = &backend_options::small_broadcast,
     .shared_memory = true,
     .arena_max = 64 * 1024},
    {.op = operation::all_reduce,
     .small = algorithm::recursive_doubling,
     .large = algorithm::ring,
     .limit = &backend_options::small_all_reduce,
     .part_per_rank = true,
     .shared_memory = true,
     .hierarchical = true},
    {.op = operation::scatter},
    {.op = operation::gather},
    {.op = operation::all_gather,
     .large = algorithm::ring,
     .limit = &backend_options::small_all_gather,
     .shared_memory = true},
    {.op = operation::reduce_scatter,
     .large = algorithm::ring,
     .limit = &backend_options::small_reduce_scatter},
    {.op = operation::all_to_all},
    {.op = operation::all_gather_v},
    {.op = operation::all_to_all_v},
};

inline const algorithm_choice& algorithms_of(operation op) {
  for (const auto& c : algorithm_table)
    if (c.op == op) return c;
  return algorithm_table[0];
}

// The size up to which the small algorithm of `c` runs, with options `o`.
inline std::size_t limit_of(const backend_options& o, const algorithm_choice& c) {
  return c.limit ? o.*c.limit : no_limit;
}

// Whether `op` has a row in the table (a collective the backend runs).
inline bool has_algorithms(operation op) {
  for (const auto& c : algorithm_table)
    if (c.op == op) return true;
  return false;
}

// Empty if `a` may be asked of `op`, else why not.
inline std::string refuse_algorithm(operation op, algorithm a) {
  if (a == algorithm::automatic) return {};
  const std::string what =
      "algorithm " + std::string(dcomm::name(a)) + " is not available for " + dcomm::name(op);
  if (!has_algorithms(op)) return what + " (it has no algorithm to choose: leave it automatic)";
  const algorithm_choice& c = algorithms_of(op);
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
  return what + " (it has " + list + ")";
}

// The ops of the table, as DCOMM_ALGO names them: "barrier, broadcast, ...".
inline std::string collective_names() {
  std::string names;
  for (const auto& c : algorithm_table)
    names += (names.empty() ? "" : ", ") + std::string(dcomm::name(c.op));
  return names;
}

// "all_reduce=ring,broadcast=chain" (the DCOMM_ALGO variable) as overrides.
inline std::map<operation, algorithm> parse_algorithm_overrides(std::string_view spec) {
  std::map<operation, algorithm> out;
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
    const std::optional<operation> op = parse_operation(op_name);
    if (!op || !has_algorithms(*op))
      fail("unknown operation '" + std::string(op_name) +
           "' (one of the collectives: " + collective_names() + ")");
    if (auto why = refuse_algorithm(*op, *a); !why.empty()) fail(why);
    out[*op] = *a;
  }
  return out;
}

// A call's size as the table's limits measure it.
struct call_size {
  std::size_t bytes = 0;
  std::size_t count = 0;  // elements
};

// What a call of `op` runs: the algorithm it asked for, else the table's by
// size, with the limits of `o`. A world of one runs the small algorithm,
// which does without messages (the large ones assume a ring or chain of two
// ranks or more). Empty: `asked` is not one of the op's (refuse_algorithm
// says why; the front end refuses such a call before it starts, by the
// operation's name). `across_hosts`: the group spans hosts with several of
// its ranks on some.
inline std::optional<algorithm> choose(operation op, algorithm asked, call_size size, int world,
                                       const backend_options& o, bool across_hosts = false) {
  const auto& c = algorithms_of(op);
  const bool hierarchical = c.hierarchical && asked == algorithm::hierarchical;
  if (asked != algorithm::automatic && asked != c.small && asked != c.large && !hierarchical)
    return std::nullopt;
  if (world <= 1) return c.small;
  if (asked != algorithm::automatic) return asked;
  if (c.hierarchical && across_hosts) return algorithm::hierarchical;
  const bool small = size.bytes <= limit_of(o, c) ||
                     (c.part_per_rank && size.count < static_cast<std::size_t>(world));
  return small ? c.small : c.large;
}

// The table in force with options `o` and DCOMM_ALGO's `overrides`, in one
// line: "all_reduce recursive_doubling up to 65536 B, ring above (or fewer
// elements than ranks: recursive_doubling); shared_memory in a host's
// arena; hierarchical across hosts | ...".
inline std::string describe_algorithms(const backend_options& o,
                                       const std::map<operation, algorithm>& overrides) {
  std::string line;
  for (const algorithm_choice& row : algorithm_table) {
    if (!line.empty()) line += " | ";
    line += std::string(dcomm::name(row.op)) + " ";
    if (auto forced = overrides.find(row.op); forced != overrides.end()) {
      line += std::string(dcomm::name(forced->second)) + " (DCOMM_ALGO)";
      continue;
    }
    const std::string small = row.small == algorithm::automatic && row.op == operation::barrier
                                  ? "dissemination"
                                  : std::string(dcomm::name(row.small));
    if (!row.limit || row.large == row.small) {
      line += small;
    } else {
      line += small + " up to " + std::to_string(limit_of(o, row)) + " B" +
              (row.part_per_rank ? " (or fewer elements than ranks)" : "") + ", " +
              std::string(dcomm::name(row.large)) + " above";
    }
    if (row.shared_memory)
      line += "; shared_memory in a host's arena" +
              (row.arena_max == no_limit ? std::string()
                                         : " up to " + std::to_string(row.arena_max) + " B");
    if (row.op == operation::all_reduce) {
      const auto& t = arena_all_reduce_thresholds;
      line += " (one pass up to " + std::to_string(t.one_pass_max) + " B, one copy " +
              std::to_string(t.direct_min) + "-" + std::to_string(t.direct_max) +
              " B, in place from " + std::to_string(t.direct_in_place_min) + " B)";
    }
    if (row.hierarchical) line += "; hierarchical across hosts";
  }
  return line;
}

// The dispatch of one backend: its options, DCOMM_ALGO's overrides, and for
// each collective the rule applied to a call and the algorithm run. The
// runners return the algorithm's task without a coroutine frame of their
// own (a call's run() awaits it).
class dispatcher {
 public:
  // Throws errc::invalid_argument where DCOMM_ALGO (o.algorithms) asks for
  // what an op does not have.
  explicit dispatcher(const backend_options& o)
      : o_(o), overrides_(parse_algorithm_overrides(o.algorithms)) {}

  const backend_options& options() const { return o_; }

  // The algorithm a call asks for: its own (op_options::algorithm), else
  // DCOMM_ALGO's for the op, else automatic. The call's signature carries
  // it, so ranks that ask for different ones fail with errc::mismatch.
  algorithm requested(operation op, algorithm asked) const {
    if (asked != algorithm::automatic) return asked;
    auto o = overrides_.find(op);
    return o == overrides_.end() ? algorithm::automatic : o->second;
  }

  // Whether a call of `op` moving `bytes` meets in its group's arena: the
  // op has a shared memory algorithm, the call asks for it (any size) or
  // for none (up to the row's arena_max), and the group has an arena
  // (`serves()`: its ranks all share this host; the world's is the host's,
  // another group claims its own while the host has one free, so it is
  // asked only where the answer matters). Asked for where the group has
  // none, it is refused on every rank alike.
  template <class Serves>
  bool in_arena(operation op, algorithm asked, std::size_t bytes, Serves serves, const char* called,
                int rank) const {
    const algorithm_choice& row = algorithms_of(op);
    if (!row.shared_memory) return false;
    const algorithm a = requested(op, asked);
    if (a == algorithm::automatic) return bytes <= row.arena_max && serves();
    if (a != algorithm::shared_memory) return false;
    if (serves()) return true;
    throw_error(errc::invalid_argument,
                {.operation = called,
                 .rank = rank,
                 .detail = "algorithm shared_memory needs a group whose ranks all share this "
                           "host (links not set to tcp) and an arena for it: the world's, or "
                           "one of the host's " +
                           std::to_string(shm::group_arenas) +
                           " group arenas, which the first groups made claim"});
  }

  // The algorithm a call runs (cpu::choose: the one its signature asks
  // for, else the table's by `size`), said to the call's report. One the op
  // does not have fails the call; the front end refused it before, by the
  // operation's name.
  algorithm choose(call& c, operation op, call_size size = {}) const {
    const algorithm asked = c.signature().algo;
    const bool across_hosts = algorithms_of(op).hierarchical && c.hosts().spans();
    if (auto a = cpu::choose(op, asked, size, c.size(), o_, across_hosts)) {
      c.ran(*a);
      return *a;
    }
    c.invalid(refuse_algorithm(op, asked));
  }

  std::string describe() const { return describe_algorithms(o_, overrides_); }

  // --- Collectives by messages, on whole buffers or one slice of a staged
  // CUDA tensor ---
  detail::task<void> barrier(call& c) const {
    if (choose(c, operation::barrier) == algorithm::hierarchical)
      return hierarchical_barrier(c, c.hosts());
    return dissemination_barrier(c);
  }
  detail::task<void> broadcast(call& c, void* data, std::size_t bytes, int root) const {
    switch (choose(c, operation::broadcast, {.bytes = bytes})) {
      case algorithm::hierarchical:
        return hierarchical_broadcast(c, c.hosts(), data, bytes, root, *this);
      case algorithm::binomial_tree:
        return binomial_broadcast(c, data, bytes, root);
      default:
        return chain_broadcast(c, data, bytes, root, o_.chunk_bytes);
    }
  }
  detail::task<void> reduce(call& c, const void* in, void* out, std::size_t count, dtype type,
                            const reducer& op, int root) const {
    const std::size_t es = size_of(type);
    if (choose(c, operation::reduce, {.bytes = count * es, .count = count}) ==
        algorithm::binomial_tree)
      return binomial_reduce(c, in, out, count, es, op, root);
    return chain_reduce(c, in, out, count, es, op, root, o_.chunk_bytes);
  }
  detail::task<void> all_reduce(call& c, const void* in, void* out, std::size_t count, dtype type,
                                const reducer& op) const {
    const std::size_t es = size_of(type);
    switch (choose(c, operation::all_reduce, {.bytes = count * es, .count = count})) {
      case algorithm::hierarchical:
        return hierarchical_all_reduce(c, c.hosts(), in, out, count, es, op, *this);
      case algorithm::recursive_doubling:
        if (in != out && count) std::memcpy(out, in, count * es);
        return recursive_doubling_all_reduce(c, out, count, es, op);
      default:
        return ring_all_reduce(c, in == out ? nullptr : in, out, count, es, op, o_.chunk_bytes);
    }
  }
  detail::task<void> scatter(call& c, const void* in, void* out, std::size_t bytes,
                             int root) const {
    choose(c, operation::scatter);
    return direct_scatter(c, in, out, bytes, root);
  }
  detail::task<void> gather(call& c, const void* in, void* out, std::size_t bytes, int root) const {
    choose(c, operation::gather);
    return direct_gather(c, in, out, bytes, root);
  }
  // `count` elements of this rank's block; the size chosen by is the whole
  // output's.
  detail::task<void> all_gather(call& c, const void* in, void* out, std::size_t count,
                                dtype type) const {
    const std::size_t es = size_of(type);
    const std::size_t whole = count * es * static_cast<std::size_t>(c.size());
    if (choose(c, operation::all_gather, {.bytes = whole}) == algorithm::direct)
      return direct_all_gather(c, in, out, count, es);
    return ring_all_gather(c, in, out, count, es, o_.chunk_bytes);
  }
  // `count` elements of the output block; the size chosen by is the whole
  // input's.
  detail::task<void> reduce_scatter(call& c, const void* in, void* out, std::size_t count,
                                    dtype type, const reducer& op) const {
    const std::size_t es = size_of(type);
    const std::size_t whole = count * es * static_cast<std::size_t>(c.size());
    if (choose(c, operation::reduce_scatter, {.bytes = whole}) == algorithm::direct)
      return direct_reduce_scatter(c, in, out, count, es, op);
    return ring_reduce_scatter(c, in, out, count, es, op, o_.chunk_bytes);
  }
  detail::task<void> all_to_all(call& c, const void* in, void* out, std::size_t block) const {
    choose(c, operation::all_to_all);
    return direct_all_to_all(c, in, out, block);
  }
  detail::task<std::vector<std::size_t>> all_gather_v(call& c, const const_tensor_view& in,
                                                      const output_allocator& alloc) const {
    choose(c, operation::all_gather_v);
    return direct_all_gather_v(c, in, alloc);
  }
  detail::task<std::vector<std::size_t>> all_to_all_v(call& c, const const_tensor_view& in,
                                                      const std::vector<std::size_t>& send_counts,
                                                      const output_allocator& alloc) const {
    choose(c, operation::all_to_all_v);
    return direct_all_to_all_v(c, in, send_counts, alloc);
  }

  // --- Collectives in the group's arena (in_arena said so) ---
  // Barrier and a one-pass all_reduce first try at once, without a
  // coroutine frame (call::at_once): false, the caller co_awaits run() of
  // the task.
  static bool arena_barrier_at_once(arena_call& a) { return shm_barrier_at_once(a); }
  static detail::task<void> arena_barrier(arena_call& a) { return shm_barrier(a); }
  static bool arena_all_reduce_at_once(arena_call& a, const void* in, void* out, std::size_t count,
                                       dtype type, const reducer& op) {
    return shm_all_reduce_at_once(a, in, out, count, size_of(type), op,
                                  arena_all_reduce_thresholds);
  }
  static detail::task<void> arena_all_reduce(call& c, arena_call& a, const void* in, void* out,
                                             std::size_t count, dtype type, const reducer& op) {
    return shm_all_reduce(c, a, in, out, count, size_of(type), op, arena_all_reduce_thresholds);
  }
  static detail::task<void> arena_broadcast(call& c, void* data, std::size_t bytes, int root) {
    return shm_broadcast(c, data, bytes, root);
  }
  static detail::task<void> arena_reduce(call& c, const void* in, void* out, std::size_t count,
                                         dtype type, const reducer& op, int root) {
    return shm_reduce(c, in, out, count, size_of(type), op, root);
  }
  static detail::task<void> arena_all_gather(call& c, const void* in, void* out,
                                             std::size_t bytes) {
    return shm_all_gather(c, in, out, bytes);
  }

  // --- What a hierarchical call's phases run (cpu/algorithms/hierarchical.hpp's
  // Flat): the flat algorithms among the view's ranks, as a flat call of
  // that size would choose them ---
  bool large(operation op, std::size_t bytes, std::size_t count, int ranks) const {
    const algorithm_choice& row = algorithms_of(op);
    return cpu::choose(op, algorithm::automatic, {.bytes = bytes, .count = count}, ranks, o_) ==
               row.large &&
           row.large != row.small;
  }
  std::size_t chunk_bytes() const { return o_.chunk_bytes; }
  DCOMM_EMIT_ON_USE detail::task<void> flat_all_reduce(call& c, void* buf, std::size_t count,
                                                       std::size_t es,
                                                       const reducer& partial) const;
  DCOMM_EMIT_ON_USE detail::task<void> flat_reduce(call& c, const void* in, void* out,
                                                   std::size_t count, std::size_t es,
                                                   const reducer& partial, int root) const;
  DCOMM_EMIT_ON_USE detail::task<void> flat_broadcast(call& c, void* buf, std::size_t bytes,
                                                      int root) const;

 private:
  backend_options o_;
  std::map<operation, algorithm> overrides_;  // DCOMM_ALGO's
};

DCOMM_EMIT_ON_USE_DEFINITION auto dispatcher::flat_all_reduce(call& c, void* buf, std::size_t count,
                                                              std::size_t es,
                                                              const reducer& partial) const
    -> detail::task<void> {
  if (c.size() <= 1) co_return;
  if (large(operation::all_reduce, count * es, count, c.size()))
    co_await ring_all_reduce(c, nullptr, buf, count, es, partial, o_.chunk_bytes);
  else
    co_await recursive_doubling_all_reduce(c, buf, count, es, partial);
}

DCOMM_EMIT_ON_USE_DEFINITION auto dispatcher::flat_reduce(call& c, const void* in, void* out,
                                                          std::size_t count, std::size_t es,
                                                          const reducer& partial, int root) const
    -> detail::task<void> {
  if (c.size() <= 1) {
    if (in != out && count) std::memcpy(out, in, count * es);
    co_return;
  }
  if (large(operation::reduce, count * es, count, c.size()))
    co_await chain_reduce(c, in, out, count, es, partial, root, o_.chunk_bytes);
  else
    co_await binomial_reduce(c, in, out, count, es, partial, root);
}

DCOMM_EMIT_ON_USE_DEFINITION auto dispatcher::flat_broadcast(call& c, void* buf, std::size_t bytes,
                                                             int root) const -> detail::task<void> {
  if (c.size() <= 1) co_return;
  if (large(operation::broadcast, bytes, bytes, c.size()))
    co_await chain_broadcast(c, buf, bytes, root, o_.chunk_bytes);
  else
    co_await binomial_broadcast(c, buf, bytes, root);
}

}  // namespace dcomm::cpu

// Separate compilation (detail/asio.hpp): the hierarchical algorithms over
// this dispatcher's flat ones, compiled once in the library.
// clang-format off
DCOMM_INSTANTIATE(dcomm::detail::task<void> dcomm::cpu::hierarchical_all_reduce<dcomm::cpu::dispatcher>(call&, const host_layout&, const void*, void*, std::size_t, std::size_t, const reducer&, const dispatcher&))
DCOMM_INSTANTIATE(dcomm::detail::task<void> dcomm::cpu::hierarchical_broadcast<dcomm::cpu::dispatcher>(call&, const host_layout&, void*, std::size_t, int, const dispatcher&))
// clang-format on

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::dispatcher::flat_all_reduce<void>(call& c, void* buf, std::size_t count, std::size_t es, const reducer& partial) const -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::dispatcher::flat_reduce<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& partial, int root) const -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::dispatcher::flat_broadcast<void>(call& c, void* buf, std::size_t bytes, int root) const -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
