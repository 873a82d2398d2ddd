// mpi_backend's operations: each one of MPI's non-blocking calls, then a
// wait (mpi/impl/backend.hpp). Ranks are group ranks, which are the ranks
// of the group's MPI communicator (MPI_Comm_split orders them by key, then
// parent rank, as dcomm numbers a group).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dcomm/mpi.hpp"

namespace dcomm {

namespace mpi {

// What options::check_calls compares across a group: the operation, its
// dtype, count, root and reduce op, mixed into one word.
enum class call_kind : std::uint64_t {
  barrier = 1,
  broadcast,
  reduce,
  all_reduce,
  scatter,
  gather,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_gather_v,
  all_to_all_v
};
inline std::uint64_t signature(call_kind k, dtype t = dtype::uint8, std::size_t count = 0,
                               int root = -1, reduce_kind op = reduce_kind::sum) {
  std::uint64_t h = static_cast<std::uint64_t>(k) * 0x9e3779b97f4a7c15ull;
  for (std::uint64_t v : {static_cast<std::uint64_t>(t), static_cast<std::uint64_t>(count),
                          static_cast<std::uint64_t>(root + 1), static_cast<std::uint64_t>(op)})
    h = (h ^ v) * 0x100000001b3ull + (h >> 29);
  return h;
}

inline const char* at(const void* p, std::size_t offset) {
  return static_cast<const char*>(p) + offset;
}

// A point-to-point tag is an MPI tag: 0 to MPI_TAG_UB.
inline void check_tag(std::uint64_t tag, int tag_ub, const char* operation) {
  if (tag > static_cast<std::uint64_t>(tag_ub))
    throw_error(errc::invalid_argument,
                {.operation = operation,
                 .expected = "a tag from 0 to MPI_TAG_UB (" + std::to_string(tag_ub) + ")",
                 .seen = std::to_string(tag)});
}

}  // namespace mpi

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::send(op_context ctx,
                                                                         const_tensor_view in,
                                                                         int peer) {
  check_alive(ctx, "send");
  mpi::check_tag(ctx.seq, tag_ub_, "send");
  const int bytes = mpi::count_of(in.bytes(), "send", "byte count");
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Isend(in.data, bytes, MPI_BYTE, peer, static_cast<int>(ctx.seq), comm_of(ctx, "send"),
                  &request),
        ctx, "send");
  co_await wait(&request, 1, ctx, "send", nullptr,
                "rank " + std::to_string(ctx.group->ranks[static_cast<std::size_t>(peer)]));
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::recv(op_context ctx,
                                                                         tensor_view out,
                                                                         int peer) {
  check_alive(ctx, "recv");
  mpi::check_tag(ctx.seq, tag_ub_, "recv");
  const int bytes = mpi::count_of(out.bytes(), "recv", "byte count");
  const int sender = ctx.group->ranks[static_cast<std::size_t>(peer)];
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Irecv(out.data, bytes, MPI_BYTE, peer, static_cast<int>(ctx.seq), comm_of(ctx, "recv"),
                  &request),
        ctx, "recv");
  MPI_Status status{};
  co_await wait(&request, 1, ctx, "recv", &status, "rank " + std::to_string(sender));
  int got = 0;
  MPI_Get_count(&status, MPI_BYTE, &got);
  if (got != bytes)
    throw_error(errc::mismatch,
                {.operation = "recv (tag " + std::to_string(ctx.seq) + ")",
                 .rank = rank_,
                 .peers = "rank " + std::to_string(sender),
                 .detail = "message size mismatch: rank " + std::to_string(sender) + " sent " +
                           std::to_string(got) + " bytes, this rank expects " +
                           std::to_string(bytes) + " bytes"});
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::barrier(op_context ctx) {
  check_alive(ctx, "barrier");
  co_await check_signature(ctx, "barrier", mpi::signature(mpi::call_kind::barrier));
  if (o_.p2p_all_reduce_limit > 0) {  // an all_reduce of nothing, without MPI's schedule
    co_await doubling_all_reduce(ctx, {}, {}, {}, "barrier");
    co_return;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(comm_of(ctx, "barrier"), &request), ctx, "barrier");
  co_await wait(&request, 1, ctx, "barrier");
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::broadcast(op_context ctx,
                                                                              tensor_view buf,
                                                                              int root) {
  check_alive(ctx, "broadcast");
  const int count = mpi::count_of(buf.count, "broadcast");
  co_await check_signature(ctx, "broadcast",
                           mpi::signature(mpi::call_kind::broadcast, buf.type, buf.count, root));
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ibcast(buf.data, count, mpi::datatype_of(buf.type), root, comm_of(ctx, "broadcast"),
                   &request),
        ctx, "broadcast");
  co_await wait(&request, 1, ctx, "broadcast");
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::reduce(op_context ctx,
                                                                           const_tensor_view in,
                                                                           tensor_view out,
                                                                           reducer r, int root) {
  check_alive(ctx, "reduce");
  const int count = mpi::count_of(in.count, "reduce");
  co_await check_signature(ctx, "reduce",
                           mpi::signature(mpi::call_kind::reduce, in.type, in.count, root, r.kind));
  const bool is_root = ctx.group->rank == root;
  const mpi::reduction_type rt(r);
  const void* send = is_root && in.data == out.data ? MPI_IN_PLACE : in.data;
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ireduce(send, is_root ? out.data : nullptr, count, rt.type(), rt.op(), root,
                    comm_of(ctx, "reduce"), &request),
        ctx, "reduce");
  co_await wait(&request, 1, ctx, "reduce");
  if (is_root) r.finish(out.data, out.count, ctx.group->size());
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::all_reduce(op_context ctx,
                                                                               const_tensor_view in,
                                                                               tensor_view out,
                                                                               reducer r) {
  check_alive(ctx, "all_reduce");
  const int count = mpi::count_of(out.count, "all_reduce");
  co_await check_signature(
      ctx, "all_reduce",
      mpi::signature(mpi::call_kind::all_reduce, out.type, out.count, -1, r.kind));
  if (out.bytes() <= o_.p2p_all_reduce_limit) {
    co_await doubling_all_reduce(ctx, in, out, r, "all_reduce");
    co_return;
  }
  if (out.bytes() / static_cast<std::size_t>(ctx.group->size()) >= o_.ring_all_reduce_block &&
      out.count >= static_cast<std::size_t>(ctx.group->size())) {
    co_await ring_all_reduce(ctx, in, out, r);
    co_return;
  }
  const mpi::reduction_type rt(r);
  const void* send = in.data == out.data ? MPI_IN_PLACE : in.data;
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(send, out.data, count, rt.type(), rt.op(), comm_of(ctx, "all_reduce"),
                       &request),
        ctx, "all_reduce");
  co_await wait(&request, 1, ctx, "all_reduce");
  r.finish(out.data, out.count, ctx.group->size());
}

// in: n blocks (root only); out: one block (on the root, perhaps in's own).
DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::scatter(op_context ctx,
                                                                            const_tensor_view in,
                                                                            tensor_view out,
                                                                            int root) {
  check_alive(ctx, "scatter");
  const int count = mpi::count_of(out.count, "scatter");
  co_await check_signature(ctx, "scatter",
                           mpi::signature(mpi::call_kind::scatter, out.type, out.count, root));
  const bool is_root = ctx.group->rank == root;
  void* recv = is_root && out.data == mpi::at(in.data, static_cast<std::size_t>(root) * out.bytes())
                   ? MPI_IN_PLACE
                   : out.data;
  const MPI_Datatype dt = mpi::datatype_of(out.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iscatter(is_root ? in.data : nullptr, count, dt, recv, count, dt, root,
                     comm_of(ctx, "scatter"), &request),
        ctx, "scatter");
  co_await wait(&request, 1, ctx, "scatter");
}

// in: one block (on the root, perhaps out's own); out: n blocks (root only).
DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::gather(op_context ctx,
                                                                           const_tensor_view in,
                                                                           tensor_view out,
                                                                           int root) {
  check_alive(ctx, "gather");
  const int count = mpi::count_of(in.count, "gather");
  co_await check_signature(ctx, "gather",
                           mpi::signature(mpi::call_kind::gather, in.type, in.count, root));
  const bool is_root = ctx.group->rank == root;
  const void* send =
      is_root && in.data == mpi::at(out.data, static_cast<std::size_t>(root) * in.bytes())
          ? MPI_IN_PLACE
          : in.data;
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Igather(send, count, dt, is_root ? out.data : nullptr, count, dt, root,
                    comm_of(ctx, "gather"), &request),
        ctx, "gather");
  co_await wait(&request, 1, ctx, "gather");
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::all_gather(op_context ctx,
                                                                               const_tensor_view in,
                                                                               tensor_view out) {
  check_alive(ctx, "all_gather");
  const int count = mpi::count_of(in.count, "all_gather");
  co_await check_signature(ctx, "all_gather",
                           mpi::signature(mpi::call_kind::all_gather, in.type, in.count));
  const void* send =
      in.data == mpi::at(out.data, static_cast<std::size_t>(ctx.group->rank) * in.bytes())
          ? MPI_IN_PLACE
          : in.data;
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallgather(send, count, dt, out.data, count, dt, comm_of(ctx, "all_gather"), &request),
        ctx, "all_gather");
  co_await wait(&request, 1, ctx, "all_gather");
}

