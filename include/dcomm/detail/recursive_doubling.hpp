// Recursive doubling, the schedule of the small all_reduce, written once for
// the backends that run it over their own messages (the CPU backend's
// cpu/algorithms/all_reduce.hpp, the MPI backend's mpi/impl/all_reduce.hpp).
//   Among n ranks, p the largest power of two not above n and e = n - p:
//   ranks below e fold into rank + p first (their value combined into its)
//   and get the result from it last; the p ranks from e up swap values
//   with the rank whose index among them (rank - e) differs in bit k, in
//   round k, combining each time. log2(p) rounds (two more for a folded
//   rank). The lowest ranks fold so that every rank's first step sends but
//   the top e's (which receive a fold): a rank whose call differs from
//   the others' is seen at once by the ranks its messages reach (the CPU
//   backend's ranks waiting in a host's arena, for one); rank 0 always
//   sends first.
// Every combine puts the lower rank's value first, op(lower, higher), on
// both sides, so every rank ends with the same bits, whatever the operator.
#pragma once

#include <cstdint>

#include "dcomm/detail/task.hpp"

namespace dcomm::detail {

// The step of each message: the fold, then round k at step k, then the
// unfold (the CPU backend keys messages by it; MPI's keep their order).
inline constexpr std::uint32_t doubling_fold_step = 0;
inline constexpr std::uint32_t doubling_unfold_step = 1000;

// `x`, the backend's exchange, holds this rank's value and a landing for
// one from a partner:
//   task<bool> give(int peer, std::uint32_t step): sends the value;
//   task<bool> take(int peer, std::uint32_t step): receives peer's value
//     in place of this rank's (the result, unfolding);
//   task<bool> receive(int peer, std::uint32_t step): into the landing;
//   task<bool> swap(int peer, std::uint32_t step): sends the value and
//     receives peer's into the landing;
//   void combine(int peer): value = op(lower's, higher's) of the value and
//     the landing (this rank and `peer`).
// Each says whether what arrived is a value to combine (a backend that
// learns the ranks' calls differ goes on with the steps, and says no).
// The value is not finished (avg's division): the caller does that.
template <class Exchange>
task<void> recursive_doubling(Exchange& x, int n, int me) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  if (me < extra) {
    co_await x.give(me + p, doubling_fold_step);
    co_await x.take(me + p, doubling_unfold_step);
    co_return;
  }
  const bool absorbs = me >= p;  // the fold of rank me - p
  if (absorbs && co_await x.receive(me - p, doubling_fold_step)) x.combine(me - p);
  std::uint32_t step = 1;
  for (int mask = 1; mask < p; mask <<= 1, ++step) {
    const int partner = ((me - extra) ^ mask) + extra;
    if (co_await x.swap(partner, step)) x.combine(partner);
  }
  if (absorbs) co_await x.give(me - p, doubling_unfold_step);
}

}  // namespace dcomm::detail
