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

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::send(op_context ctx,
                                                                  const_tensor_view in, int peer) {
  check_alive(ctx);
  mpi::check_tag(ctx.seq, tag_ub_, dcomm::name(ctx.operation));
  const int bytes = mpi::count_of(in.bytes(), dcomm::name(ctx.operation), "byte count");
  MPI_Request request = MPI_REQUEST_NULL;
  check(
      MPI_Isend(in.data, bytes, MPI_BYTE, peer, static_cast<int>(ctx.seq), comm_of(ctx), &request),
      ctx);
  co_await wait(&request, 1, ctx, nullptr,
                "rank " + std::to_string(ctx.group->ranks[static_cast<std::size_t>(peer)]));
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::recv(op_context ctx, tensor_view out,
                                                                  int peer) {
  check_alive(ctx);
  mpi::check_tag(ctx.seq, tag_ub_, dcomm::name(ctx.operation));
  const int bytes = mpi::count_of(out.bytes(), dcomm::name(ctx.operation), "byte count");
  const int sender = ctx.group->ranks[static_cast<std::size_t>(peer)];
  MPI_Request request = MPI_REQUEST_NULL;
  check(
      MPI_Irecv(out.data, bytes, MPI_BYTE, peer, static_cast<int>(ctx.seq), comm_of(ctx), &request),
      ctx);
  MPI_Status status{};
  co_await wait(&request, 1, ctx, &status, "rank " + std::to_string(sender));
  int got = 0;
  MPI_Get_count(&status, MPI_BYTE, &got);
  if (got != bytes)
    throw_error(errc::mismatch,
                {.operation = std::string(dcomm::name(ctx.operation)) + " (tag " +
                              std::to_string(ctx.seq) + ")",
                 .rank = rank_,
                 .peers = "rank " + std::to_string(sender),
                 .detail = "message size mismatch: rank " + std::to_string(sender) + " sent " +
                           std::to_string(got) + " bytes, this rank expects " +
                           std::to_string(bytes) + " bytes"});
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::broadcast(op_context ctx,
                                                                       tensor_view buf, int root) {
  check_alive(ctx);
  const int count = mpi::count_of(buf.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::broadcast, buf.type, buf.count, root));
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ibcast(buf.data, count, mpi::datatype_of(buf.type), root, comm_of(ctx), &request), ctx);
  co_await wait(&request, 1, ctx);
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::reduce(op_context ctx,
                                                                    const_tensor_view in,
                                                                    tensor_view out, reducer r,
                                                                    int root) {
  check_alive(ctx);
  const int count = mpi::count_of(in.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::reduce, in.type, in.count, root, r.kind));
  const bool is_root = ctx.group->rank == root;
  const mpi::reduction_type rt(r);
  const void* send = is_root && in.data == out.data ? MPI_IN_PLACE : in.data;
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ireduce(send, is_root ? out.data : nullptr, count, rt.type(), rt.op(), root,
                    comm_of(ctx), &request),
        ctx);
  co_await wait(&request, 1, ctx);
  if (is_root) r.finish(out.data, out.count, ctx.group->size());
}

// in: n blocks (root only); out: one block (on the root, perhaps in's own).
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::scatter(op_context ctx,
                                                                     const_tensor_view in,
                                                                     tensor_view out, int root) {
  check_alive(ctx);
  const int count = mpi::count_of(out.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::scatter, out.type, out.count, root));
  const bool is_root = ctx.group->rank == root;
  void* recv = is_root && out.data == mpi::at(in.data, static_cast<std::size_t>(root) * out.bytes())
                   ? MPI_IN_PLACE
                   : out.data;
  const MPI_Datatype dt = mpi::datatype_of(out.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iscatter(is_root ? in.data : nullptr, count, dt, recv, count, dt, root, comm_of(ctx),
                     &request),
        ctx);
  co_await wait(&request, 1, ctx);
}

// in: one block (on the root, perhaps out's own); out: n blocks (root only).
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::gather(op_context ctx,
                                                                    const_tensor_view in,
                                                                    tensor_view out, int root) {
  check_alive(ctx);
  const int count = mpi::count_of(in.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::gather, in.type, in.count, root));
  const bool is_root = ctx.group->rank == root;
  const void* send =
      is_root && in.data == mpi::at(out.data, static_cast<std::size_t>(root) * in.bytes())
          ? MPI_IN_PLACE
          : in.data;
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Igather(send, count, dt, is_root ? out.data : nullptr, count, dt, root, comm_of(ctx),
                    &request),
        ctx);
  co_await wait(&request, 1, ctx);
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::all_gather(op_context ctx,
                                                                        const_tensor_view in,
                                                                        tensor_view out) {
  check_alive(ctx);
  const int count = mpi::count_of(in.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::all_gather, in.type, in.count));
  const void* send =
      in.data == mpi::at(out.data, static_cast<std::size_t>(ctx.group->rank) * in.bytes())
          ? MPI_IN_PLACE
          : in.data;
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallgather(send, count, dt, out.data, count, dt, comm_of(ctx), &request), ctx);
  co_await wait(&request, 1, ctx);
}

