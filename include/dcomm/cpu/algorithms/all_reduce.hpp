// all_reduce on the CPU backend.
//   recursive_doubling_all_reduce: small messages; log2(p) rounds in which
//     partners swap whole buffers (detail/recursive_doubling.hpp, the MPI
//     backend's schedule too). A world that is not a power of two first
//     folds its extra ranks into partners and unfolds at the end.
//   ring_all_reduce: large messages; ring reduce-scatter then all-gather,
//     bandwidth-optimal (each rank sends 2(n-1)/n of the buffer).
// Every rank ends with the same bits: recursive doubling combines the
// lower rank's value first on both sides; the ring reduces each block on
// one rank and copies it.
#pragma once

#include <cstring>

#include "dcomm/cpu/algorithms/ring.hpp"
#include "dcomm/cpu/call.hpp"
#include "dcomm/detail/recursive_doubling.hpp"

namespace dcomm::cpu {

// The exchange detail::recursive_doubling runs on: `buf` holds this
// rank's value, `other` (the call's scratch) a partner's.
class doubling_exchange {
 public:
  doubling_exchange(call& c, void* buf, void* other, std::size_t count, std::size_t es,
                    const reducer& op)
      : c_(c), buf_(buf), other_(other), count_(count), bytes_(count * es), op_(op) {}

  DCOMM_EMIT_ON_USE detail::task<bool> give(int peer, std::uint32_t step);
  DCOMM_EMIT_ON_USE detail::task<bool> take(int peer, std::uint32_t step);
  DCOMM_EMIT_ON_USE detail::task<bool> receive(int peer, std::uint32_t step);
  DCOMM_EMIT_ON_USE detail::task<bool> swap(int peer, std::uint32_t step);
  void combine(int peer) {
    if (peer > c_.rank()) {
      op_.combine(buf_, other_, count_);
    } else {
      op_.combine(other_, buf_, count_);
      if (bytes_) std::memcpy(buf_, other_, bytes_);
    }
  }

 private:
  call& c_;
  void* buf_;
  void* other_;
  std::size_t count_, bytes_;
  const reducer& op_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto doubling_exchange::give(int peer, std::uint32_t step)
    -> detail::task<bool> {
  co_await c_.wait(c_.send(peer, step, buf_, bytes_));
  co_return true;
}

DCOMM_EMIT_ON_USE_DEFINITION auto doubling_exchange::take(int peer, std::uint32_t step)
    -> detail::task<bool> {
  co_await c_.wait(c_.recv(peer, step, buf_, bytes_));
  co_return true;
}

DCOMM_EMIT_ON_USE_DEFINITION auto doubling_exchange::receive(int peer, std::uint32_t step)
    -> detail::task<bool> {
  co_await c_.wait(c_.recv(peer, step, other_, bytes_));
  co_return true;
}

DCOMM_EMIT_ON_USE_DEFINITION auto doubling_exchange::swap(int peer, std::uint32_t step)
    -> detail::task<bool> {
  io_item& out = c_.send(peer, step, buf_, bytes_);
  io_item& in = c_.recv(peer, step, other_, bytes_);
  co_await c_.wait(in);
  co_await c_.wait(out);  // buf is read by the send until it is done
  co_return true;
}

// `buf` holds this rank's contribution and receives the result.
DCOMM_EMIT_ON_USE detail::task<void> recursive_doubling_all_reduce(call& c, void* buf,
                                                                   std::size_t count,
                                                                   std::size_t es,
                                                                   const reducer& op) {
  scratch tmp(c);
  doubling_exchange x(c, buf, tmp.get(count * es), count, es, op);
  co_await detail::recursive_doubling(x, c.size(), c.rank());
  op.finish(buf, count, c.size());
  co_await c.wait_all();  // before `other` (scratch) goes away
}

// in == nullptr: in place on out.
DCOMM_EMIT_ON_USE detail::task<void> ring_all_reduce(call& c, const void* in, void* out,
                                                     std::size_t count, std::size_t es,
                                                     const reducer& op, std::size_t chunk_bytes) {
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

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::doubling_exchange::give<void>(int peer, std::uint32_t step) -> detail::task<bool>)
DCOMM_INSTANTIATE(auto dcomm::cpu::doubling_exchange::take<void>(int peer, std::uint32_t step) -> detail::task<bool>)
DCOMM_INSTANTIATE(auto dcomm::cpu::doubling_exchange::receive<void>(int peer, std::uint32_t step) -> detail::task<bool>)
DCOMM_INSTANTIATE(auto dcomm::cpu::doubling_exchange::swap<void>(int peer, std::uint32_t step) -> detail::task<bool>)
DCOMM_INSTANTIATE(auto dcomm::cpu::recursive_doubling_all_reduce<void>(call& c, void* buf, std::size_t count, std::size_t es, const reducer& op) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::ring_all_reduce<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, const reducer& op, std::size_t chunk_bytes) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
