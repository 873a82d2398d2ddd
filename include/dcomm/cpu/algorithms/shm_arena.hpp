// A collective's use of its group's arena (shm/arena.hpp: the host's for
// the world, else the group's own), for the algorithms of
// cpu/algorithms/shared_memory.hpp: its turn (one call at a time per rank
// and arena, in the order the calls started), its steps (write this
// rank's slot, arrive, wait until every other rank arrived, read theirs),
// and what can go wrong while it waits: a rank whose call differs
// (errc::mismatch, from the call each record carries), a rank that is
// gone (errc::peer_lost, from its link), the deadline (the transport's
// probe and timeout, as for messages).
//
// Waking: a rank that arrives rings the doorbell of every rank that
// sleeps (shm/segment.hpp's ring); the transport wakes the call holding
// the arena when its doorbell rings, when polling stops, and when a link
// is lost (cpu/transport/impl/shm_links.hpp, cpu/transport/impl/shutdown.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <system_error>

#include "dcomm/cpu/call.hpp"
#include "dcomm/shm/arena.hpp"

namespace dcomm::cpu {

static_assert(sizeof(call_signature) <= sizeof(shm::arena_record::call));

class arena_call {
 public:
  // Queues the call for the arena at once (the algorithm starts before
  // its first wait, in the order the calls started).
  explicit arena_call(call& c)
      : c_(c),
        t_(c.net()),
        seat_(*t_.arena_of(c.group())),
        a_(seat_.arena),
        me_(c.rank()),
        n_(c.size()) {
    t_.queue_for_arena(seat_, op());
    op().carried |= transports::shm;
    c.ran(algorithm::shared_memory);
  }
  arena_call(const arena_call&) = delete;
  arena_call& operator=(const arena_call&) = delete;
  op_state& op() { return c_.state(); }
  int size() const { return n_; }

  // Says the call is left (whether it failed or not) and gives the turn on.
  ~arena_call() {
    a_.state(mine()).left.store(shm::arena_stamp(op().seq, shm::max_arena_steps),
                                std::memory_order_release);
    t_.leave_arena(seat_, op());
  }

  // enter() where it has nothing to wait for or report (the usual case),
  // without its coroutine frame: false if the caller must co_await enter().
  bool enter_at_once() {
    if (seat_.first != &op() || !seat_.synced || t_.refused_send_pending(op())) return false;
    op().on_arena = true;
    return true;
  }

  // Waits until the calls that started before this one have left.
  DCOMM_EMIT_ON_USE detail::task<void> enter();

  std::size_t slot_bytes() const { return a_.slot_bytes(); }

  // Starts the next step: this rank's slot for it, to fill before arrive().
  std::byte* begin_step() {
    if (step_ > shm::max_arena_steps)
      c_.invalid("the operation needs more steps through shared memory than a stamp holds");
    record_ = seat_.next_record();
    stamp_ = shm::arena_stamp(op().seq, step_++);
    cursor_ = 0;
    rings_noted_ = false;
    return a_.slot(mine(), record_);
  }
  // Publishes the step (with the call it belongs to) and wakes the
  // ranks that sleep.
  void arrive() {
    shm::arena_record& r = a_.record(mine(), record_);
    r.group = op().group;
    std::memcpy(r.call, &op().sig, sizeof(call_signature));
    r.arrivals = detail::stamp_of(op().arrivals);
    r.arrived.store(stamp_, std::memory_order_release);
    t_.ring_local_peers();
    seat_.synced = false;
  }
  // Publishes that this rank's share of the step's reduction is in its slot.
  void reduced() {
    a_.record(mine(), record_).reduced.store(stamp_, std::memory_order_release);
    t_.ring_local_peers();
    cursor_ = 0;
  }

  // Whether every other rank has arrived at this step (reduced: has
  // published its share). Fails the call (then false) for a rank whose
  // call differs or that is gone before it got there.
  bool all_arrived() {
    if (!reached(false)) return false;
    if (!rings_noted_) {
      t_.note_arena_rings(op());
      rings_noted_ = true;
    }
    if (!t_.arena_rings_read(seat_, op())) return false;
    // Every rank is past the step before: the record of that one may be
    // written again (the rule of shm/arena.hpp holds).
    seat_.synced = true;
    return true;
  }
  bool all_reduced() { return reached(true); }
  // all_arrived() now or within one spin (transport::holds_within_spin).
  bool all_arrived_within_spin() {
    return t_.holds_within_spin(op(), [this] { return all_arrived(); });
  }
  // Whether the call has begun a step (enter_at_once got it that far).
  bool stepped() const { return step_ > 0; }
  DCOMM_EMIT_ON_USE detail::task<void> wait_arrived();
  DCOMM_EMIT_ON_USE detail::task<void> wait_reduced();

