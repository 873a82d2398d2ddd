// gather on the CPU backend: every rank sends its block to the root directly
// (all messages in flight at once).
#pragma once

#include <cstring>

#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// out (root only) holds n blocks of `count`.
DCOMM_EMIT_ON_USE detail::task<void> direct_gather(call& c, const void* in, void* out,
                                                   std::size_t bytes, int root) {
  const int n = c.size(), r = c.rank();
  if (r != root) {
    c.send(root, 0, in, bytes);
    co_return;
  }
  char* mine = bytes_at(out, static_cast<std::size_t>(r) * bytes);
  if (mine != in && bytes) std::memcpy(mine, in, bytes);
  for (int p = 0; p < n; ++p)
    if (p != r) c.recv(p, 0, bytes_at(out, static_cast<std::size_t>(p) * bytes), bytes);
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_gather<void>(call& c, const void* in, void* out, std::size_t bytes, int root) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
