// One operation of the CPU backend in progress: the algorithms post sends
// and receives to group ranks through it and wait for them; it carries the
// deadline, the call signature and the error context.
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cpu/transport/transport.hpp"
#include "dcomm/detail/partition.hpp"

namespace dcomm::cpu {

// Elements [offset, offset + count) of a buffer.
// A part of a buffer, and how the algorithms cut one (detail/partition.hpp).
using detail::extent;
using detail::split;

inline int mod(int a, int n) {
  return ((a % n) + n) % n;
}

// The rule that makes a collective match across ranks (the identity it
// relies on, (group id, sequence number, step) plus signature, is stated in
// impl/call_identity.hpp). Every message of a
// call carries its signature (op, dtype, count, reduce op, root, algorithm,
// slices) and its key (group, sequence number, step); a receiver fails the
// call with errc::mismatch when a message of the same group and sequence
// number carries another signature, whatever its step (transport.hpp), and
// tells the group. That catches every mismatch before any rank completes,
// provided each rank's completion depends on a message chain from every
// other rank, each link of which was checked: true of all_reduce,
// all_gather, reduce_scatter, all_to_all, the _v forms and barrier (every
// rank's result needs every rank's input), not of the rooted operations
// (a broadcast root only sends; a gather's non-roots only send). Those add
// a confirmation: a dissemination of empty messages (round k: to rank +
// 2^k, from rank - 2^k, on steps of their own), each sent after the
// previous round's arrived, so that log2(n) rounds later every rank has
// heard, through checked messages, from every other. It runs alongside the
// algorithm and costs nothing in a world of one.
inline bool needs_confirmation(operation op) {
  switch (op) {
    case operation::broadcast:
    case operation::reduce:
    case operation::scatter:
    case operation::gather:
      return true;
    default:
      return false;
  }
}

// Steps at and above this one are the confirmation's (an algorithm's, and
// a slice's step base, stay below: at most 255 slices of 2^24 steps).
inline constexpr std::uint32_t confirmation_step = 0xff000000u;

class call {
 public:
  // Its errors name ctx.operation, what the user called.
  call(transport& t, const op_context& ctx, bool collective, call_signature sig)
      : t_(t), group_(*ctx.group), op_(t.get_executor(), ctx.deadline), report_(ctx.report) {
    op_.operation = name(ctx.operation);
    op_.entered = ctx.issued;
    op_.collective = collective;
    op_.group = group_.id;
    op_.group_name = group_.name;
    op_.seq = ctx.seq;
    op_.sig = sig;
    key_.collective = collective ? 1 : 0;
    key_.group = group_.id;
    key_.seq = ctx.seq;
    if (collective) {
      op_.members = group_.ranks;
      // This rank's call, the first thing its messages tell of the call's
      // arrivals (detail/arrivals.hpp).
      op_.arrivals.note(
          std::chrono::duration_cast<std::chrono::nanoseconds>(ctx.issued.time_since_epoch())
              .count(),
          t.rank());
    }
    // In the arena every rank waits for every other's checked record.
    if (collective && sig.confirmed && !sig.arena && group_.size() > 1) {
      rounds_left_ = 0;
      for (int distance = 1; distance < group_.size(); distance <<= 1) ++rounds_left_;
    }
    t_.add_op(op_);
  }
  call(const call&) = delete;
  call& operator=(const call&) = delete;
  ~call() {
    if (report_) tell(*report_);
    t_.remove_op(op_);
    t_.release_items(op_);
  }

  int rank() const { return view_.members ? view_.rank : group_.rank; }
  int size() const { return view_.members ? view_.size : group_.size(); }
  // The group's ranks on hosts (cpu/startup/hosts.hpp).
  const host_layout& hosts() { return t_.hosts_of(group_); }
  const group_state& group() const { return group_; }

  // A phase among some of the group's ranks (a hierarchical collective's
  // host, or one rank per host): while it is set, rank(), size() and the
  // peers of send and recv count among `members` (group ranks), and steps
  // start `step_offset` above the step base, apart from the other phases'.
  struct view {
    const int* members = nullptr;  // none: the whole group
    int size = 0;
    int rank = 0;  // this rank's index in members
    std::uint32_t step_offset = 0;
  };
  void set_view(view v) { view_ = v; }
  // The algorithm that runs (the report's; the first said is kept: a
  // hierarchical collective runs others inside).
  void ran(dcomm::algorithm a) {
    if (op_.ran == dcomm::algorithm::automatic) op_.ran = a;
  }
  const call_signature& signature() const { return op_.sig; }
  transport& net() { return t_; }
  op_state& state() { return op_; }