  // This rank's other slot, its own to use until its next step: once
  // every rank arrived at this step, none reads the step before (the
  // rule of shm/arena.hpp).
  std::byte* spare_slot() { return a_.slot(mine(), record_ ^ 1); }
  // Single copy (shm/single_copy.hpp): whether this rank may read group
  // rank p's memory; a read of it, false where it may be torn because p
  // left this call (failed there: its buffers may have gone back to its
  // caller): then the caller waits for the failure that made p leave
  // (wait_failed). A rank whose process is gone fails the call with
  // errc::peer_lost; a read the kernel refuses, with errc::system_error.
  bool may_read(int p) { return t_.may_read(global(p)); }
  // Whether each of the host's ranks has a core of its own (polling
  // yields otherwise: cpu/startup/connect.hpp).
  bool has_cores() const { return !t_.outnumbered(); }
  bool read(int p, void* to, std::uint64_t from, std::size_t n) {
    const int why = t_.read_peer(op(), global(p), to, from, n);
    if (why == 0) return still_in(p);
    if (!still_in(p)) return false;
    std::rethrow_exception(
        t_.make_error(errc::system_error, op(), "rank " + std::to_string(global(p)),
                      "process_vm_readv of " + std::to_string(n) +
                          " bytes of its buffer: " + std::generic_category().message(why)));
  }
  bool still_in(int p) {
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the reads come before this look
    return a_.state(static_cast<std::size_t>(p)).left.load(std::memory_order_acquire) <
           shm::arena_stamp(op().seq, 0);
  }
  // Until the call fails: a member's lost link, a failure another member
  // forwards, or the deadline (never returns normally).
  DCOMM_EMIT_ON_USE detail::task<void> wait_failed();

  // Group rank p's slot at this step (once it arrived).
  const std::byte* slot_of(int p) {
    const auto local = static_cast<std::size_t>(p);
    shm::arena_record* r = a_.find(local, stamp_);
    return a_.slot(local, r ? a_.index_of(local, *r) : 0);
  }

 private:
  // A rank's place in the arena is its group rank (every member is on this
  // host: transport::arena_of); links and errors name global ranks.
  std::size_t mine() const { return static_cast<std::size_t>(me_); }
  int global(int q) { return op().members[static_cast<std::size_t>(q)]; }

  // Ranks below cursor_ have been seen at this step.
  bool reached(bool reduced) {
    for (; cursor_ < n_; ++cursor_) {
      if (cursor_ == me_) continue;
      shm::arena_record* r = a_.find(static_cast<std::size_t>(cursor_), stamp_);
      if (r && !reduced && !same_call(*r)) return false;
      if (r && !reduced) op().arrivals.merge(detail::arrivals_of(r->arrivals));
      if (!there(r, reduced)) {
        // Not yet: are those still to come alive?
        for (int q = cursor_; q < n_; ++q)
          if (q != me_ && !there(a_.find(static_cast<std::size_t>(q), stamp_), reduced) &&
              t_.arena_peer_gone(op(), global(q)))
            return false;
        return false;
      }
    }
    return true;
  }
  bool others_done() {
    if (reused_ == 0) return true;
    for (; cursor_ < n_; ++cursor_)
      if (cursor_ != me_ && !a_.done_with(static_cast<std::size_t>(cursor_), reused_)) {
        t_.arena_peer_gone(op(), global(cursor_));
        return false;
      }
    cursor_ = 0;
    return true;
  }
  bool there(const shm::arena_record* r, bool reduced) const {
    return r && (!reduced || r->reduced.load(std::memory_order_acquire) == stamp_);
  }
  bool same_call(const shm::arena_record& r) {
    call_signature theirs;
    std::memcpy(&theirs, r.call, sizeof theirs);
    if (r.group == op().group && theirs == op().sig) return true;
    t_.arena_mismatch(op(), global(cursor_), theirs);
    return false;
  }

  call& c_;
  transport& t_;
  transport::arena_seat& seat_;
  shm::arena& a_;
  int me_, n_;
  std::uint32_t step_ = 0;
  std::uint64_t stamp_ = 0;
  std::size_t record_ = 0;
  int cursor_ = 0;
  bool rings_noted_ = false;  // at this step, once every rank arrived
  std::uint64_t reused_ = 0;  // the stamp the first step overwrites
};

DCOMM_EMIT_ON_USE_DEFINITION auto arena_call::enter() -> detail::task<void> {
  if (seat_.first != &op()) co_await c_.wait_until([this] { return seat_.first == &op(); });
  // Now it polls the arena while it waits (transport::wait spins).
  op().on_arena = true;
  // The record its first step overwrites: after a call that failed
  // here, other ranks may still read it (see shm/arena.hpp).
  if (!seat_.synced) {
    reused_ = a_.record(mine(), seat_.record).arrived.load(std::memory_order_relaxed);
    if (!others_done()) co_await c_.wait_until([this] { return others_done(); });
  }
  // An earlier send of ours a member refused fails this call (it needs
  // every member), as it would fail a call with messages to it.
  if (t_.report_refused_send_in_arena(op())) co_await c_.wait_until([] { return false; });
}

DCOMM_EMIT_ON_USE_DEFINITION auto arena_call::wait_arrived() -> detail::task<void> {
  return c_.wait_until([this] { return all_arrived(); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto arena_call::wait_reduced() -> detail::task<void> {
  return c_.wait_until([this] { return reached(true); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto arena_call::wait_failed() -> detail::task<void> {
  return c_.wait_until([this] {
    for (int q = 0; q < n_; ++q)
      if (q != me_ && t_.arena_peer_gone(op(), global(q))) return false;
    return false;
  });
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::arena_call::enter<void>() -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::arena_call::wait_arrived<void>() -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::arena_call::wait_reduced<void>() -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::arena_call::wait_failed<void>() -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
