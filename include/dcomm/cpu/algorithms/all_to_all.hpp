// all_to_all and all_to_all_v on the CPU backend: block p of every rank's
// input goes to rank p, directly; every message is in flight at once,
// each rank starting with its right-hand neighbour so links share the load.
#pragma once

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "dcomm/cpu/algorithms/all_gather.hpp"
#include "dcomm/cpu/call.hpp"

namespace dcomm::cpu {

// in, out: n blocks of `bytes`; they do not overlap.
DCOMM_EMIT_ON_USE detail::task<void> direct_all_to_all(call& c, const void* in, void* out,
                                                       std::size_t bytes) {
  const int n = c.size(), r = c.rank();
  for (int i = 1; i < n; ++i) {
    const int p = mod(r - i, n);
    c.recv(p, 0, bytes_at(out, static_cast<std::size_t>(p) * bytes), bytes);
  }
  for (int i = 1; i < n; ++i) {
    const int p = mod(r + i, n);
    c.send(p, 0, bytes_at(in, static_cast<std::size_t>(p) * bytes), bytes);
  }
  if (bytes)
    std::memcpy(bytes_at(out, static_cast<std::size_t>(r) * bytes),
                bytes_at(in, static_cast<std::size_t>(r) * bytes), bytes);
  co_return;
}

// send_counts[p]: elements of `in` (in rank order) for rank p.
DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> direct_all_to_all_v(
    call& c, const_tensor_view in, const std::vector<std::size_t>& send_counts,
    const output_allocator& alloc) {
  const int n = c.size(), r = c.rank();
  const std::size_t es = size_of(in.type);
  std::vector<std::uint64_t> mine(send_counts.begin(), send_counts.end());
  auto counts = co_await exchange_counts(c, mine);
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  tensor_view out = alloc(counts);
  if (out.count != total || out.type != in.type)
    c.invalid("all_to_all_v: the output allocator returned " + std::to_string(out.count) + " " +
              std::string(name(out.type)) + " elements; " + std::to_string(total) + " " +
              std::string(name(in.type)) + " are needed");
  std::vector<std::size_t> send_at(static_cast<std::size_t>(n)),
      recv_at(static_cast<std::size_t>(n));
  std::exclusive_scan(send_counts.begin(), send_counts.end(), send_at.begin(), std::size_t{0});
  std::exclusive_scan(counts.begin(), counts.end(), recv_at.begin(), std::size_t{0});
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(mod(r - i, n));
    c.recv(static_cast<int>(p), 1, bytes_at(out.data, recv_at[p] * es), counts[p] * es);
  }
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(mod(r + i, n));
    c.send(static_cast<int>(p), 1, bytes_at(in.data, send_at[p] * es), send_counts[p] * es);
  }
  const auto me = static_cast<std::size_t>(r);
  if (counts[me])
    std::memcpy(bytes_at(out.data, recv_at[me] * es), bytes_at(in.data, send_at[me] * es),
                counts[me] * es);
  co_return counts;
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_all_to_all<void>(call& c, const void* in, void* out, std::size_t bytes) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::direct_all_to_all_v<void>(call& c, const_tensor_view in, const std::vector<std::size_t>& send_counts, const output_allocator& alloc) -> detail::task<std::vector<std::size_t>>)
// clang-format on
// End of the separate-compilation block.
