// gather and scatter on the TCP backend: the root exchanges one block with
// every other rank directly (all messages in flight at once).
#pragma once

#include <cstring>

#include "dcomm/detail/tcp/call.hpp"

namespace dcomm::detail::tcp_net {

// out (root only) holds n blocks of `count`.
inline task<void> direct_gather(call& c, const void* in, void* out, std::size_t bytes, int root) {
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

// in (root only) holds n blocks of `count`.
inline task<void> direct_scatter(call& c, const void* in, void* out, std::size_t bytes, int root) {
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

}  // namespace dcomm::detail::tcp_net
