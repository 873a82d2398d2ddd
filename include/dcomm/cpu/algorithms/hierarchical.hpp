// The hierarchical collectives of the CPU backend, for groups whose ranks
// span hosts with several ranks on some (cpu/startup/hosts.hpp): most bytes move
// inside a host, over shared memory, and few between hosts, over TCP. Each
// phase runs one of the flat algorithms among some of the group's ranks
// (call::view), on steps of its own.
//   hierarchical_all_reduce, large messages and as many ranks on every
//     host: reduce-scatter inside the host (ring), so that local rank i
//     holds the host's sum of block i; all_reduce of block i among the
//     ranks with local index i, one per host (every rank carries a stripe
//     between hosts); all-gather inside the host (ring).
//   hierarchical_all_reduce, otherwise: reduce to each host's leader (its
//     lowest rank); all_reduce among the leaders; broadcast from the leader
//     inside the host.
//   hierarchical_broadcast, small messages: from the root inside its host
//     (binomial tree); from its host's leader among the leaders; from each
//     other leader inside its host. Large ones: one pipelined chain that
//     goes through the root's host (from the root on), then through each
//     following host in turn. Either way the buffer enters each other host
//     once, whatever the root.
//   hierarchical_barrier: each host's ranks report to their leader; the
//     leaders run the dissemination barrier; each leader releases its
//     host. Messages between hosts: the leaders' log2(hosts) rounds.
// The phases combine without finishing (avg's division, premul_sum's
// scaling); the result is finished once, with the group's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "dcomm/cpu/algorithms/all_reduce.hpp"
#include "dcomm/cpu/algorithms/barrier.hpp"
#include "dcomm/cpu/algorithms/broadcast.hpp"
#include "dcomm/cpu/algorithms/reduce.hpp"
#include "dcomm/cpu/algorithms/ring.hpp"
#include "dcomm/cpu/call.hpp"
#include "dcomm/cpu/startup/hosts.hpp"
#include "dcomm/reduce_op.hpp"

namespace dcomm::cpu {

// The phases run the flat algorithms the backend's dispatch chooses
// (cpu/algorithms/dispatch.hpp: dispatcher), as a flat call of the phase's
// size among the view's ranks would run them, with the same thresholds.
// `Flat` is that dispatch:
//   bool large(operation op, std::size_t bytes, std::size_t count, int ranks):
//     a flat call of `op` would run its large algorithm;
//   flat_all_reduce(call&, void* buf, count, es, const reducer&): in place;
//   flat_reduce(call&, const void* in, void* out, count, es, const reducer&, int root);
//   flat_broadcast(call&, void* buf, std::size_t bytes, int root);
//   std::size_t chunk_bytes(): the pipelining unit.
// Each flat_* does nothing in a view of one rank.

// Steps of phase k of a hierarchical call (below a slice's 2^24).
inline constexpr std::uint32_t hierarchy_phase_steps = 1u << 22;

// Sets the call's view to the ranks in `members` (of which this rank is
// `rank`) for phase `phase`, and back to the whole group when it goes.
class phase_view {
 public:
  phase_view(call& c, const std::vector<int>& members, int rank, std::uint32_t phase) : c_(c) {
    c_.set_view({.members = members.data(),
                 .size = static_cast<int>(members.size()),
                 .rank = rank,
                 .step_offset = phase * hierarchy_phase_steps});
  }
  phase_view(const phase_view&) = delete;
  phase_view& operator=(const phase_view&) = delete;
  ~phase_view() { c_.set_view({}); }

