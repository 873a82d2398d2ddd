// A small all_reduce of dcomm's own over MPI's messages (MPI_Isend,
// MPI_Irecv on the group's `own` communicator): recursive doubling, the
// ranks beyond a power of two folding into a partner first and getting
// the result from it last. MPI_Iallreduce builds a schedule per call
// (Open MPI's libnbc: 9 allocations and ~0.7 us at 4 B, 2 ranks), more
// than the exchange itself costs; options::p2p_all_reduce_limit says up
// to which size this runs instead.
//
// Every rank gets the same bits: each step combines the lower rank's
// value first, op(lower, higher), on both sides. The reduction is
// dcomm's (reducer::combine), as on the CPU backend: fp16/bf16 through
// float, functors without an MPI_Op. Where the ranks' calls differ in
// size (all of this path), every rank fails with errc::mismatch: the
// ones that see it go through the remaining steps sending a message one
// byte larger than any call of this path, which tells their partners,
// so that no rank waits for a step that will not come. The tag is the
// call's sequence number, on a communicator of dcomm's own.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

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

DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> mpi_backend::p2p_all_reduce(
    op_context ctx, const_tensor_view in, tensor_view out, reducer r) {
  const int n = ctx.group->size(), me = ctx.group->rank;
  const std::size_t bytes = out.bytes();
  if (in.data != out.data && bytes) std::memcpy(out.data, in.data, bytes);
  const MPI_Comm comm = comms_of(ctx, "all_reduce").own;
  const int tag = static_cast<int>(ctx.seq % (static_cast<std::uint64_t>(tag_ub_) + 1));
  // Every message is received into `landing`, room for any call of this
  // path and one byte more: a message of that size says its sender saw
  // calls differ (sent from `poison`, in the steps that remain).
  const auto capacity = static_cast<int>(o_.p2p_all_reduce_limit + 1);
  const auto count = static_cast<int>(bytes);
  scratch_lease lease(*this, 2 * static_cast<std::size_t>(capacity));
  std::byte* landing = lease.data();
  const std::byte* poison = landing + capacity;
  std::string mismatch;  // non-empty: this call fails with errc::mismatch
  MPI_Request requests[2];
  MPI_Status statuses[2];
  auto peer = [&](int partner) {
    return "rank " + std::to_string(ctx.group->ranks[static_cast<std::size_t>(partner)]);
  };
  // One step with `partner`: out to it, its value into landing.
  auto post = [&](int partner, bool send, bool receive) {
    requests[0] = requests[1] = MPI_REQUEST_NULL;
    if (receive)
      check(MPI_Irecv(landing, capacity, MPI_BYTE, partner, tag, comm, &requests[0]), ctx,
            "all_reduce");
    if (send)
      check(mismatch.empty()
                ? MPI_Isend(out.data, count, MPI_BYTE, partner, tag, comm, &requests[1])
                : MPI_Isend(poison, capacity, MPI_BYTE, partner, tag, comm, &requests[1]),
            ctx, "all_reduce");
  };
  // Whether what arrived is a value to use.
  auto arrived_well = [&](int partner) {
    int got = 0;
    MPI_Get_count(&statuses[0], MPI_BYTE, &got);
    if (got == count && mismatch.empty()) return true;
    if (!mismatch.empty()) return false;
    mismatch = got == capacity ? peer(partner) + " found the ranks' calls differ in size"
                               : peer(partner) + "'s call has " + std::to_string(got) +
                                     " bytes, this rank's " + std::to_string(count);
    return false;
  };
  // out = op(lower rank's value, higher rank's value).
  auto combine_with = [&](int partner) {
    if (partner > me) {
      r.combine(out.data, landing, out.count);
    } else {
      r.combine(landing, out.data, out.count);
      if (bytes) std::memcpy(out.data, landing, bytes);
    }
  };
  int pow2 = 1;
  while (pow2 * 2 <= n) pow2 *= 2;
  const int extra = n - pow2;
  if (me >= pow2) {  // folds into me - pow2, which sends the result back
    const int partner = me - pow2;
    post(partner, true, false);
    co_await wait(requests, 2, ctx, "all_reduce", statuses, peer(partner));
    post(partner, false, true);
    co_await wait(requests, 2, ctx, "all_reduce", statuses, peer(partner));
    if (arrived_well(partner) && bytes) std::memcpy(out.data, landing, bytes);
  } else {
    if (me < extra) {
      post(me + pow2, false, true);
      co_await wait(requests, 2, ctx, "all_reduce", statuses, peer(me + pow2));
      if (arrived_well(me + pow2)) combine_with(me + pow2);
    }
    for (int mask = 1; mask < pow2; mask <<= 1) {
      const int partner = me ^ mask;
      post(partner, true, true);
      co_await wait(requests, 2, ctx, "all_reduce", statuses, peer(partner));
      if (arrived_well(partner)) combine_with(partner);
    }
    if (me < extra) {
      post(me + pow2, true, false);
      co_await wait(requests, 2, ctx, "all_reduce", statuses, peer(me + pow2));
    }
  }
  if (!mismatch.empty())
    throw_error(errc::mismatch,
                {.operation = "all_reduce #" + std::to_string(ctx.seq) + " of " + group_name(ctx),
                 .rank = rank_,
                 .detail = "the ranks' all_reduce calls differ in size: " + mismatch});
  r.finish(out.data, out.count, n);
}

}  // namespace dcomm
