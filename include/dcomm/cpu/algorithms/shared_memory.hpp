// The collectives of a group whose ranks all share this host, through the
// group's arena (shm/arena.hpp; the steps in cpu/algorithms/shm_arena.hpp) instead of
// messages. Each step: every rank copies its part into its slot, arrives,
// waits until every other rank arrived (one synchronisation), and reads
// the slots it needs. Large buffers go a slot's worth per step.
//   shm_barrier: one step with nothing in it.
//   shm_broadcast: the root copies a slot's worth in, the others copy it out.
//   shm_all_gather: each rank copies a slot's worth of its block in, then
//     every rank's part out.
//   shm_reduce: per slot's worth, every rank copies its part in; the root
//     reduces every slot in rank order into its output (the bits of
//     shm_all_reduce's one pass).
//   shm_all_reduce: up to one_pass_max bytes (and a slot), one step in
//     which every rank reduces every slot itself, in rank order (the same
//     bits on every rank); above, per slot's worth, each rank reduces its
//     share (from its own input and every other slot, into its output and
//     then its slot: the reduction split across ranks, as in DeepSpeed's
//     shm all_reduce), says so, and copies the others' shares out; from
//     direct_min to direct_max bytes (in place from direct_in_place_min),
//     where every rank may read the others' memory and has a core, the same
//     split without the slots' copies (shm_all_reduce_direct:
//     process_vm_readv of their buffers). The sizes: arena_all_reduce_sizes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "dcomm/cpu/algorithms/shm_arena.hpp"
#include "dcomm/cpu/call.hpp"
#include "dcomm/shm/single_copy.hpp"

