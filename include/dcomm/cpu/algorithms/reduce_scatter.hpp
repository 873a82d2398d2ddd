// reduce_scatter on the CPU backend: rank r gets block r of the reduction
// of every rank's n blocks.
//   direct_reduce_scatter: small inputs; block p goes straight to rank p,
//     which reduces the n-1 blocks it receives.
//   ring_reduce_scatter: large inputs; the ring's reduce-scatter phase.
#pragma once

#include <cstring>

#include "dcomm/cpu/algorithms/ring.hpp"
#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// in: n blocks of `count`; out: `count` (may be in's block r: in place).
DCOMM_EMIT_ON_USE detail::task<void> direct_reduce_scatter(call& c, const void* in, void* out,
                                                           std::size_t count, std::size_t es,
                                                           const reducer& op) {
  const int n = c.size(), r = c.rank();
  const std::size_t bytes = count * es;
  scratch tmp(c);
  char* landing = static_cast<char*>(tmp.get(bytes * static_cast<std::size_t>(n)));
  for (int i = 1; i < n; ++i) {
    const int p = mod(r - i, n);
    c.recv(p, 0, landing + static_cast<std::size_t>(p) * bytes, bytes);
  }
  for (int i = 1; i < n; ++i) {
    const int p = mod(r + i, n);
    c.send(p, 0, bytes_at(in, static_cast<std::size_t>(p) * bytes), bytes);
  }
  co_await c.wait_all();  // in place, out is a block the sends do not read
  const char* own = bytes_at(in, static_cast<std::size_t>(r) * bytes);
  if (own != out && bytes) std::memcpy(out, own, bytes);
  for (int p = 0; p < n; ++p)
    if (p != r) op.combine(out, landing + static_cast<std::size_t>(p) * bytes, count);
  op.finish(out, count, n);
}

DCOMM_EMIT_ON_USE detail::task<void> ring_reduce_scatter(call& c, const void* in, void* out,
                                                         std::size_t count, std::size_t es,
                                                         const reducer& op,
                                                         std::size_t chunk_bytes) {
  const int n = c.size(), r = c.rank();
  const std::size_t bytes = count * es;
  ring_shape shape(
      {.count = count * static_cast<std::size_t>(n), .block_count = count, .blocks = n}, es,
      chunk_bytes);
  // Received blocks land in a full-size work buffer (only the blocks this
  // rank reduces are touched), so the input is never copied or modified.
  scratch work(c), unused(c);
  char* acc = static_cast<char*>(work.get(bytes * static_cast<std::size_t>(n)));
  co_await ring_reduce_scatter_phase(c, shape, in, acc, op, unused);
  co_await c.wait_all();  // the sends read this frame's scratch
  char* result = acc + static_cast<std::size_t>(r) * bytes;
  op.finish(result, count, n);
  if (bytes) std::memcpy(out, result, bytes);
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_reduce_scatter<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::ring_reduce_scatter<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, std::size_t chunk_bytes) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
