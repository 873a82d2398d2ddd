// The MPI backend's all_reduce and barrier, the two operations with a choice
// (the others are MPI's own, in mpi/impl/operations.hpp): the rule, and
// dcomm's own all_reduce over MPI's messages (MPI_Isend, MPI_Irecv on the
// group's `own` communicator), where MPI_Iallreduce is slower than the
// messages it needs (Open MPI 4.1's libnbc; docs/performance.md, "Figures
// behind the code"):
//   doubling_all_reduce, up to options::p2p_all_reduce_limit: recursive
//     doubling (detail/recursive_doubling.hpp, the CPU backend's schedule
//     too), the ranks beyond a power of two folding into a partner first
//     and getting the result from it last. libnbc builds a schedule
//     per call (9 allocations), which costs more than the exchange itself.
//   ring_all_reduce, above, where each rank's block is at least
//     options::ring_all_reduce_block: reduce-scatter,
//     then all-gather, around the ring, each rank sending 2(n-1)/n of the
//     buffer. libnbc's default below 4 ranks (or in place) is a binomial
//     reduce then broadcast, which moves the whole buffer twice.
//
// Recursive doubling gives every rank the same bits: each step combines
// the lower rank's value first, op(lower, higher), on both sides; the
// ring reduces each block on one rank and then copies it. The reduction is
// dcomm's (reducer::combine), as on the CPU backend: fp16/bf16 through
// float, functors without an MPI_Op. Where the ranks' calls differ in
// size (both on the doubling path), every rank fails with
// errc::mismatch: the
// ones that see it go through the remaining steps sending a message one
// byte larger than any call of this path, which tells their partners,
// so that no rank waits for a step that will not come. The tag is the
// call's sequence number, on a communicator of dcomm's own.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/detail/partition.hpp"
#include "dcomm/detail/recursive_doubling.hpp"
#include "dcomm/mpi.hpp"

namespace dcomm {

// A buffer for the partner's values, the backend's own (operations run
// on its executor, one at a time): no allocation per call once as many
// are out as the calls that overlap.
class mpi_backend::scratch_lease {
 public:
  scratch_lease(mpi_backend& b, std::size_t bytes) : b_(b) {
    if (!b.scratch_.empty()) {
      buf_ = std::move(b.scratch_.back());
      b.scratch_.pop_back();
    }
    if (buf_.size() < bytes) buf_.resize(bytes);
  }
  scratch_lease(const scratch_lease&) = delete;
  scratch_lease& operator=(const scratch_lease&) = delete;
  ~scratch_lease() { b_.scratch_.push_back(std::move(buf_)); }
  std::byte* data() { return buf_.data(); }

