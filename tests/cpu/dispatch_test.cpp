// The CPU backend's choice of algorithm (cpu/algorithms/dispatch.hpp),
// without a network: what each op runs at sizes around its limit (the
// defaults of cpu_backend::options and others), in a world of one, when a
// call or DCOMM_ALGO asks for an algorithm, what is refused, when a call
// meets in the arena, what a hierarchical call's phases run, and the table
// as the log prints it. The algorithms themselves run in the "cpu
// collectives" suite.
#include <doctest/doctest.h>

#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/cpu_backend.hpp"
#include "support/text.hpp"

namespace {

using dcomm::algorithm;
using dcomm::operation;

constexpr std::size_t kib = 1024;
constexpr std::size_t huge = std::size_t{1} << 40;

// What a call of `op` moving `bytes` (as many elements: uint8) runs among
// `world` ranks, asking for `asked`.
std::optional<algorithm> pick(operation op, std::size_t bytes, int world = 4,
                              algorithm asked = algorithm::automatic,
                              const dcomm::cpu_backend::options& o = {}) {
  return dcomm::cpu::choose(op, asked, {.bytes = bytes, .count = bytes}, world, o);
}

using dcomm::test::contains;

// Default options but for DCOMM_ALGO's overrides (whatever the environment).
dcomm::cpu_backend::options with_algorithms(const char* spec) {
  dcomm::cpu_backend::options o;
  o.algorithms = spec;
  return o;
}

// The message DCOMM_ALGO=`spec` is refused with (empty: accepted).
std::string refusal_of(std::string_view spec) {
  try {
    dcomm::cpu::parse_algorithm_overrides(spec);
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::invalid_argument);
    CHECK(contains(e.what(), "DCOMM_ALGO"));
    return e.what();
  }
  return {};
}

}  // namespace

