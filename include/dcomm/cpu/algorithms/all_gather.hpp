// all_gather and all_gather_v on the CPU backend.
//   direct_all_gather: small outputs; every rank sends its block to every
//     other at once (n-1 messages in flight per rank, one round).
//   ring_all_gather: large outputs; the ring's all-gather phase, chunked.
//   all_gather_v: first every rank's count (direct), then the blocks.
#pragma once

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "dcomm/cpu/algorithms/ring.hpp"
#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// out holds n blocks of `count`; in may be out's block r (in place).
DCOMM_EMIT_ON_USE detail::task<void> direct_all_gather(call& c, const void* in, void* out,
                                                       std::size_t count, std::size_t es) {
  const int n = c.size(), r = c.rank();
  const std::size_t bytes = count * es;
  char* mine = bytes_at(out, static_cast<std::size_t>(r) * bytes);
  if (in != mine && bytes) std::memcpy(mine, in, bytes);
  for (int i = 1; i < n; ++i) {
    const int p = mod(r - i, n);
    c.recv(p, 0, bytes_at(out, static_cast<std::size_t>(p) * bytes), bytes);
  }
  for (int i = 1; i < n; ++i) c.send(mod(r + i, n), 0, mine, bytes);
  co_return;
}

DCOMM_EMIT_ON_USE detail::task<void> ring_all_gather(call& c, const void* in, void* out,
                                                     std::size_t count, std::size_t es,
                                                     std::size_t chunk_bytes) {
  const int n = c.size(), r = c.rank();
  const std::size_t bytes = count * es;
  char* mine = bytes_at(out, static_cast<std::size_t>(r) * bytes);
  if (in != mine && bytes) std::memcpy(mine, in, bytes);
  ring_shape shape(
      {.count = count * static_cast<std::size_t>(n), .block_count = count, .blocks = n}, es,
      chunk_bytes);
  co_await ring_all_gather_phase(c, shape, out, 0);
}

// Step 0: counts; step 1: data.
DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> exchange_counts(
    call& c, const std::vector<std::uint64_t>& mine_per_peer) {
  const int n = c.size(), r = c.rank();
  std::vector<std::uint64_t> theirs(static_cast<std::size_t>(n), 0);
  theirs[static_cast<std::size_t>(r)] = mine_per_peer[static_cast<std::size_t>(r)];
  for (int i = 1; i < n; ++i) {
    const int p = mod(r - i, n);
    c.recv(p, 0, &theirs[static_cast<std::size_t>(p)], sizeof(std::uint64_t));
  }
  for (int i = 1; i < n; ++i) {
    const int p = mod(r + i, n);
    c.send(p, 0, &mine_per_peer[static_cast<std::size_t>(p)], sizeof(std::uint64_t));
  }
  co_await c.wait_all();
  co_return std::vector<std::size_t>(theirs.begin(), theirs.end());
}

DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> direct_all_gather_v(
    call& c, const_tensor_view in, const output_allocator& alloc) {
  const int n = c.size(), r = c.rank();
  const std::size_t es = size_of(in.type);
  std::vector<std::uint64_t> mine(static_cast<std::size_t>(n), in.count);
  auto counts = co_await exchange_counts(c, mine);
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  tensor_view out = alloc(counts);
  if (out.count != total || out.type != in.type)
    c.invalid("all_gather_v: the output allocator returned " + std::to_string(out.count) + " " +
              std::string(name(out.type)) + " elements; " + std::to_string(total) + " " +
              std::string(name(in.type)) + " are needed");
  std::size_t offset = 0;
  std::vector<std::size_t> offsets;
  for (auto k : counts) {
    offsets.push_back(offset);
    offset += k;
  }
  if (in.count)
    std::memcpy(bytes_at(out.data, offsets[static_cast<std::size_t>(r)] * es), in.data, in.bytes());
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(mod(r - i, n));
    c.recv(static_cast<int>(p), 1, bytes_at(out.data, offsets[p] * es), counts[p] * es);
  }
  for (int i = 1; i < n; ++i) c.send(mod(r + i, n), 1, in.data, in.bytes());
  co_return counts;
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_all_gather<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::ring_all_gather<void>(call& c, const void* in, void* out, std::size_t count, std::size_t es, std::size_t chunk_bytes) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::exchange_counts<void>(call& c, const std::vector<std::uint64_t>& mine_per_peer) -> detail::task<std::vector<std::size_t>>)
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_all_gather_v<void>(call& c, const_tensor_view in, const output_allocator& alloc) -> detail::task<std::vector<std::size_t>>)
// clang-format on
// End of the separate-compilation block.
