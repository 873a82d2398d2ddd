// all_reduce on the CPU backend.
//   recursive_doubling_all_reduce: small messages; log2(p) rounds in which
//     partners swap whole buffers. A world that is not a power of two
//     first folds its extra ranks into partners and unfolds at the end.
//   ring_all_reduce: large messages; ring reduce-scatter then all-gather,
//     bandwidth-optimal (each rank sends 2(n-1)/n of the buffer).
// Both combine commutatively, so every rank ends with the same bits.
#pragma once

#include <cstring>

#include "dcomm/cpu/algorithms/ring.hpp"
#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// `buf` holds this rank's contribution and receives the result.
DCOMM_EMIT_ON_USE inline detail::task<void> recursive_doubling_all_reduce(call& c, void* buf,
                                                                          std::size_t count,
                                                                          std::size_t es,
                                                                          const reducer& op) {
  const int n = c.size(), r = c.rank();
  const std::size_t bytes = count * es;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  scratch tmp(c);
  void* other = tmp.get(bytes);
  int v;  // rank among the p that take part in the doubling, or -1
  if (r < 2 * extra) {
    if (r % 2 == 0) {  // folded: hand the data over, get the result back
      co_await c.wait(c.send(r + 1, 0, buf, bytes));
      co_await c.wait(c.recv(r + 1, 1000, buf, bytes));
      co_return;
    }
    co_await c.wait(c.recv(r - 1, 0, other, bytes));
    op.combine(buf, other, count);
    v = r / 2;
  } else {
    v = r - extra;
  }
  auto real = [extra](int vr) { return vr < extra ? vr * 2 + 1 : vr + extra; };
  std::uint32_t round = 1;
  for (int mask = 1; mask < p; mask <<= 1, ++round) {
    const int partner = real(v ^ mask);
    io_item& s = c.send(partner, round, buf, bytes);
    io_item& in = c.recv(partner, round, other, bytes);
    co_await c.wait(in);
    co_await c.wait(s);  // buf is read by the send until it is done
    op.combine(buf, other, count);
  }
  op.finish(buf, count, n);
  if (r < 2 * extra) c.send(r - 1, 1000, buf, bytes);
  co_await c.wait_all();  // before `other` (scratch) goes away
}

// in == nullptr: in place on out.
DCOMM_EMIT_ON_USE inline detail::task<void> ring_all_reduce(call& c, const void* in, void* out,
                                                            std::size_t count, std::size_t es,
                                                            const reducer& op,
                                                            std::size_t chunk_bytes) {
  const int n = c.size();
  ring_shape shape({.count = count, .blocks = n}, es, chunk_bytes);
  scratch tmp(c);
  co_await ring_reduce_scatter_phase(c, shape, in, out, op, tmp);
  co_await c.wait_all();  // the all-gather overwrites blocks the sends read
  extent mine = shape.layout.block(c.rank());
  op.finish(bytes_at(out, mine.offset * es), mine.count, n);
  co_await ring_all_gather_phase(c, shape, out, static_cast<std::size_t>(n - 1));
  co_await c.wait_all();
}

}  // namespace dcomm::cpu
