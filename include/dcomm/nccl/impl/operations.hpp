// nccl_backend's operations: the checks of a call, send and recv, the
// collectives NCCL has, and those composed from grouped send/recv
// (scatter, gather, all_to_all and the _v collectives). Each gives run()
// (nccl/impl/issue.hpp) the NCCL calls to make in its turn. Included by
// dcomm/nccl.hpp (Asio's style: the surface there, the bodies here).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/nccl.hpp"
#include "dcomm/nccl/staging.hpp"
#include "dcomm/nccl/types.hpp"

namespace dcomm {

inline void nccl_backend::check_algorithm(operation op, algorithm a) {
  if (a != algorithm::automatic)
    throw_error(errc::invalid_argument,
                {.operation = dcomm::name(op),
                 .detail = "algorithm " + std::string(dcomm::name(a)) +
                           " is not available on the nccl backend: NCCL chooses its own "
                           "(set NCCL_ALGO to steer it); leave it automatic"});
}

inline void nccl_backend::check_tensor(const const_tensor_view& v, const char* operation) const {
  if (v.count == 0) return;  // never touched: any empty buffer will do
  if (v.device.type != device::kind::cuda)
    throw_error(errc::invalid_argument,
                {.operation = operation,
                 .rank = rank_,
                 .expected = "a CUDA tensor on device " + std::to_string(device_),
                 .seen = "host memory",
                 .detail = "the nccl backend takes device memory; use the CPU backend for "
                           "host tensors"});
  if (v.device.index != device_)
    throw_error(
        errc::invalid_argument,
        {.operation = operation,
         .rank = rank_,
         .expected = "a CUDA tensor on device " + std::to_string(device_),
         .seen = "a CUDA tensor on device " + std::to_string(v.device.index),
         .detail = "this rank's NCCL communicator runs on device " + std::to_string(device_)});
  static_cast<void>(nccl::data_type(v.type));
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::send(op_context ctx,
                                                                   const_tensor_view in, int peer) {
  check_tag(ctx);
  co_await run(ctx, in.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (in.count == 0) return ncclSuccess;
    return ncclSend(st.in(in), in.count, nccl::data_type(in.type), peer, g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::recv(op_context ctx, tensor_view out,
                                                                   int peer) {
  check_tag(ctx);
  co_await run(ctx, out.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (out.count == 0) return ncclSuccess;
    return ncclRecv(st.out(out), out.count, nccl::data_type(out.type), peer, g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::barrier(op_context ctx) {
  co_await run(ctx, sizeof(float), [&](group& g, cudaStream_t s, nccl::staging&) {
    return ncclAllReduce(g.scratch, g.scratch, 1, ncclFloat32, ncclSum, g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::broadcast(op_context ctx,
                                                                        tensor_view buf, int root) {
  co_await run(ctx, buf.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (buf.count == 0) return ncclSuccess;
    void* d = st.out(buf, g.rank == root);
    return ncclBroadcast(d, d, buf.count, nccl::data_type(buf.type), root, g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::reduce(op_context ctx,
                                                                     const_tensor_view in,
                                                                     tensor_view out, reducer r,
                                                                     int root) {
  co_await run(ctx, in.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (in.count == 0) return ncclSuccess;
    const void* src = st.in(in);
    void* dst = g.rank == root ? st.out(out) : const_cast<void*>(src);
    return ncclReduce(src, dst, in.count, nccl::data_type(in.type), st.reduce_op(r, g.comm), root,
                      g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::all_reduce(op_context ctx,
                                                                         const_tensor_view in,
                                                                         tensor_view out,
                                                                         reducer r) {
  co_await run(ctx, in.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (in.count == 0) return ncclSuccess;
    const bool in_place = in.data == out.data;
    void* dst = st.out(out, in_place);
    const void* src = in_place ? dst : st.in(in);
    return ncclAllReduce(src, dst, in.count, nccl::data_type(in.type), st.reduce_op(r, g.comm),
                         g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::all_gather(op_context ctx,
                                                                         const_tensor_view in,
                                                                         tensor_view out) {
  co_await run(ctx, out.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (in.count == 0) return ncclSuccess;
    return ncclAllGather(st.in(in), st.out(out), in.count, nccl::data_type(in.type), g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::reduce_scatter(op_context ctx,
                                                                             const_tensor_view in,
                                                                             tensor_view out,
                                                                             reducer r) {
  co_await run(ctx, in.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    if (out.count == 0) return ncclSuccess;
    return ncclReduceScatter(st.in(in), st.out(out), out.count, nccl::data_type(out.type),
                             st.reduce_op(r, g.comm), g.comm, s);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::scatter(op_context ctx,
                                                                      const_tensor_view in,
                                                                      tensor_view out, int root) {
  co_await run(ctx, std::max(in.bytes(), out.bytes()),
               [&](group& g, cudaStream_t s, nccl::staging& st) {
                 const std::size_t block = out.bytes();
                 void* dst = st.out(out);
                 if (g.rank != root) return grouped(g, s, {}, {{root, dst, block}});
                 const char* src = static_cast<const char*>(st.in(in));
                 std::vector<transfer> sends;
                 for (int r = 0; r < g.size; ++r)
                   if (r != root)
                     sends.push_back({r, const_cast<char*>(src) + block * unsigned(r), block});
                 local_copy(dst, src + block * unsigned(root), block, s);
                 return grouped(g, s, sends, {});
               });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::gather(op_context ctx,
                                                                     const_tensor_view in,
                                                                     tensor_view out, int root) {
  co_await run(ctx, std::max(in.bytes(), out.bytes()),
               [&](group& g, cudaStream_t s, nccl::staging& st) {
                 const std::size_t block = in.bytes();
                 const void* src = st.in(in);
                 if (g.rank != root)
                   return grouped(g, s, {{root, const_cast<void*>(src), block}}, {});
                 char* dst = static_cast<char*>(st.out(out));
                 std::vector<transfer> recvs;
                 for (int r = 0; r < g.size; ++r)
                   if (r != root) recvs.push_back({r, dst + block * unsigned(r), block});
                 local_copy(dst + block * unsigned(root), src, block, s);
                 return grouped(g, s, {}, recvs);
               });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::all_to_all(op_context ctx,
                                                                         const_tensor_view in,
                                                                         tensor_view out) {
  co_await run(ctx, out.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    const std::size_t block = out.bytes() / unsigned(g.size);
    char* dst = static_cast<char*>(st.out(out, in.data == out.data));
    const char* src = static_cast<const char*>(st.in(in));
    if (in.data == out.data && out.bytes()) {  // in place: send from a copy
      void* copy = st.allocate(out.bytes());
      local_copy(copy, dst, out.bytes(), s);
      src = static_cast<const char*>(copy);
    }
    std::vector<transfer> sends, recvs;
    for (int r = 0; r < g.size; ++r)
      if (r != g.rank) {
        sends.push_back({r, const_cast<char*>(src) + block * unsigned(r), block});
        recvs.push_back({r, dst + block * unsigned(r), block});
      }
    local_copy(dst + block * unsigned(g.rank), src + block * unsigned(g.rank), block, s);
    return grouped(g, s, sends, recvs);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<std::vector<std::size_t>> nccl_backend::all_gather_v(
    op_context ctx, const_tensor_view in, output_allocator alloc) {
  no_stream(ctx);
  std::int64_t mine = static_cast<std::int64_t>(in.count);
  std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.group->size()));
  co_await all_gather(ctx, view(std::span<const std::int64_t>(&mine, 1)), mutable_view(all));
  std::vector<std::size_t> counts(all.begin(), all.end());
  tensor_view out = alloc(counts);
  const std::size_t element = size_of(in.type);
  co_await run(ctx, out.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
    const void* src = st.in(in);
    char* dst = static_cast<char*>(st.out(out));
    std::vector<transfer> sends, recvs;
    std::size_t at = 0;
    for (int r = 0; r < g.size; ++r) {
      const std::size_t bytes = counts[unsigned(r)] * element;
      if (r == g.rank)
        local_copy(dst + at, src, bytes, s);
      else {
        sends.push_back({r, const_cast<void*>(src), in.bytes()});
        recvs.push_back({r, dst + at, bytes});
      }
      at += bytes;
    }
    return grouped(g, s, sends, recvs);
  });
  co_return counts;
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<std::vector<std::size_t>> nccl_backend::all_to_all_v(
    op_context ctx, const_tensor_view in, std::vector<std::size_t> send_counts,
    output_allocator alloc) {
  no_stream(ctx);
  std::vector<std::int64_t> sending(send_counts.begin(), send_counts.end());
  std::vector<std::int64_t> coming(sending.size());
  co_await all_to_all(ctx, view(sending), mutable_view(coming));
  std::vector<std::size_t> counts(coming.begin(), coming.end());
  tensor_view out = alloc(counts);
  const std::size_t element = size_of(in.type);
  co_await run(
      ctx, std::max(in.bytes(), out.bytes()), [&](group& g, cudaStream_t s, nccl::staging& st) {
        const char* src = static_cast<const char*>(st.in(in));
        char* dst = static_cast<char*>(st.out(out));
        std::vector<transfer> sends, recvs;
        std::size_t from = 0, to = 0;
        for (int r = 0; r < g.size; ++r) {
          const std::size_t out_bytes = send_counts[unsigned(r)] * element;
          const std::size_t in_bytes = counts[unsigned(r)] * element;
          if (r == g.rank) {
            if (out_bytes != in_bytes)
              throw_error(errc::mismatch, {.operation = dcomm::name(ctx.operation),
                                           .rank = rank_,
                                           .detail = "this rank's count to itself changed"});
            local_copy(dst + to, src + from, in_bytes, s);
          } else {
            sends.push_back({r, const_cast<char*>(src) + from, out_bytes});
            recvs.push_back({r, dst + to, in_bytes});
          }
          from += out_bytes;
          to += in_bytes;
        }
        return grouped(g, s, sends, recvs);
      });
  co_return counts;
}

inline void nccl_backend::check_tag(const op_context& ctx) {
  if (ctx.seq != 0)
    throw_error(errc::invalid_argument,
                {.operation = dcomm::name(ctx.operation),
                 .seen = "tag " + std::to_string(static_cast<std::int64_t>(ctx.seq)),
                 .detail = "NCCL matches send and recv in order per pair of ranks; tags other "
                           "than 0 are not supported"});
}

inline void nccl_backend::no_stream(const op_context& ctx) {
  if (ctx.stream)
    throw_error(errc::invalid_argument,
                {.operation = dcomm::name(ctx.operation),
                 .detail = "the counts are needed on the host before the data moves, so it "
                           "cannot be stream-ordered; leave op_options::stream null"});
}

inline void nccl_backend::local_copy(void* dst, const void* src, std::size_t bytes,
                                     cudaStream_t s) const {
  if (bytes == 0 || dst == src) return;
  cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s),
              "cudaMemcpyAsync device to device");
}

inline ncclResult_t nccl_backend::grouped(group& g, cudaStream_t s,
                                          const std::vector<transfer>& sends,
                                          const std::vector<transfer>& recvs) const {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  for (auto& t : sends)
    if (t.bytes && r == ncclSuccess) r = ncclSend(t.data, t.bytes, ncclUint8, t.peer, g.comm, s);
  for (auto& t : recvs)
    if (t.bytes && r == ncclSuccess) r = ncclRecv(t.data, t.bytes, ncclUint8, t.peer, g.comm, s);
  const ncclResult_t end = ncclGroupEnd();
  return r != ncclSuccess ? r : end;
}

}  // namespace dcomm
