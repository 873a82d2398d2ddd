// scatter on the CPU backend: the root sends every other rank its block
// directly (all messages in flight at once).
#pragma once

#include <cstring>

#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// in (root only) holds n blocks of `count`.
DCOMM_EMIT_ON_USE detail::task<void> direct_scatter(call& c, const void* in, void* out,
                                                    std::size_t bytes, int root) {
  const int n = c.size(), r = c.rank();
  if (r != root) {
    c.recv(root, 0, out, bytes);
    co_return;
  }
  for (int i = 1; i < n; ++i) {
    const int p = mod(r + i, n);
    c.send(p, 0, bytes_at(in, static_cast<std::size_t>(p) * bytes), bytes);
  }
  const char* mine = bytes_at(in, static_cast<std::size_t>(r) * bytes);
  if (mine != out && bytes) std::memmove(out, mine, bytes);
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_scatter<void>(call& c, const void* in, void* out, std::size_t bytes, int root) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