 private:
  mpi_backend& b_;
  std::vector<std::byte> buf_;
};

// The rule: an all_reduce (a barrier: one of nothing) up to
// p2p_all_reduce_limit bytes runs dcomm's recursive doubling; a larger one
// whose block per rank is at least ring_all_reduce_block, dcomm's ring;
// any other, MPI's own.
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::barrier(op_context ctx) {
  check_alive(ctx);
  co_await check_signature(ctx, mpi::signature(operation::barrier));
  if (o_.p2p_all_reduce_limit > 0) {  // an all_reduce of nothing, without MPI's schedule
    co_await doubling_all_reduce(ctx, {}, {}, {});
    co_return;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(comm_of(ctx), &request), ctx);
  co_await wait(&request, 1, ctx);
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::all_reduce(op_context ctx,
                                                                        const_tensor_view in,
                                                                        tensor_view out,
                                                                        reducer r) {
  check_alive(ctx);
  const int count = mpi::count_of(out.count, dcomm::name(ctx.operation));
  co_await check_signature(ctx,
                           mpi::signature(operation::all_reduce, out.type, out.count, -1, r.kind));
  if (out.bytes() <= o_.p2p_all_reduce_limit) {
    co_await doubling_all_reduce(ctx, in, out, r);
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
  check(MPI_Iallreduce(send, out.data, count, rt.type(), rt.op(), comm_of(ctx), &request), ctx);
  co_await wait(&request, 1, ctx);
  r.finish(out.data, out.count, ctx.group->size());
}

// The exchange detail::recursive_doubling runs on: each step posts its
// MPI_Isend and MPI_Irecv on the group's own communicator under the call's
// tag (MPI keeps a pair's messages in order) and waits for both. Every
// message is received into `landing`, room for any call of this path and
// one byte more: a message of that size says its sender saw calls differ
// (sent from `poison` in the steps that remain).
class mpi_backend::doubling_exchange {
 public:
  doubling_exchange(mpi_backend& b, const op_context& ctx, tensor_view out, const reducer& r)
      : b_(b),
        ctx_(ctx),
        out_(out),
        r_(r),
        comm_(b.comms_of(ctx).own),
        tag_(static_cast<int>(ctx.seq % (static_cast<std::uint64_t>(b.tag_ub_) + 1))),
        capacity_(static_cast<int>(b.o_.p2p_all_reduce_limit + 1)),
        count_(static_cast<int>(out.bytes())),
        lease_(b, 2 * static_cast<std::size_t>(capacity_)),
        landing_(lease_.data()),
        poison_(landing_ + capacity_) {}

  DCOMM_EMIT_ON_USE detail::task<bool> give(int peer, std::uint32_t) {
    co_await step(peer, true, false);
    co_return true;
  }
  DCOMM_EMIT_ON_USE detail::task<bool> take(int peer, std::uint32_t) {
    co_await step(peer, false, true);
    const bool well = arrived_well(peer);
    if (well && count_) std::memcpy(out_.data, landing_, out_.bytes());
    co_return well;
  }
  DCOMM_EMIT_ON_USE detail::task<bool> receive(int peer, std::uint32_t) {
    co_await step(peer, false, true);
    co_return arrived_well(peer);
  }
  DCOMM_EMIT_ON_USE detail::task<bool> swap(int peer, std::uint32_t) {
    co_await step(peer, true, true);
    co_return arrived_well(peer);
  }
  // out = op(lower rank's value, higher rank's value).
  void combine(int peer) {
    if (peer > ctx_.group->rank) {
      r_.combine(out_.data, landing_, out_.count);
    } else {
      r_.combine(landing_, out_.data, out_.count);
      if (count_) std::memcpy(out_.data, landing_, out_.bytes());
    }
  }
  // Non-empty: the ranks' calls differ, and this one fails with mismatch.
  const std::string& mismatch() const { return mismatch_; }

 private:
  std::string peer_name(int peer) const {
    return "rank " + std::to_string(ctx_.group->ranks[static_cast<std::size_t>(peer)]);
  }
  // One step with `peer`: the value out to it, its value into the landing.
  DCOMM_EMIT_ON_USE detail::task<void> step(int peer, bool send, bool receive) {
    requests_[0] = requests_[1] = MPI_REQUEST_NULL;
    if (receive)
      b_.check(MPI_Irecv(landing_, capacity_, MPI_BYTE, peer, tag_, comm_, &requests_[0]), ctx_);
    if (send)
      b_.check(mismatch_.empty()
                   ? MPI_Isend(out_.data, count_, MPI_BYTE, peer, tag_, comm_, &requests_[1])
                   : MPI_Isend(poison_, capacity_, MPI_BYTE, peer, tag_, comm_, &requests_[1]),
               ctx_);
    co_await b_.wait(requests_, 2, ctx_, statuses_, peer_name(peer));
  }
  // Whether what arrived is a value to use.
  bool arrived_well(int peer) {
    int got = 0;
    MPI_Get_count(&statuses_[0], MPI_BYTE, &got);
    if (got == count_ && mismatch_.empty()) return true;
    if (!mismatch_.empty()) return false;
    mismatch_ = got == capacity_ ? peer_name(peer) + " found the ranks' calls differ in size"
                                 : peer_name(peer) + "'s call has " + std::to_string(got) +
                                       " bytes, this rank's " + std::to_string(count_);
    return false;
  }

  mpi_backend& b_;
  const op_context& ctx_;
  tensor_view out_;
  const reducer& r_;
  MPI_Comm comm_;
  int tag_, capacity_, count_;
  scratch_lease lease_;
  std::byte* landing_;
  const std::byte* poison_;
  std::string mismatch_;
  MPI_Request requests_[2];
  MPI_Status statuses_[2];
};

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::doubling_all_reduce(
    op_context ctx, const_tensor_view in, tensor_view out, reducer r) {
  if (in.data != out.data && out.bytes()) std::memcpy(out.data, in.data, out.bytes());
  doubling_exchange x(*this, ctx, out, r);
  co_await detail::recursive_doubling(x, ctx.group->size(), ctx.group->rank);
  if (!x.mismatch().empty())
    throw_error(errc::mismatch, {.operation = call_name(ctx),
                                 .rank = rank_,
                                 .detail = "the ranks' calls differ in size: " + x.mismatch()});
  r.finish(out.data, out.count, ctx.group->size());
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::ring_all_reduce(op_context ctx,
                                                                             const_tensor_view in,
                                                                             tensor_view out,
                                                                             reducer r) {
  const int n = ctx.group->size(), me = ctx.group->rank;
  const std::size_t es = size_of(out.type), count = out.count;
  // Out of place, `in` is read where the first pass over each block
  // needs it (the first send, each block's first combine), not copied
  // to `out` first: a pass over the buffer fewer.
  auto* data = static_cast<std::byte*>(out.data);
  const auto* mine = static_cast<const std::byte*>(in.data);
  if (n == 1 && mine != data) std::memcpy(data, mine, count * es);  // no pass at all
  const MPI_Comm comm = comms_of(ctx).own;
  const int tag = static_cast<int>(ctx.seq % (static_cast<std::uint64_t>(tag_ub_) + 1));
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  auto at = [n](int b) { return static_cast<std::size_t>((b % n + n) % n); };
  const std::string peers =
      "ranks " + std::to_string(ctx.group->ranks[static_cast<std::size_t>(left)]) + " and " +
      std::to_string(ctx.group->ranks[static_cast<std::size_t>(right)]);
  // A block's incoming values land a segment at a time (bounded scratch).
  const std::size_t segment = std::max<std::size_t>(1, mpi::ring_segment / es);
  scratch_lease landing(*this, std::min(segment, count / static_cast<std::size_t>(n) + 1) * es);
  MPI_Request requests[2];
  auto post = [&](const void* send, std::size_t send_n, void* receive, std::size_t receive_n) {
    requests[0] = requests[1] = MPI_REQUEST_NULL;
    if (receive_n)
      check(MPI_Irecv(receive,
                      mpi::count_of(receive_n * es, dcomm::name(ctx.operation), "byte count"),
                      MPI_BYTE, left, tag, comm, &requests[0]),
            ctx);
    if (send_n)
      check(MPI_Isend(send, mpi::count_of(send_n * es, dcomm::name(ctx.operation), "byte count"),
                      MPI_BYTE, right, tag, comm, &requests[1]),
            ctx);
  };
  // Reduce-scatter: at step s this rank sends block me - s (its values
  // combined with those it received so far) and combines block
  // me - s - 1 into its own; after n - 1 steps it holds block me + 1.
  for (int s = 0; s + 1 < n; ++s) {
    const auto [send_at, send_n] = detail::split(count, static_cast<std::size_t>(n), at(me - s));
    const auto [recv_at, recv_n] =
        detail::split(count, static_cast<std::size_t>(n), at(me - s - 1));
    for (std::size_t done = 0; done < std::max(send_n, recv_n); done += segment) {
      const std::size_t sn = done < send_n ? std::min(segment, send_n - done) : 0;
      const std::size_t rn = done < recv_n ? std::min(segment, recv_n - done) : 0;
      post((s == 0 ? mine : data) + (send_at + done) * es, sn, landing.data(), rn);
      co_await wait(requests, 2, ctx, nullptr, peers);
      std::byte* to = data + (recv_at + done) * es;
      if (mine == data)
        r.combine(to, landing.data(), rn);
      else
        r.combine_to(to, mine + (recv_at + done) * es, landing.data(), rn);
    }
  }
  const auto [own_at, own_n] = detail::split(count, static_cast<std::size_t>(n), at(me + 1));
  r.finish(data + own_at * es, own_n, n);
  // All-gather: at step s this rank passes on block me + 1 - s, and
  // receives block me - s straight into place (in messages of at most
  // 1 GiB: MPI's counts are ints).
  const std::size_t whole = std::max<std::size_t>(1, (std::size_t{1} << 30) / es);
  for (int s = 0; s + 1 < n; ++s) {
    const auto [send_at, send_n] =
        detail::split(count, static_cast<std::size_t>(n), at(me + 1 - s));
    const auto [recv_at, recv_n] = detail::split(count, static_cast<std::size_t>(n), at(me - s));
    for (std::size_t done = 0; done < std::max(send_n, recv_n); done += whole) {
      const std::size_t sn = done < send_n ? std::min(whole, send_n - done) : 0;
      const std::size_t rn = done < recv_n ? std::min(whole, recv_n - done) : 0;
      post(data + (send_at + done) * es, sn, data + (recv_at + done) * es, rn);
      co_await wait(requests, 2, ctx, nullptr, peers);
    }
  }
}

}  // namespace dcomm