  io_item& recv(int group_peer, std::uint32_t step, void* dst, std::size_t bytes) {
    io_item& it = make(group_peer, step, bytes);
    it.recv_buffer = dst;
    t_.post_recv(it);
    return it;
  }
  io_item& send(int group_peer, std::uint32_t step, const void* src, std::size_t bytes) {
    io_item& it = make(group_peer, step, bytes);
    it.is_send = true;
    it.send_buffer = src;
    t_.post_send(it);
    return it;
  }

  // A send whose data becomes ready in parts: announced now (so that it
  // keeps its place before later sends with the same key), its bytes sent
  // as ready() allows.
  io_item& send_staged(int group_peer, std::uint32_t step, const void* src, std::size_t bytes) {
    io_item& it = make(group_peer, step, bytes);
    it.is_send = true;
    it.staged = true;
    it.send_buffer = src;
    t_.post_send(it);
    return it;
  }
  void ready(io_item& staged_send, std::size_t bytes) { t_.send_ready(staged_send, bytes); }
  // A receive that wakes the call each time `progress` more bytes arrived.
  io_item& recv_progress(int group_peer, std::uint32_t step, void* dst, std::size_t bytes,
                         std::size_t progress) {
    io_item& it = make(group_peer, step, bytes);
    it.recv_buffer = dst;
    it.progress = progress;
    t_.post_recv(it);
    return it;
  }

  // Added to every step from now on: an algorithm run again within the
  // same call (one slice of a staged CUDA tensor after another) keeps its
  // messages apart from the previous run's.
  void set_step_base(std::uint32_t base) { step_base_ = base; }

  // A message already done needs no wait, and saves the wait's coroutine
  // frames (pipelines test this per chunk).
  static bool done(const io_item& it) { return it.state == item_state::done; }

  // Not coroutines themselves: one coroutine frame less per wait. Each
  // wake-up also moves the confirmation on.
  DCOMM_EMIT_ON_USE detail::task<void> wait(io_item& it);
  template <class Pred>
  detail::task<void> wait_until(Pred pred) {
    return t_.wait(op_, [this, pred = std::move(pred)] {
      confirm();
      return pred();
    });
  }
  DCOMM_EMIT_ON_USE detail::task<void> wait_all();