TEST_SUITE("cpu dispatch") {
  TEST_CASE(
      "defaults: each op's small algorithm up to its limit (docs/communicator.md), large above") {
    CHECK(pick(operation::all_reduce, 64 * kib) == algorithm::recursive_doubling);
    CHECK(pick(operation::all_reduce, 64 * kib + 1) == algorithm::ring);
    CHECK(pick(operation::broadcast, 256 * kib) == algorithm::binomial_tree);
    CHECK(pick(operation::broadcast, 256 * kib + 1) == algorithm::chain);
    CHECK(pick(operation::reduce, 256 * kib) == algorithm::binomial_tree);  // broadcast's limit
    CHECK(pick(operation::reduce, 256 * kib + 1) == algorithm::chain);
    CHECK(pick(operation::all_gather, 64 * kib) == algorithm::direct);
    CHECK(pick(operation::all_gather, 64 * kib + 1) == algorithm::ring);
    CHECK(pick(operation::reduce_scatter, 64 * kib) == algorithm::direct);
    CHECK(pick(operation::reduce_scatter, 64 * kib + 1) == algorithm::ring);
    CHECK(pick(operation::all_reduce, 0) == algorithm::recursive_doubling);
  }

  TEST_CASE("each op reads its own option's limit") {
    // Four different limits: an op that read another's would pick wrongly
    // on one side of its own.
    dcomm::cpu_backend::options o;
    o.small_all_reduce = 1000;
    o.small_broadcast = 2000;
    o.small_all_gather = 3000;
    o.small_reduce_scatter = 4000;
    struct row {
      operation op;
      std::size_t limit;
      algorithm small, large;
    };
    for (const row& r :
         {row{operation::all_reduce, 1000, algorithm::recursive_doubling, algorithm::ring},
          row{operation::broadcast, 2000, algorithm::binomial_tree, algorithm::chain},
          row{operation::reduce, 2000, algorithm::binomial_tree, algorithm::chain},
          row{operation::all_gather, 3000, algorithm::direct, algorithm::ring},
          row{operation::reduce_scatter, 4000, algorithm::direct, algorithm::ring}}) {
      CAPTURE(dcomm::name(r.op));
      CHECK(pick(r.op, 1, 4, algorithm::automatic, o) == r.small);
      CHECK(pick(r.op, r.limit - 1, 4, algorithm::automatic, o) == r.small);
      CHECK(pick(r.op, r.limit, 4, algorithm::automatic, o) == r.small);
      CHECK(pick(r.op, r.limit + 1, 4, algorithm::automatic, o) == r.large);
      CHECK(pick(r.op, huge, 4, algorithm::automatic, o) == r.large);
    }
  }

  TEST_CASE("ops with one algorithm run it at any size") {
    for (operation op : {operation::scatter, operation::gather, operation::all_to_all,
                         operation::all_gather_v, operation::all_to_all_v}) {
      CAPTURE(dcomm::name(op));
      CHECK(pick(op, 0) == algorithm::direct);
      CHECK(pick(op, huge) == algorithm::direct);
      CHECK(pick(op, huge, 4, algorithm::direct) == algorithm::direct);
    }
  }

  TEST_CASE("all_reduce with fewer elements than ranks runs recursive doubling at any size") {
    const dcomm::cpu_backend::options o;
    auto all_reduce = [&](std::size_t count, int world) {
      return dcomm::cpu::choose(operation::all_reduce, algorithm::automatic,
                                {.bytes = huge, .count = count}, world, o);
    };
    CHECK(all_reduce(3, 4) == algorithm::recursive_doubling);
    CHECK(all_reduce(4, 4) == algorithm::ring);
    CHECK(all_reduce(0, 2) == algorithm::recursive_doubling);
    // Only all_reduce's ring cuts the data per rank.
    CHECK(dcomm::cpu::choose(operation::all_gather, algorithm::automatic,
                             {.bytes = huge, .count = 1}, 4, o) == algorithm::ring);
  }

  TEST_CASE("a world of one runs the small algorithm, whatever the size or the request") {
    CHECK(pick(operation::all_reduce, huge, 1) == algorithm::recursive_doubling);
    CHECK(pick(operation::all_reduce, huge, 1, algorithm::ring) == algorithm::recursive_doubling);
    CHECK(pick(operation::reduce, huge, 1, algorithm::chain) == algorithm::binomial_tree);
    CHECK(pick(operation::broadcast, huge, 1) == algorithm::binomial_tree);
    CHECK(pick(operation::reduce_scatter, huge, 1, algorithm::ring) == algorithm::direct);
    CHECK(pick(operation::all_gather, huge, 1) == algorithm::direct);
    // Still refused: the request is checked before the world.
    CHECK(pick(operation::broadcast, 1, 1, algorithm::ring) == std::nullopt);
  }

  TEST_CASE("an algorithm the call asks for wins over the size") {
    CHECK(pick(operation::all_reduce, 8, 4, algorithm::ring) == algorithm::ring);
    CHECK(pick(operation::all_reduce, huge, 4, algorithm::recursive_doubling) ==
          algorithm::recursive_doubling);
    CHECK(pick(operation::broadcast, 1, 4, algorithm::chain) == algorithm::chain);
    CHECK(pick(operation::reduce, huge, 4, algorithm::binomial_tree) == algorithm::binomial_tree);
    CHECK(pick(operation::all_gather, huge, 4, algorithm::direct) == algorithm::direct);
    CHECK(pick(operation::reduce_scatter, 1, 4, algorithm::ring) == algorithm::ring);
  }

  TEST_CASE("requested: the call's algorithm, else DCOMM_ALGO's for the op, else automatic") {
    CHECK(dcomm::cpu::parse_algorithm_overrides("all_reduce=ring,broadcast=chain").size() == 2);
    const dcomm::cpu::dispatcher d(with_algorithms("all_reduce=ring,broadcast=chain"));
    CHECK(d.requested(operation::all_reduce, algorithm::automatic) == algorithm::ring);
    CHECK(d.requested(operation::all_reduce, algorithm::recursive_doubling) ==
          algorithm::recursive_doubling);
    CHECK(d.requested(operation::broadcast, algorithm::automatic) == algorithm::chain);
    CHECK(d.requested(operation::reduce, algorithm::automatic) == algorithm::automatic);
    const dcomm::cpu::dispatcher plain(with_algorithms(""));
    CHECK(plain.requested(operation::all_reduce, algorithm::automatic) == algorithm::automatic);
    // Then the override wins over the size, as a call's request does.
    CHECK(pick(operation::all_reduce, 8, 4,
               d.requested(operation::all_reduce, algorithm::automatic)) == algorithm::ring);
    // Empty items are skipped; the last of two for one op counts.
    const auto more =
        dcomm::cpu::parse_algorithm_overrides(",all_reduce=ring,,all_reduce=automatic,");
    CHECK(more.size() == 1);
    const dcomm::cpu::dispatcher last(with_algorithms(",all_reduce=ring,,all_reduce=automatic,"));
    CHECK(last.requested(operation::all_reduce, algorithm::automatic) == algorithm::automatic);
    CHECK(dcomm::cpu::parse_algorithm_overrides("").empty());
    // A dispatcher refuses what DCOMM_ALGO asks wrongly, as start-up does.
    CHECK_THROWS_AS(dcomm::cpu::dispatcher(with_algorithms("broadcast=ring")), dcomm::error);
  }

  TEST_CASE("refusals: an algorithm the op does not have, from a call or DCOMM_ALGO") {
    CHECK(pick(operation::broadcast, 1, 4, algorithm::ring) == std::nullopt);
    CHECK(pick(operation::all_reduce, 1, 4, algorithm::chain) == std::nullopt);
    CHECK(pick(operation::scatter, 1, 4, algorithm::ring) == std::nullopt);
    CHECK(pick(operation::barrier, 1, 4, algorithm::direct) == std::nullopt);

    using dcomm::cpu::refuse_algorithm;
    CHECK(refuse_algorithm(operation::all_reduce, algorithm::ring).empty());
    CHECK(refuse_algorithm(operation::barrier, algorithm::automatic).empty());
    CHECK(refuse_algorithm(operation::send, algorithm::automatic).empty());
    const auto broadcast_ring = refuse_algorithm(operation::broadcast, algorithm::ring);
    CHECK(contains(broadcast_ring, "algorithm ring is not available for broadcast"));
    CHECK(
        contains(broadcast_ring, "(it has binomial_tree, chain, shared_memory and hierarchical)"));
    CHECK(contains(refuse_algorithm(operation::scatter, algorithm::ring), "(it has direct)"));
    CHECK(contains(refuse_algorithm(operation::barrier, algorithm::direct),
                   "(it has one message algorithm: leave it automatic; or shared_memory and "
                   "hierarchical)"));
    CHECK(contains(refuse_algorithm(operation::send, algorithm::ring),
                   "it has no algorithm to choose"));

    CHECK(refusal_of("all_reduce=ring,broadcast=binomial_tree").empty());
    CHECK(contains(refusal_of("all_reduce"), "'all_reduce' has no '='"));
    CHECK(contains(refusal_of("all_reduce=fastest"), "unknown algorithm 'fastest'"));
    CHECK(contains(refusal_of("allreduce=ring"), "unknown operation 'allreduce'"));
    CHECK(contains(refusal_of("broadcast=ring"), "(it has binomial_tree, chain, shared_memory"));
    // Every collective of the table, the _v forms too; no other operation.
    CHECK(refusal_of("all_gather_v=direct,all_to_all_v=direct,reduce_scatter=ring").empty());
    CHECK(contains(refusal_of("send=direct"),
                   "unknown operation 'send' (one of the collectives: "
                   "barrier, broadcast, reduce, all_reduce"));
    CHECK(contains(refusal_of("broadcast_object=chain"), "unknown operation 'broadcast_object'"));
  }

  TEST_CASE("the table has one row per collective, found by its op") {
    for (int i = static_cast<int>(operation::barrier);
         i <= static_cast<int>(operation::all_to_all_v); ++i) {
      const auto op = static_cast<operation>(i);
      CAPTURE(dcomm::name(op));
      CHECK(dcomm::cpu::algorithms_of(op).op == op);
    }
  }

  TEST_CASE("across hosts all_reduce, broadcast and barrier go through the hosts, unless asked") {
    const dcomm::cpu_backend::options o;
    auto across = [&](std::size_t bytes, algorithm asked = algorithm::automatic) {
      return dcomm::cpu::choose(operation::all_reduce, asked, {.bytes = bytes, .count = bytes}, 4,
                                o, true);
    };
    CHECK(across(4) == algorithm::hierarchical);
    CHECK(across(64 * 1024 * 1024) == algorithm::hierarchical);
    CHECK(across(4, algorithm::ring) == algorithm::ring);
    CHECK(across(4, algorithm::recursive_doubling) == algorithm::recursive_doubling);
    CHECK(pick(operation::all_reduce, 4, 4, algorithm::hierarchical) == algorithm::hierarchical);
    CHECK(pick(operation::all_reduce, 4) == algorithm::recursive_doubling);  // one host
    // So do broadcast and barrier; the others stay flat.
    for (auto op : {operation::broadcast, operation::barrier}) {
      CAPTURE(dcomm::name(op));
      CHECK(dcomm::cpu::choose(op, algorithm::automatic, {.bytes = 4}, 4, o, true) ==
            algorithm::hierarchical);
      CHECK(dcomm::cpu::choose(op, algorithm::automatic, {.bytes = 4}, 4, o, false) !=
            algorithm::hierarchical);
      CHECK(dcomm::cpu::refuse_algorithm(op, algorithm::hierarchical).empty());
    }
    CHECK(dcomm::cpu::choose(operation::broadcast, algorithm::chain, {.bytes = 4}, 4, o, true) ==
          algorithm::chain);
    CHECK(dcomm::cpu::choose(operation::all_gather, algorithm::automatic, {.bytes = 4}, 4, o,
                             true) == algorithm::direct);
    CHECK(pick(operation::reduce, 4, 4, algorithm::hierarchical) == std::nullopt);
    CHECK(dcomm::cpu::refuse_algorithm(operation::all_reduce, algorithm::hierarchical).empty());
    CHECK(refusal_of("all_reduce=hierarchical,broadcast=hierarchical").empty());
    CHECK(contains(refusal_of("reduce=hierarchical"),
                   "(it has binomial_tree, chain and shared_memory)"));
    CHECK(contains(refusal_of("all_reduce=chain"),
                   "(it has recursive_doubling, ring, shared_memory and hierarchical)"));
  }

  TEST_CASE("host layout: hosts in order of their lowest rank, stripes where hosts are even") {
    using dcomm::cpu::make_host_layout;
    dcomm::group_state world;
    world.ranks = {0, 1, 2, 3, 4, 5};
    // Global ranks 0, 2, 4 on host 0; 1, 3, 5 on host 1 (interleaved).
    const std::vector<int> host_of{0, 1, 0, 1, 0, 1};
    world.rank = 3;
    auto h = make_host_layout(world, host_of);
    CHECK(h.spans());
    CHECK(h.hosts == 2);
    CHECK(h.local == std::vector<int>{1, 3, 5});
    CHECK(h.local_rank == 1);
    CHECK(h.leaders == std::vector<int>{0, 1});
    CHECK(h.host_rank == 1);
    CHECK(h.uniform);
    CHECK(h.peers == std::vector<int>{2, 3});
    CHECK(h.host_index == std::vector<int>{0, 1, 0, 1, 0, 1});
    CHECK(h.local_index == std::vector<int>{0, 0, 1, 1, 2, 2});
    // A large broadcast's chain from rank 3 (host 1's second): 3 -> 5 -> 1,
    // then host 0: 0 -> 2 -> 4. Each rank's (prev, next).
    const std::vector<std::pair<int, int>> chain{{1, 2}, {5, 0}, {0, 4}, {-1, 5}, {2, -1}, {3, 1}};
    for (int r = 0; r < 6; ++r) {
      CAPTURE(r);
      CHECK(dcomm::cpu::host_chain_neighbours(h, 3, r) == chain[static_cast<std::size_t>(r)]);
    }
    // A group of global ranks 5, 4, 1 (group ranks 0, 1, 2): 5 and 1 share a host.
    dcomm::group_state sub;
    sub.ranks = {5, 4, 1};
    sub.rank = 1;
    h = make_host_layout(sub, host_of);
    CHECK(h.spans());
    CHECK(h.local == std::vector<int>{1});
    CHECK(h.leaders == std::vector<int>{0, 1});
    CHECK(h.host_rank == 1);
    CHECK_FALSE(h.uniform);
    CHECK(h.peers.empty());
    // Every rank its own host, or all on one: nothing to go through.
    CHECK_FALSE(make_host_layout(world, {}).spans());
    CHECK_FALSE(make_host_layout(world, {7, 7, 7, 7, 7, 7}).spans());
    CHECK(make_host_layout(world, {7, 7, 7, 7, 7, 7}).local.size() == 6);
  }

  TEST_CASE(
      "in_arena: every op with an arena form, reduce up to 64 KiB unless asked; asked "
      "without an arena, refused") {
    const dcomm::cpu::dispatcher d(with_algorithms(""));
    int asked_arena = 0;
    auto yes = [&] {
      ++asked_arena;
      return true;
    };
    auto no = [&] {
      ++asked_arena;
      return false;
    };
    auto in_arena = [&](operation op, std::size_t bytes, auto serves,
                        algorithm asked = algorithm::automatic) {
      return d.in_arena(op, asked, bytes, serves, "op", 0);
    };
    for (operation op :
         {operation::barrier, operation::broadcast, operation::all_reduce, operation::all_gather}) {
      CAPTURE(dcomm::name(op));
      CHECK(in_arena(op, huge, yes));
      CHECK_FALSE(in_arena(op, 4, no));
      // Another algorithm asked for (barrier's message one has no name).
      const algorithm other =
          op == operation::barrier ? algorithm::hierarchical : dcomm::cpu::algorithms_of(op).large;
      CHECK_FALSE(in_arena(op, 4, yes, other));
    }
    CHECK(in_arena(operation::reduce, 64 * kib, yes));
    asked_arena = 0;
    // Above its limit a reduce keeps its messages, and does not ask for an
    // arena (a group's is claimed on the first ask).
    CHECK_FALSE(in_arena(operation::reduce, 64 * kib + 1, yes));
    CHECK(asked_arena == 0);
    CHECK(in_arena(operation::reduce, huge, yes, algorithm::shared_memory));
    for (operation op : {operation::scatter, operation::gather, operation::reduce_scatter,
                         operation::all_to_all, operation::all_gather_v, operation::all_to_all_v})
      CHECK_FALSE(in_arena(op, 4, yes));
    CHECK_THROWS_WITH_AS(in_arena(operation::all_reduce, 4, no, algorithm::shared_memory),
                         doctest::Contains("algorithm shared_memory needs a group"), dcomm::error);
    // DCOMM_ALGO's shared_memory counts as the call's own request.
    const dcomm::cpu::dispatcher forced(with_algorithms("reduce=shared_memory"));
    CHECK(forced.in_arena(operation::reduce, algorithm::automatic, huge, yes, "reduce", 0));
  }

  TEST_CASE("a hierarchical call's phases choose as a flat call would, with the same options") {
    dcomm::cpu_backend::options o = with_algorithms("");
    o.small_all_reduce = 1000;
    o.small_broadcast = 2000;
    const dcomm::cpu::dispatcher d(o);
    CHECK_FALSE(d.large(operation::all_reduce, 1000, 1000, 2));
    CHECK(d.large(operation::all_reduce, 1001, 1001, 2));
    CHECK_FALSE(d.large(operation::all_reduce, 1001, 1, 2));  // fewer elements than ranks
    CHECK_FALSE(d.large(operation::all_reduce, huge, huge, 1));
    CHECK_FALSE(d.large(operation::broadcast, 2000, 2000, 3));
    CHECK(d.large(operation::broadcast, 2001, 2001, 3));
    CHECK(d.large(operation::reduce, 2001, 1, 3));  // reduce's chain needs no element per rank
    CHECK_FALSE(d.large(operation::scatter, huge, huge, 4));  // one algorithm
    CHECK(d.chunk_bytes() == o.chunk_bytes);
  }

  TEST_CASE("the table as DCOMM_LOG_LEVEL=info prints it: options and DCOMM_ALGO applied") {
    const std::string plain = dcomm::cpu::dispatcher(with_algorithms("")).describe();
    CHECK(contains(plain,
                   "barrier dissemination; shared_memory in a host's arena; hierarchical "
                   "across hosts | broadcast binomial_tree up to 262144 B, chain above"));
    CHECK(contains(plain,
                   "all_reduce recursive_doubling up to 65536 B (or fewer elements than "
                   "ranks), ring above; shared_memory in a host's arena (one pass up to "
                   "16384 B, one copy 1048576-16777216 B, in place from 4194304 B); "
                   "hierarchical across hosts"));
    CHECK(contains(plain,
                   "reduce binomial_tree up to 262144 B, chain above; shared_memory in a "
                   "host's arena up to 65536 B |"));
    CHECK(contains(plain, "| scatter direct |"));
    CHECK(contains(plain, "all_to_all_v direct"));
    dcomm::cpu_backend::options o = with_algorithms("broadcast=chain");
    o.small_all_reduce = 1000;
    const std::string tuned = dcomm::cpu::dispatcher(o).describe();
    CHECK(contains(tuned, "all_reduce recursive_doubling up to 1000 B"));
    CHECK(contains(tuned, "| broadcast chain (DCOMM_ALGO) |"));
  }
}