// in: n blocks; out: one block, which may be one of in's (then the result
// is made apart and copied: MPI's buffers may not overlap).
DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::reduce_scatter(
    op_context ctx, const_tensor_view in, tensor_view out, reducer r) {
  check_alive(ctx, "reduce_scatter");
  const int count = mpi::count_of(out.count, "reduce_scatter");
  co_await check_signature(
      ctx, "reduce_scatter",
      mpi::signature(mpi::call_kind::reduce_scatter, out.type, out.count, -1, r.kind));
  const auto* first = static_cast<const char*>(in.data);
  const auto* mine = static_cast<const char*>(out.data);
  const bool overlaps = out.bytes() && mine >= first && mine < first + in.bytes();
  std::vector<char> apart(overlaps ? out.bytes() : 0);
  void* result = overlaps ? apart.data() : out.data;
  const mpi::reduction_type rt(r);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ireduce_scatter_block(in.data, result, count, rt.type(), rt.op(),
                                  comm_of(ctx, "reduce_scatter"), &request),
        ctx, "reduce_scatter");
  co_await wait(&request, 1, ctx, "reduce_scatter");
  if (overlaps) std::memcpy(out.data, apart.data(), out.bytes());
  r.finish(out.data, out.count, ctx.group->size());
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::all_to_all(op_context ctx,
                                                                               const_tensor_view in,
                                                                               tensor_view out) {
  check_alive(ctx, "all_to_all");
  const std::size_t block = in.count / static_cast<std::size_t>(ctx.group->size());
  const int count = mpi::count_of(block, "all_to_all");
  co_await check_signature(ctx, "all_to_all",
                           mpi::signature(mpi::call_kind::all_to_all, in.type, block));
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(
      MPI_Ialltoall(in.data, count, dt, out.data, count, dt, comm_of(ctx, "all_to_all"), &request),
      ctx, "all_to_all");
  co_await wait(&request, 1, ctx, "all_to_all");
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<std::vector<std::size_t>>
mpi_backend::all_gather_v(op_context ctx, const_tensor_view in, output_allocator alloc) {
  check_alive(ctx, "all_gather_v");
  const std::size_t n = static_cast<std::size_t>(ctx.group->size());
  mpi::count_of(in.count, "all_gather_v");
  co_await check_signature(ctx, "all_gather_v",
                           mpi::signature(mpi::call_kind::all_gather_v, in.type));
  MPI_Comm comm = comm_of(ctx, "all_gather_v");
  std::uint64_t mine = in.count;
  std::vector<std::uint64_t> theirs(n);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallgather(&mine, 1, MPI_UINT64_T, theirs.data(), 1, MPI_UINT64_T, comm, &request), ctx,
        "all_gather_v");
  co_await wait(&request, 1, ctx, "all_gather_v");
  std::vector<std::size_t> counts(theirs.begin(), theirs.end());
  std::vector<int> sizes(n), offsets(n);
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    sizes[i] = mpi::count_of(counts[i], "all_gather_v");
    offsets[i] = mpi::count_of(total, "all_gather_v", "total element count");
    total += counts[i];
  }
  mpi::count_of(total, "all_gather_v", "total element count");
  const tensor_view out = alloc(counts);
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  check(MPI_Iallgatherv(in.data, sizes[static_cast<std::size_t>(ctx.group->rank)], dt, out.data,
                        sizes.data(), offsets.data(), dt, comm, &request),
        ctx, "all_gather_v");
  co_await wait(&request, 1, ctx, "all_gather_v");
  co_return counts;
}

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<std::vector<std::size_t>>
mpi_backend::all_to_all_v(op_context ctx, const_tensor_view in,
                          std::vector<std::size_t> send_counts, output_allocator alloc) {
  check_alive(ctx, "all_to_all_v");
  const std::size_t n = static_cast<std::size_t>(ctx.group->size());
  std::vector<int> send_sizes(n), send_offsets(n), recv_sizes(n), recv_offsets(n);
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    send_sizes[i] = mpi::count_of(send_counts[i], "all_to_all_v");
    send_offsets[i] = mpi::count_of(total, "all_to_all_v", "total element count");
    total += send_counts[i];
  }
  co_await check_signature(ctx, "all_to_all_v",
                           mpi::signature(mpi::call_kind::all_to_all_v, in.type));
  MPI_Comm comm = comm_of(ctx, "all_to_all_v");
  std::vector<std::uint64_t> mine(send_counts.begin(), send_counts.end()), theirs(n);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ialltoall(mine.data(), 1, MPI_UINT64_T, theirs.data(), 1, MPI_UINT64_T, comm, &request),
        ctx, "all_to_all_v");
  co_await wait(&request, 1, ctx, "all_to_all_v");
  std::vector<std::size_t> counts(theirs.begin(), theirs.end());
  total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    recv_sizes[i] = mpi::count_of(counts[i], "all_to_all_v");
    recv_offsets[i] = mpi::count_of(total, "all_to_all_v", "total element count");
    total += counts[i];
  }
  const tensor_view out = alloc(counts);
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  check(MPI_Ialltoallv(in.data, send_sizes.data(), send_offsets.data(), dt, out.data,
                       recv_sizes.data(), recv_offsets.data(), dt, comm, &request),
        ctx, "all_to_all_v");
  co_await wait(&request, 1, ctx, "all_to_all_v");
  co_return counts;
}

}  // namespace dcomm