 private:
  call& c_;
};

// `op` combining only: the finishing step (avg, premul_sum) left out.
inline reducer combining_only(const reducer& op) {
  reducer r = op;
  if (detail::is_finished_sum(r.kind)) r.kind = reduce_kind::sum;
  return r;
}

template <class Flat>
detail::task<void> hierarchical_all_reduce(call& c, const host_layout& h, const void* in, void* out,
                                           std::size_t count, std::size_t es, const reducer& op,
                                           const Flat& flat) {
  const reducer partial = combining_only(op);
  const std::size_t bytes = count * es;
  const int local = static_cast<int>(h.local.size());
  if (h.uniform && local > 1 && flat.large(operation::all_reduce, bytes, count, local)) {
    ring_shape shape({.count = count, .blocks = local}, es, flat.chunk_bytes());
    const extent mine = shape.layout.block(h.local_rank);
    {
      phase_view inside(c, h.local, h.local_rank, 0);
      scratch tmp(c);
      co_await ring_reduce_scatter_phase(c, shape, in == out ? nullptr : in, out, partial, tmp);
      co_await c.wait_all();  // before the scratch goes
    }
    {
      phase_view across(c, h.peers, h.host_rank, 1);
      co_await flat.flat_all_reduce(c, bytes_at(out, mine.offset * es), mine.count, es, partial);
    }
    op.finish(bytes_at(out, mine.offset * es), mine.count, h.group_size);
    phase_view inside(c, h.local, h.local_rank, 2);
    co_await ring_all_gather_phase(c, shape, out, 0);
    co_await c.wait_all();
    co_return;
  }
  const bool leader = h.local_rank == 0;
  if (local == 1) {
    if (in != out && bytes) std::memcpy(out, in, bytes);
  } else {
    phase_view inside(c, h.local, h.local_rank, 0);
    co_await flat.flat_reduce(c, in, out, count, es, partial, 0);
  }
  if (leader) {
    {
      phase_view across(c, h.leaders, h.host_rank, 1);
      co_await flat.flat_all_reduce(c, out, count, es, partial);
    }
    op.finish(out, count, h.group_size);
  }
  if (local == 1) co_return;
  phase_view inside(c, h.local, h.local_rank, 2);
  co_await flat.flat_broadcast(c, out, bytes, 0);
  co_await c.wait_all();
}

// This rank's neighbours in the chain through the hosts from `root`
// (group ranks; -1: none): the root's host's ranks from the root on,
// wrapping around, then each following host's ranks in order.
inline std::pair<int, int> host_chain_neighbours(const host_layout& h, int root, int rank) {
  const int hosts = h.hosts, root_host = h.host_index[static_cast<std::size_t>(root)];
  const int root_local = h.local_index[static_cast<std::size_t>(root)];
  // The rank at position s of host k's part of the chain.
  auto at = [&](int k, int s) {
    const auto& m = h.members[static_cast<std::size_t>(k)];
    const int size = static_cast<int>(m.size());
    return m[static_cast<std::size_t>(k == root_host ? mod(s + root_local, size) : s)];
  };
  auto size_of = [&](int k) {
    return static_cast<int>(h.members[static_cast<std::size_t>(k)].size());
  };
  const int k = h.host_index[static_cast<std::size_t>(rank)];
  const int local = h.local_index[static_cast<std::size_t>(rank)];
  const int s = k == root_host ? mod(local - root_local, size_of(k)) : local;
  int prev = -1, next = -1;
  if (s > 0) {
    prev = at(k, s - 1);
  } else if (k != root_host) {
    const int before = mod(k - 1, hosts);
    prev = at(before, size_of(before) - 1);
  }
  if (s + 1 < size_of(k)) {
    next = at(k, s + 1);
  } else if (const int after = mod(k + 1, hosts); after != root_host) {
    next = at(after, 0);
  }
  return {prev, next};
}

template <class Flat>
detail::task<void> hierarchical_broadcast(call& c, const host_layout& h, void* buf,
                                          std::size_t bytes, int root, const Flat& flat) {
  if (flat.large(operation::broadcast, bytes, bytes, c.size())) {
    const auto [prev, next] = host_chain_neighbours(h, root, c.rank());
    co_await chain_relay(c, buf, bytes, prev, next, flat.chunk_bytes());
    co_return;
  }
  const int root_host = h.host_index[static_cast<std::size_t>(root)];
  const bool roots_host = root_host == h.host_rank;
  if (roots_host) {
    phase_view inside(c, h.local, h.local_rank, 0);
    co_await flat.flat_broadcast(c, buf, bytes, h.local_index[static_cast<std::size_t>(root)]);
  }
  if (h.local_rank == 0) {
    phase_view across(c, h.leaders, h.host_rank, 1);
    co_await flat.flat_broadcast(c, buf, bytes, root_host);
  }
  if (!roots_host) {
    phase_view inside(c, h.local, h.local_rank, 2);
    co_await flat.flat_broadcast(c, buf, bytes, 0);
  }
}

DCOMM_EMIT_ON_USE detail::task<void> hierarchical_barrier(call& c, const host_layout& h) {
  const int local = static_cast<int>(h.local.size());
  const bool leader = h.local_rank == 0;
  {
    phase_view inside(c, h.local, h.local_rank, 0);
    if (!leader)
      c.send(0, 0, nullptr, 0);
    else
      for (int p = 1; p < local; ++p) co_await c.wait(c.recv(p, 0, nullptr, 0));
  }
  if (leader) {
    phase_view across(c, h.leaders, h.host_rank, 1);
    co_await dissemination_barrier(c);
  }
  phase_view inside(c, h.local, h.local_rank, 2);
  if (leader)
    for (int p = 1; p < local; ++p) c.send(p, 0, nullptr, 0);
  else
    co_await c.wait(c.recv(0, 0, nullptr, 0));
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::hierarchical_barrier<void>(call& c, const host_layout& h) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