namespace dcomm::cpu {

// The sizes shm_all_reduce chooses its way by; their values, and the
// measurements behind them, are in the backend's dispatch
// (cpu/algorithms/dispatch.hpp: arena_all_reduce_thresholds).
struct arena_all_reduce_sizes {
  // Up to this size (and a slot) an all_reduce is one step, each rank
  // reducing it whole.
  std::size_t one_pass_max = 0;
  // Between these sizes every rank asks whether every rank may read the
  // others' memory, and then it runs in one copy (shm_all_reduce_direct).
  std::size_t direct_min = 0, direct_max = 0;
  // In place, the one copy from this size only.
  std::size_t direct_in_place_min = 0;
};

// out = every slot's k elements combined in rank order (slot 0 op slot 1
// op ...): the same bits on every rank that computes it.
inline void reduce_slots(arena_call& a, int n, const reducer& op, void* out, std::size_t k) {
  if (n == 1) {
    std::memcpy(out, a.slot_of(0), k * size_of(op.type));
    return;
  }
  op.combine_to(out, a.slot_of(0), a.slot_of(1), k);
  for (int p = 2; p < n; ++p) op.combine(out, a.slot_of(p), k);
}

// The barrier without a coroutine frame where it can be (the usual case
// of back-to-back barriers: the turn is there and every rank arrives
// within one spin; call::at_once). False: the rest is shm_barrier's.
inline bool shm_barrier_at_once(arena_call& a) {
  if (!a.enter_at_once()) return false;
  a.begin_step();
  a.arrive();
  return a.all_arrived_within_spin();
}
DCOMM_EMIT_ON_USE detail::task<void> shm_barrier(arena_call& a) {
  if (!a.stepped()) {
    co_await a.enter();
    a.begin_step();
    a.arrive();
  }
  if (!a.all_arrived()) co_await a.wait_arrived();
}

DCOMM_EMIT_ON_USE detail::task<void> shm_broadcast(call& c, void* data, std::size_t bytes,
                                                   int root) {
  arena_call a(c);
  if (!a.enter_at_once()) co_await a.enter();
  const bool is_root = c.rank() == root;
  std::size_t done = 0;
  do {  // once at least: a broadcast of nothing still meets
    const std::size_t n = std::min(bytes - done, a.slot_bytes());
    std::byte* mine = a.begin_step();
    if (is_root && n) std::memcpy(mine, bytes_at(data, done), n);
    a.arrive();
    if (!a.all_arrived()) co_await a.wait_arrived();
    if (!is_root && n) std::memcpy(bytes_at(data, done), a.slot_of(root), n);
    done += n;
  } while (done < bytes);
}

// in: `bytes` per rank; out: every rank's, in rank order.
DCOMM_EMIT_ON_USE detail::task<void> shm_all_gather(call& c, const void* in, void* out,
                                                    std::size_t bytes) {
  arena_call a(c);
  if (!a.enter_at_once()) co_await a.enter();
  const int n = c.size();
  std::size_t done = 0;
  do {
    const std::size_t part = std::min(bytes - done, a.slot_bytes());
    std::byte* mine = a.begin_step();
    if (part) std::memcpy(mine, bytes_at(in, done), part);
    a.arrive();
    if (!a.all_arrived()) co_await a.wait_arrived();
    for (int p = 0; p < n && part; ++p) {
      char* to = bytes_at(out, static_cast<std::size_t>(p) * bytes + done);
      if (p == c.rank()) {
        if (to != bytes_at(in, done)) std::memmove(to, mine, part);
      } else {
        std::memcpy(to, a.slot_of(p), part);
      }
    }
    done += part;
  } while (done < bytes);
}

// in: this rank's `count` elements; out: the root's result (only the root's
// is written).
DCOMM_EMIT_ON_USE detail::task<void> shm_reduce(call& c, const void* in, void* out,
                                                std::size_t count, std::size_t es,
                                                const reducer& op, int root) {
  arena_call a(c);
  if (!a.enter_at_once()) co_await a.enter();
  const int n = c.size();
  const bool is_root = c.rank() == root;
  const std::size_t per_step = a.slot_bytes() / es;
  std::size_t first = 0;
  do {  // once at least: a reduce of nothing still meets
    const std::size_t k = std::min(per_step, count - first);
    std::byte* mine = a.begin_step();
    if (k) std::memcpy(mine, bytes_at(in, first * es), k * es);
    a.arrive();
    if (!a.all_arrived()) co_await a.wait_arrived();
    if (is_root && k) {
      void* result = bytes_at(out, first * es);
      reduce_slots(a, n, op, result, k);
      op.finish(result, k, n);
    }
    first += k;
  } while (first < count);
}

// shm_all_reduce of direct_min to direct_max bytes, in one copy where every rank
// may read the others' memory (shm/single_copy.hpp; options'
// shm_single_copy) and finds it the faster way (above): false where one
// does not, after the step where the ranks say so (the caller then takes
// the slots, from its next step). `prefer`: this rank finds one copy the
// faster way at this size (out of place, or in place from
// direct_in_place_min); every rank takes the step either way, since
// ranks need not agree on in place.
//   step 1: each rank offers where its buffers are (shm::buffer_offer);
//   then it reduces its share, reading it from every other rank's input
//     into its spare slot a slot's worth at a time (the first combine
//     from its own input into its output), and says so;
//   then it reads the others' shares from their outputs into its own;
//   step 2, with nothing in it: no rank returns (and gives its buffers
//     back) while another may still read them.
// Each rank moves 2(n-1)/n of the buffer through process_vm_readv and
// reduces 1/n of it: no copy into or out of the slots.
DCOMM_EMIT_ON_USE detail::task<bool> shm_all_reduce_direct(call& c, arena_call& a, const void* in,
                                                           void* out, std::size_t count,
                                                           std::size_t es, const reducer& op,
                                                           bool prefer) {
  const int n = c.size(), r = c.rank();
  const auto ranks = static_cast<std::size_t>(n);
  const bool faster = prefer && a.has_cores();
  shm::buffer_offer offer{.in = reinterpret_cast<std::uintptr_t>(in),
                          .out = reinterpret_cast<std::uintptr_t>(out),
                          .direct = faster ? 1u : 0u};
  for (int p = 0; p < n; ++p)
    if (p != r && faster && !a.may_read(p)) offer.direct = 0;
  std::memcpy(a.begin_step(), &offer, sizeof offer);
  a.arrive();
  if (!a.all_arrived()) co_await a.wait_arrived();
  auto offer_of = [&](int p) {
    shm::buffer_offer o;
    std::memcpy(&o, a.slot_of(p), sizeof o);
    return o;
  };
  for (int p = 0; p < n; ++p)
    if (p != r && !offer_of(p).direct) co_return false;
  if (!offer.direct) co_return false;
  // This rank's share: `in` first, then every other rank's in rank order.
  const extent share = split(count, ranks, static_cast<std::size_t>(r));
  std::byte* landing = a.spare_slot();
  const std::size_t per_read = a.slot_bytes() / es;
  for (std::size_t done = 0; done < share.count; done += per_read) {
    const std::size_t k = std::min(per_read, share.count - done), at = (share.offset + done) * es;
    void* result = bytes_at(out, at);
    bool first = true;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      if (!a.read(p, landing, offer_of(p).in + at, k * es)) {
        co_await a.wait_failed();
        co_return true;
      }
      if (first && out != in)
        op.combine_to(result, bytes_at(in, at), landing, k);
      else
        op.combine(result, landing, k);
      first = false;
    }
    op.finish(result, k, n);
  }
  a.reduced();
  if (!a.all_reduced()) co_await a.wait_reduced();
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    const extent e = split(count, ranks, static_cast<std::size_t>(p));
    if (e.count &&
        !a.read(p, bytes_at(out, e.offset * es), offer_of(p).out + e.offset * es, e.count * es)) {
      co_await a.wait_failed();
      co_return true;
    }
  }
  a.begin_step();
  a.arrive();
  if (!a.all_arrived()) co_await a.wait_arrived();
  co_return true;
}

