// reduce on the CPU backend; only the root's output is written, and no
// rank's input is modified.
//   binomial_reduce: small messages; partial results climb a binomial tree.
//   chain_reduce: large messages; chunks flow root+n-1 -> ... -> root, each
//     rank adding its part before passing a chunk on.
#pragma once

#include <cstring>

#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// out is used on the root only (it may equal in: in place).
DCOMM_EMIT_ON_USE detail::task<void> binomial_reduce(call& c, const void* in, void* out,
                                                     std::size_t count, std::size_t es,
                                                     const reducer& op, int root) {
  const int n = c.size(), v = mod(c.rank() - root, n);
  const std::size_t bytes = count * es;
  scratch acc_memory(c), other_memory(c);
  void* acc = v == 0 ? out : acc_memory.get(bytes);
  if (acc != in && bytes) std::memcpy(acc, in, bytes);
  void* other = other_memory.get(bytes);
  for (int mask = 1; mask < n; mask <<= 1) {
    if (v & mask) {
      // acc may be this frame's scratch: wait before it goes away.
      co_await c.wait(c.send(mod(v - mask + root, n), 0, acc, bytes));
      co_return;
    }
    if (v + mask < n) {
      co_await c.wait(c.recv(mod(v + mask + root, n), 0, other, bytes));
      op.combine(acc, other, count);
    }
  }
  op.finish(acc, count, n);
}

DCOMM_EMIT_ON_USE detail::task<void> chain_reduce(call& c, const void* in, void* out,
                                                  std::size_t count, std::size_t es,
                                                  const reducer& op, int root,
                                                  std::size_t chunk_bytes) {
  const int n = c.size(), v = mod(c.rank() - root, n);
  const std::size_t bytes = count * es;
  const std::size_t chunks = bytes > chunk_bytes ? (bytes + chunk_bytes - 1) / chunk_bytes : 1;
  const int prev = mod(v - 1 + root, n), next = mod(v + 1 + root, n);
  scratch acc_memory(c), landing_memory(c);
  const bool last = v + 1 == n;
  // The last rank sends its input as it is; the others accumulate.
  const void* acc_in = in;
  void* acc = nullptr;
  if (!last) {
    acc = v == 0 ? out : acc_memory.get(bytes);
    if (acc != in && bytes) std::memcpy(acc, in, bytes);
    acc_in = acc;
  }
  char* landing = last ? nullptr : static_cast<char*>(landing_memory.get(bytes));
  item_slots slots(c);
  io_item** recvs = slots.get(chunks);
  if (!last)
    for (std::size_t j = 0; j < chunks; ++j) {
      extent e = split(count, chunks, j);
      recvs[j] =
          &c.recv(next, static_cast<std::uint32_t>(j), landing + e.offset * es, e.count * es);
    }
  for (std::size_t j = 0; j < chunks; ++j) {
    extent e = split(count, chunks, j);
    if (!last) {
      if (!c.done(*recvs[j])) co_await c.wait(*recvs[j]);
      op.combine(bytes_at(acc, e.offset * es), landing + e.offset * es, e.count);
    }
    if (v > 0)
      c.send(prev, static_cast<std::uint32_t>(j), bytes_at(acc_in, e.offset * es), e.count * es);
  }
  co_await c.wait_all();  // the sends read this frame's scratch
  if (v == 0) op.finish(out, count, n);
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::binomial_reduce<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, int root) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::chain_reduce<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, int root, std::size_t chunk_bytes) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
