// broadcast on the CPU backend.
//   binomial_broadcast: small messages; log2(n) levels, each rank receives
//     once from its parent and sends to its children.
//   chain_broadcast: large messages; root -> root+1 -> ... in chunks, each
//     chunk passed on as soon as it has arrived.
#pragma once

#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

DCOMM_EMIT_ON_USE detail::task<void> binomial_broadcast(call& c, void* buf, std::size_t bytes,
                                                        int root) {
  const int n = c.size(), v = mod(c.rank() - root, n);
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      co_await c.wait(c.recv(mod(v - mask + root, n), 0, buf, bytes));
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n) c.send(mod(v + mask + root, n), 0, buf, bytes);
}

// One link of a chain: receives each chunk from `prev` (-1: this rank is
// the root) and passes it on to `next` (-1: the chain's end) as soon as it
// has arrived. Ranks as the call counts them (its view, if one is set).
DCOMM_EMIT_ON_USE detail::task<void> chain_relay(call& c, void* buf, std::size_t bytes, int prev,
                                                 int next, std::size_t chunk_bytes) {
  const std::size_t chunks = bytes > chunk_bytes ? (bytes + chunk_bytes - 1) / chunk_bytes : 1;
  item_slots slots(c);
  io_item** recvs = slots.get(chunks);
  if (prev >= 0)
    for (std::size_t j = 0; j < chunks; ++j) {
      extent e = split(bytes, chunks, j);
      recvs[j] = &c.recv(prev, static_cast<std::uint32_t>(j), bytes_at(buf, e.offset), e.count);
    }
  for (std::size_t j = 0; j < chunks; ++j) {
    if (prev >= 0 && !c.done(*recvs[j])) co_await c.wait(*recvs[j]);
    if (next >= 0) {
      extent e = split(bytes, chunks, j);
      c.send(next, static_cast<std::uint32_t>(j), bytes_at(buf, e.offset), e.count);
    }
  }
}

// Not a coroutine itself: the relay is the call's only frame.
DCOMM_EMIT_ON_USE detail::task<void> chain_broadcast(call& c, void* buf, std::size_t bytes,
                                                     int root, std::size_t chunk_bytes) {
  const int n = c.size(), v = mod(c.rank() - root, n);
  return chain_relay(c, buf, bytes, v > 0 ? mod(v - 1 + root, n) : -1,
                     v + 1 < n ? mod(v + 1 + root, n) : -1, chunk_bytes);
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::binomial_broadcast<void>(call& c, void* buf, std::size_t bytes, int root) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::chain_relay<void>(call& c, void* buf, std::size_t bytes, int prev, int next, std::size_t chunk_bytes) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::chain_broadcast<void>(call& c, void* buf, std::size_t bytes, int root, std::size_t chunk_bytes) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