  // Runs an algorithm to the end: every message done (the confirmation's
  // included), or everything taken back before the failure is rethrown.
  // `body` returns the algorithm's task, or nothing where it only posts
  // (send, recv): no coroutine frame of its own. Nor is there one for the
  // last wait where everything is already done (the arena's calls).
  template <class Body>
  detail::task<void> run(Body body) {
    if (op_.failure) co_await t_.abandon(op_);  // lost peer, aborted: before any byte
    // What at_once caught, if it ran first; else what the body throws.
    std::exception_ptr failure = std::exchange(failed_at_once_, nullptr);
    if (!failure) {
      try {
        confirm();
        if constexpr (std::is_void_v<std::invoke_result_t<Body&>>)
          body();
        else
          co_await body();
        if (op_.failure || !all_done()) co_await wait_all();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) co_await t_.abandon(op_, failure);
  }

  // The algorithm's first part run to the end at once, without a coroutine
  // frame (run's, the algorithm's, its wait's): `body` says whether it got
  // there (a small call in the arena whose ranks all arrived within one
  // spin: cpu/algorithms/shared_memory.hpp). False: the caller co_awaits
  // run() with the rest, which also reports what failed here.
  template <class Body>
  bool at_once(Body body) {
    if (op_.failure) return false;
    try {
      confirm();
      return body() && !op_.failure && all_done();
    } catch (...) {
      failed_at_once_ = std::current_exception();
      return false;
    }
  }

  // Rejects input before anything is sent, naming the call.
  [[noreturn]] void invalid(std::string detail) {
    std::rethrow_exception(t_.make_error(errc::invalid_argument, op_, {}, std::move(detail)));
  }

 private:
  // A peer as the algorithm counts it (in the view, if one is set).
  int global(int peer) const {
    const int group_peer = view_.members ? view_.members[peer] : peer;
    return group_.ranks[static_cast<std::size_t>(group_peer)];
  }

  // What the call says of itself once it ends (op_context::report).
  void tell(op_report& r) const {
    r.carried.bits |= op_.carried;
    if (r.ran == dcomm::algorithm::automatic)
      r.ran = op_.ran != dcomm::algorithm::automatic ? op_.ran : op_.sig.algo;
    if (op_.collective && group_.size() > 1) r.arrivals.merge(op_.arrivals);
  }

  // Every message done, the confirmation's included.
  bool all_done() {
    confirm();
    return rounds_left_ == 0 &&
           std::all_of(op_.items.begin(), op_.items.end(),
                       [](const io_item& i) { return i.state == item_state::done; });
  }

  // Posts the confirmation's next round once the previous one has arrived
  // (see needs_confirmation).
  void confirm() {
    while (rounds_left_ > 0 && !op_.failure) {
      if (confirm_recv_) {
        if (confirm_recv_->state != item_state::done) return;
        confirm_distance_ <<= 1;
        if (--rounds_left_ == 0) return;
      }
      // Steps of its own, whatever the step base of a slice; among the
      // whole group, whatever the view.
      const int n = group_.size(), r = group_.rank;
      const auto step =
          confirmation_step +
          static_cast<std::uint32_t>(std::countr_zero(static_cast<unsigned>(confirm_distance_)));
      const view phase = std::exchange(view_, view{});
      io_item& out = make(mod(r + confirm_distance_, n), 0, 0);
      out.key.step = step;
      out.is_send = true;
      t_.post_send(out);
      io_item& in = make(mod(r - confirm_distance_, n), 0, 0);
      view_ = phase;
      in.key.step = step;
      confirm_recv_ = &in;
      t_.post_recv(in);
    }
  }

  io_item& make(int group_peer, std::uint32_t step, std::size_t bytes) {
    io_item& it = t_.new_item(op_);
    it.peer = global(group_peer);
    it.key = key_;
    it.key.step = step_base_ + view_.step_offset + step;
    it.sig = op_.sig;
    it.bytes = bytes;
    return it;
  }

  transport& t_;
  group_state& group_;
  op_state op_;
  op_report* report_;
  match_key key_{};
  std::uint32_t step_base_ = 0;
  view view_{};
  // The confirmation: rounds still to complete, and the current round's
  // receive and distance (round k: 2^k).
  int rounds_left_ = 0;
  int confirm_distance_ = 1;
  io_item* confirm_recv_ = nullptr;
  std::exception_ptr failed_at_once_;  // for run() to report
};

DCOMM_EMIT_ON_USE_DEFINITION auto call::wait(io_item& it) -> detail::task<void> {
  return t_.wait(op_, [this, &it] {
    confirm();
    return it.state == item_state::done;
  });
}

DCOMM_EMIT_ON_USE_DEFINITION auto call::wait_all() -> detail::task<void> {
  return t_.wait(op_, [this] { return all_done(); });
}

inline char* bytes_at(void* p, std::size_t offset) {
  return static_cast<char*>(p) + offset;
}
inline const char* bytes_at(const void* p, std::size_t offset) {
  return static_cast<const char*>(p) + offset;
}

// Scratch memory for an algorithm, borrowed from the transport's pool for
// the call (one buffer per backend would race between concurrent calls).
// An algorithm that sends from or receives into its scratch must
// wait_all() before it goes out of scope.
class scratch {
 public:
  explicit scratch(call& c) : memory_(c.net().scratch_memory()) {}
  void* get(std::size_t n) { return memory_.get(n); }

 private:
  pooled_vector<std::byte> memory_;
};

// Room for n item pointers (the receives of one ring step), borrowed the same way.
class item_slots {
 public:
  explicit item_slots(call& c) : slots_(c.net().item_slots()) {}
  io_item** get(std::size_t n) { return slots_.get(n); }

 private:
  pooled_vector<io_item*> slots_;
};

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::call::wait<void>(io_item& it) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::call::wait_all<void>() -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
