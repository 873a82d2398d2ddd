// transport::spin_shm, the shared memory links' spin: a template the
// arena's inline code instantiates, so it stays where every translation
// unit sees it, also in the separate-compilation mode that keeps the
// transport's other bodies (impl/) in the library.
#pragma once

#include <sched.h>

#include <atomic>

#include "dcomm/cpu/transport/transport.hpp"
#include "dcomm/detail/clock.hpp"

namespace dcomm::cpu {

// Polls the links for up to shm_spin, without leaving the executor (a
// yield through a strand would allocate; where the ranks outnumber the
// cores, sched_yield lends the core between looks): true as soon as a reader was
// woken or a writer went on, whose handlers run once the caller waits.
// Peers that write meanwhile find this rank awake and ring no bell.
// `pred` (the waiting op's condition) is polled too: a call in the arena
// waits for stores, not for messages. Once the bell says asleep again,
// the arena's holder is woken for a last look (a peer that arrived while
// this rank polled for another call rang no bell).
template <class Pred>
bool transport::spin_shm(const op_state& spinner, Pred pred) {
  shm::doorbell_word& bell = shm_->bell(static_cast<std::size_t>(shm_me_));
  bell.state.store(shm::doorbell_word::awake, std::memory_order_relaxed);
  // The clock is read first at the 16th look, and the spin lasts shm_spin
  // from there: most spins end within a few looks, and a read before the
  // first one delayed the sight of a peer's arrival (docs/performance.md,
  // "Figures behind the code").
  detail::clock::time_point until{};
  bool found = false;
  for (int i = 0; !(found = poll_shm(&spinner) || pred()); ++i) {
    if (options_.shm_yield)
      ::sched_yield();
    else
      shm::cpu_relax();
    if ((i & 15) == 15 || options_.shm_yield) {
      const auto now = detail::clock::now();
      if (until == detail::clock::time_point{})
        until = now + options_.shm_spin;
      else if (now >= until)
        break;
    }
  }
  // The caller goes on working: the bell stays awake until the io_context
  // gets to settle_bell, which it does before it could block (its
  // scheduler runs what is queued first). Peers writing meanwhile ring no
  // bell: back-to-back calls would otherwise cost each side an eventfd
  // write and a wake-up per call. Queued on the io_context, not the
  // strand: queued work holds a strand, and the next call could not start
  // inside its caller.
  auto* strand = detail::executor_target<detail::io_strand>(ex_);
  if (found && strand) {
    if (!bell_settling_) {
      bell_settling_ = true;
      detail::post_pooled(strand->get_inner_executor(), [self = shared_from_this()] {
        auto* s = detail::executor_target<detail::io_strand>(self->ex_);
        asio::dispatch(*s, asio::bind_allocator(detail::pool_allocator<void>{},
                                                [self] { self->settle_bell(); }));
      });
    }
    return true;
  }
  if (found && detail::executor_target<detail::io_executor>(ex_)) {
    if (!bell_settling_) {
      bell_settling_ = true;
      detail::post_pooled(ex_, [self = shared_from_this()] { self->settle_bell(); });
    }
    return true;
  }
  bell.state.store(shm::doorbell_word::asleep, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  wake_arena_holder();
  return poll_shm(&spinner) || found || pred();
}

}  // namespace dcomm::cpu
