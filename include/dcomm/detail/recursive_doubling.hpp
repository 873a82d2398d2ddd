// Recursive doubling, the schedule of the small all_reduce, written once for
// the backends that run it over their own messages (the CPU backend's
// cpu/algorithms/all_reduce.hpp, the MPI backend's mpi/impl/all_reduce.hpp).
//   Among n ranks, p the largest power of two not above n: ranks p and up
//   fold into rank - p first (their value combined into its) and get the
//   result from it last; ranks below p swap values with partner
//   rank ^ mask, mask = 1, 2, ..., p / 2, combining each time.
//   log2(p) rounds (two more for a folded rank).
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
  if (me >= p) {
    co_await x.give(me - p, doubling_fold_step);
    co_await x.take(me - p, doubling_unfold_step);
    co_return;
  }
  if (me < extra && co_await x.receive(me + p, doubling_fold_step)) x.combine(me + p);
  std::uint32_t step = 1;
  for (int mask = 1; mask < p; mask <<= 1, ++step) {
    const int partner = me ^ mask;
    if (co_await x.swap(partner, step)) x.combine(partner);
  }
  if (me < extra) co_await x.give(me + p, doubling_unfold_step);
}

}  // namespace dcomm::detail