// in: n blocks; out: one block, which may be one of in's (then the result
// is made apart and copied: MPI's buffers may not overlap).
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::reduce_scatter(op_context ctx,
                                                                            const_tensor_view in,
                                                                            tensor_view out,
                                                                            reducer r) {
  check_alive(ctx);
  const int count = mpi::count_of(out.count, dcomm::name(ctx.operation));
  co_await check_signature(
      ctx, mpi::signature(operation::reduce_scatter, out.type, out.count, -1, r.kind));
  const auto* first = static_cast<const char*>(in.data);
  const auto* mine = static_cast<const char*>(out.data);
  const bool overlaps = out.bytes() && mine >= first && mine < first + in.bytes();
  std::vector<char> apart(overlaps ? out.bytes() : 0);
  void* result = overlaps ? apart.data() : out.data;
  const mpi::reduction_type rt(r);
  MPI_Request request = MPI_REQUEST_NULL;
  check(
      MPI_Ireduce_scatter_block(in.data, result, count, rt.type(), rt.op(), comm_of(ctx), &request),
      ctx);
  co_await wait(&request, 1, ctx);
  if (overlaps) std::memcpy(out.data, apart.data(), out.bytes());
  r.finish(out.data, out.count, ctx.group->size());
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::all_to_all(op_context ctx,
                                                                        const_tensor_view in,
                                                                        tensor_view out) {
  check_alive(ctx);
  const std::size_t block = in.count / static_cast<std::size_t>(ctx.group->size());
  const int count = mpi::count_of(block, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::all_to_all, in.type, block));
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ialltoall(in.data, count, dt, out.data, count, dt, comm_of(ctx), &request), ctx);
  co_await wait(&request, 1, ctx);
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<std::vector<std::size_t>> mpi_backend::all_gather_v(
    op_context ctx, const_tensor_view in, output_allocator alloc) {
  check_alive(ctx);
  const std::size_t n = static_cast<std::size_t>(ctx.group->size());
  mpi::count_of(in.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx, mpi::signature(operation::all_gather_v, in.type));
  MPI_Comm comm = comm_of(ctx);
  std::uint64_t mine = in.count;
  std::vector<std::uint64_t> theirs(n);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallgather(&mine, 1, MPI_UINT64_T, theirs.data(), 1, MPI_UINT64_T, comm, &request),
        ctx);
  co_await wait(&request, 1, ctx);
  std::vector<std::size_t> counts(theirs.begin(), theirs.end());
  std::vector<int> sizes(n), offsets(n);
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    sizes[i] = mpi::count_of(counts[i], dcomm::name(ctx.operation));
    offsets[i] = mpi::count_of(total, dcomm::name(ctx.operation), "total element count");
    total += counts[i];
  }
  mpi::count_of(total, dcomm::name(ctx.operation), "total element count");
  const tensor_view out = alloc(counts);
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  check(MPI_Iallgatherv(in.data, sizes[static_cast<std::size_t>(ctx.group->rank)], dt, out.data,
                        sizes.data(), offsets.data(), dt, comm, &request),
        ctx);
  co_await wait(&request, 1, ctx);
  co_return counts;
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<std::vector<std::size_t>> mpi_backend::all_to_all_v(
    op_context ctx, const_tensor_view in, std::vector<std::size_t> send_counts,
    output_allocator alloc) {
  check_alive(ctx);
  const std::size_t n = static_cast<std::size_t>(ctx.group->size());
  std::vector<int> send_sizes(n), send_offsets(n), recv_sizes(n), recv_offsets(n);
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    send_sizes[i] = mpi::count_of(send_counts[i], dcomm::name(ctx.operation));
    send_offsets[i] = mpi::count_of(total, dcomm::name(ctx.operation), "total element count");
    total += send_counts[i];
  }
  co_await check_signature(ctx, mpi::signature(operation::all_to_all_v, in.type));
  MPI_Comm comm = comm_of(ctx);
  std::vector<std::uint64_t> mine(send_counts.begin(), send_counts.end()), theirs(n);
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ialltoall(mine.data(), 1, MPI_UINT64_T, theirs.data(), 1, MPI_UINT64_T, comm, &request),
        ctx);
  co_await wait(&request, 1, ctx);
  std::vector<std::size_t> counts(theirs.begin(), theirs.end());
  total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    recv_sizes[i] = mpi::count_of(counts[i], dcomm::name(ctx.operation));
    recv_offsets[i] = mpi::count_of(total, dcomm::name(ctx.operation), "total element count");
    total += counts[i];
  }
  const tensor_view out = alloc(counts);
  const MPI_Datatype dt = mpi::datatype_of(in.type);
  check(MPI_Ialltoallv(in.data, send_sizes.data(), send_offsets.data(), dt, out.data,
                       recv_sizes.data(), recv_offsets.data(), dt, comm, &request),
        ctx);
  co_await wait(&request, 1, ctx);
  co_return counts;
}

}  // namespace dcomm
