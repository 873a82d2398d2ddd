// barrier on the CPU backend: the dissemination algorithm. In round k
// every rank signals rank + 2^k and waits for rank - 2^k; after
// ceil(log2 n) rounds each rank has heard, indirectly, from all.
#pragma once

#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

DCOMM_EMIT_ON_USE detail::task<void> dissemination_barrier(call& c) {
  const int n = c.size(), r = c.rank();
  std::uint32_t round = 0;
  for (int distance = 1; distance < n; distance <<= 1, ++round) {
    c.send(mod(r + distance, n), round, nullptr, 0);
    co_await c.wait(c.recv(mod(r - distance, n), round, nullptr, 0));
  }
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::dissemination_barrier<void>(call& c) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
