// The two phases of a ring collective, each chunked and pipelined: a chunk
// is passed on as soon as it has arrived (and been reduced), so every link
// carries data at once. Rank r sends to r+1 and receives from r-1.
//
//   reduce-scatter, step s: send block r-s-1, receive block r-s-2 and
//     reduce it; after world-1 steps rank r holds the reduced block r.
//   all-gather, step s: send block r-s, receive block r-s-1; after
//     world-1 steps every rank holds every block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// Where each rank's block lies in the buffer, in elements.
struct block_layout {
  std::size_t count = 0;        // total elements
  std::size_t block_count = 0;  // equal blocks of this size; 0: split `count` evenly
  int blocks = 1;

  extent block(int b) const {
    if (block_count) return {static_cast<std::size_t>(b) * block_count, block_count};
    return split(count, static_cast<std::size_t>(blocks), static_cast<std::size_t>(b));
  }
  std::size_t largest() const { return block(0).count; }
};

struct ring_shape {
  block_layout layout;
  std::size_t element_size = 1;
  std::size_t chunks = 1;  // per block, the same on every rank

  ring_shape(block_layout l, std::size_t es, std::size_t chunk_bytes)
      : layout(l), element_size(es) {
    std::size_t bytes = l.largest() * es;
    chunks = bytes > chunk_bytes ? (bytes + chunk_bytes - 1) / chunk_bytes : 1;
  }
  extent chunk(int b, std::size_t j) const {
    extent e = layout.block(b);
    extent x = split(e.count, chunks, j);
    return {e.offset + x.offset, x.count};
  }
  std::uint32_t step(std::size_t s, std::size_t j) const {
    return static_cast<std::uint32_t>(s * chunks + j);
  }
};

// Reduce-scatter into `out` (every block of it may be written). `in` holds
// this rank's contribution; in == nullptr means it is already in `out`
// (in place), and `scratch_buffer` receives. Steps [0, world-1) of the call.
DCOMM_EMIT_ON_USE detail::task<void> ring_reduce_scatter_phase(call& c, const ring_shape& shape,
                                                               const void* in, void* out,
                                                               const reducer& op, scratch& tmp) {
  const int n = c.size(), r = c.rank();
  const int left = mod(r - 1, n), right = mod(r + 1, n);
  const std::size_t es = shape.element_size;
  const bool in_place = in == nullptr;
  char* landing = in_place ? static_cast<char*>(tmp.get(shape.layout.largest() * es)) : nullptr;
  item_slots slots(c);
  io_item** recvs = slots.get(shape.chunks);
  for (int s = 0; s + 1 < n; ++s) {
    const int rb = mod(r - s - 2, n), sb = mod(r - s - 1, n);
    const std::size_t rb_offset = shape.layout.block(rb).offset;
    for (std::size_t j = 0; j < shape.chunks; ++j) {
      extent e = shape.chunk(rb, j);
      char* dst = in_place ? landing + (e.offset - rb_offset) * es : bytes_at(out, e.offset * es);
      recvs[j] = &c.recv(left, shape.step(s, j), dst, e.count * es);
    }
    if (s == 0)
      for (std::size_t j = 0; j < shape.chunks; ++j) {
        extent e = shape.chunk(sb, j);
        c.send(right, shape.step(0, j), bytes_at(in_place ? out : in, e.offset * es), e.count * es);
      }
    for (std::size_t j = 0; j < shape.chunks; ++j) {
      if (!c.done(*recvs[j])) co_await c.wait(*recvs[j]);
      extent e = shape.chunk(rb, j);
      char* acc = bytes_at(out, e.offset * es);
      if (in_place)
        op.combine(acc, landing + (e.offset - rb_offset) * es, e.count);
      else
        op.combine(acc, bytes_at(in, e.offset * es), e.count);
      if (s + 2 < n)
        c.send(right, shape.step(static_cast<std::size_t>(s) + 1, j), acc, e.count * es);
    }
  }
}

// All-gather in place on `out`, whose block r is this rank's. Steps
// [first_step, first_step + (world-1) * chunks) of the call.
DCOMM_EMIT_ON_USE detail::task<void> ring_all_gather_phase(call& c, const ring_shape& shape,
                                                           void* out, std::size_t first_round) {
  const int n = c.size(), r = c.rank();
  const int left = mod(r - 1, n), right = mod(r + 1, n);
  const std::size_t es = shape.element_size;
  item_slots slots(c);
  io_item** recvs = slots.get(shape.chunks);
  for (int s = 0; s + 1 < n; ++s) {
    const int rb = mod(r - s - 1, n), sb = mod(r - s, n);
    const std::size_t round = first_round + static_cast<std::size_t>(s);
    for (std::size_t j = 0; j < shape.chunks; ++j) {
      extent e = shape.chunk(rb, j);
      recvs[j] = &c.recv(left, shape.step(round, j), bytes_at(out, e.offset * es), e.count * es);
    }
    if (s == 0)
      for (std::size_t j = 0; j < shape.chunks; ++j) {
        extent e = shape.chunk(sb, j);
        c.send(right, shape.step(round, j), bytes_at(out, e.offset * es), e.count * es);
      }
    for (std::size_t j = 0; j < shape.chunks; ++j) {
      if (!c.done(*recvs[j])) co_await c.wait(*recvs[j]);
      if (s + 2 < n) {
        extent e = shape.chunk(rb, j);
        c.send(right, shape.step(round + 1, j), bytes_at(out, e.offset * es), e.count * es);
      }
    }
  }
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::ring_reduce_scatter_phase<void>(call& c, const ring_shape& shape, const void* in, void* out, const reducer& op, scratch& tmp) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::ring_all_gather_phase<void>(call& c, const ring_shape& shape, void* out, std::size_t first_round) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