// The one-pass all_reduce (up to one_pass_max bytes): its step, and
// the reduction once every rank has arrived.
inline bool one_pass(arena_call& a, std::size_t bytes, const arena_all_reduce_sizes& sizes) {
  return bytes <= std::min(sizes.one_pass_max, a.slot_bytes());
}
inline void arrive_with(arena_call& a, const void* in, std::size_t bytes) {
  std::byte* mine = a.begin_step();
  if (bytes) std::memcpy(mine, in, bytes);
  a.arrive();
}
inline void reduce_arrived(arena_call& a, int n, const reducer& op, void* out, std::size_t count) {
  if (!count) return;
  reduce_slots(a, n, op, out, count);
  op.finish(out, count, n);
}

// A one-pass all_reduce without a coroutine frame where it can be (as
// shm_barrier_at_once). False: the rest is shm_all_reduce's.
inline bool shm_all_reduce_at_once(arena_call& a, const void* in, void* out, std::size_t count,
                                   std::size_t es, const reducer& op,
                                   const arena_all_reduce_sizes& sizes) {
  if (!one_pass(a, count * es, sizes) || !a.enter_at_once()) return false;
  arrive_with(a, in, count * es);
  if (!a.all_arrived_within_spin()) return false;
  reduce_arrived(a, a.size(), op, out, count);
  return true;
}

DCOMM_EMIT_ON_USE detail::task<void> shm_all_reduce(call& c, arena_call& a, const void* in,
                                                    void* out, std::size_t count, std::size_t es,
                                                    const reducer& op,
                                                    const arena_all_reduce_sizes& sizes) {
  const bool stepped = a.stepped();  // by shm_all_reduce_at_once
  if (!stepped && !a.enter_at_once()) co_await a.enter();
  const int n = c.size(), r = c.rank();
  const std::size_t bytes = count * es;
  if (one_pass(a, bytes, sizes)) {
    if (!stepped) arrive_with(a, in, count * es);
    if (!a.all_arrived()) co_await a.wait_arrived();
    reduce_arrived(a, n, op, out, count);
    co_return;
  }
  if (bytes >= sizes.direct_min && bytes <= sizes.direct_max &&
      co_await shm_all_reduce_direct(c, a, in, out, count, es, op,
                                     in != out || bytes >= sizes.direct_in_place_min))
    co_return;
  const std::size_t per_step = a.slot_bytes() / es;
  const std::size_t ranks = static_cast<std::size_t>(n), me = static_cast<std::size_t>(r);
  for (std::size_t first = 0; first < count; first += per_step) {
    const std::size_t k = std::min(per_step, count - first);
    const extent share = split(k, ranks, me);
    const std::size_t at = share.offset * es, end = at + share.count * es;
    // The others' shares of this rank's part (its own share it reduces
    // from `in`: one copy fewer, the difference at 4-16 MiB).
    std::byte* mine = a.begin_step();
    std::memcpy(mine, bytes_at(in, first * es), at);
    std::memcpy(mine + end, bytes_at(in, first * es + end), k * es - end);
    a.arrive();
    if (!a.all_arrived()) co_await a.wait_arrived();
    // This rank's share, reduced into `out` (`in` first, then every other
    // slot in rank order), then into its slot for the others. Out of
    // place, the first combine reads `in` and writes `out` in one pass.
    void* result = bytes_at(out, (first + share.offset) * es);
    const int first_other = r == 0 ? 1 : 0;
    if (out != in)
      op.combine_to(result, bytes_at(in, (first + share.offset) * es), a.slot_of(first_other) + at,
                    share.count);
    else
      op.combine(result, a.slot_of(first_other) + at, share.count);
    for (int p = first_other + 1; p < n; ++p)
      if (p != r) op.combine(result, a.slot_of(p) + at, share.count);
    op.finish(result, share.count, n);
    std::memcpy(mine + at, result, end - at);
    a.reduced();
    if (!a.all_reduced()) co_await a.wait_reduced();
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      const extent e = split(k, ranks, static_cast<std::size_t>(p));
      std::memcpy(bytes_at(out, (first + e.offset) * es), a.slot_of(p) + e.offset * es,
                  e.count * es);
    }
  }
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_barrier<void>(arena_call& a) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_broadcast<void>(call& c, void* data, std::size_t bytes, int root) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_all_gather<void>(call& c, const void* in, void* out, std::size_t bytes) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_reduce<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, int root) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_all_reduce_direct<void>(call& c, arena_call& a, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, bool prefer) -> detail::task<bool>)
DCOMM_INSTANTIATE(auto dcomm::cpu::shm_all_reduce<void>(call& c, arena_call& a, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, const arena_all_reduce_sizes& sizes) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
