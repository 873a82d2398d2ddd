// The transport's side of the host's shared memory segment (shm/): the
// ranks of this host reached through it (their links:
// cpu/transport/shm_link.hpp), this rank's identity and whereabouts in it,
// polling, the doorbell, single copy reads for the arenas, and the arenas.
//
// Waiting: an operation that waits polls the rings for up to `shm_spin`
// (the readers run between polls); then this rank says in its doorbell
// word that it sleeps, and a peer that writes to it wakes its executor
// through the eventfd, which listen_bell watches. Part of cpu/transport/transport.hpp.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>

#include "dcomm/cpu/transport/transport.hpp"
#include "dcomm/detail/clock.hpp"

namespace dcomm::cpu {

// The segment shared with the ranks of shm.local (make_link gives them
// shared memory links).
DCOMM_DECL void transport::use_shm(const shm_links& shm) {
  const auto me = std::find(shm.local.begin(), shm.local.end(), rank_);
  shm_me_ = static_cast<int>(me - shm.local.begin());
  shm_local_ = shm.local;
  shm_ = shm.segment;
  // Who this rank is, for peers that read its buffers (shm/single_copy.hpp);
  // published before anything it sends through the rings.
  shm::process_identity& me_id = shm_->identity(static_cast<std::size_t>(shm_me_));
  me_id.base = reinterpret_cast<std::uintptr_t>(shm_->base());
  std::random_device random;
  me_id.nonce = ((std::uint64_t{random()} << 32) | random()) | 1;  // never 0
  me_id.pid.store(static_cast<std::uint64_t>(::getpid()), std::memory_order_release);
  arenas_.reserve(1 + shm::group_arenas);
  // Every rank on this host: the world group meets in the host's arena.
  if (static_cast<int>(shm.local.size()) == world_)
    arenas_.push_back({.group = 0, .arena = shm_->arena()});
}

// This rank's whereabouts on its board (shm/whereabouts.hpp), at each
// collective's start and end (`left`: the one that just ended): for the
// ranks of this host, when a probe of theirs finds this one silent.
DCOMM_DECL void transport::post_whereabouts(const op_state* left) {
  if (!shm_) return;
  const op_state* oldest = nullptr;  // the list runs newest first
  for (const op_state* op = ops_; op; op = op->next_op)
    if (op->collective) oldest = op;
  auto entry = [](const op_state& op, std::int64_t ns) {
    return shm::board_call{op.group, op.seq + 1, static_cast<std::uint8_t>(op.sig.op), ns};
  };
  const shm::board_call in =
      oldest ? entry(*oldest, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  oldest->entered.time_since_epoch())
                                  .count())
             : shm::board_call{};
  if (!left) return shm_->board(static_cast<std::size_t>(shm_me_)).post(in, nullptr);
  const shm::board_call ended = entry(*left, detail::coarse_steady_ns());
  shm_->board(static_cast<std::size_t>(shm_me_)).post(in, &ended);
}

// What a silent peer of this host last wrote on its board, as a clause of
// a timeout's message ("" where it cannot be read).
DCOMM_DECL std::string transport::board_whereabouts(int peer, const op_state& op) const {
  const shm_link* s = shm_of(peer);
  if (!shm_ || !s) return {};
  const auto r = shm_->board(s->local).read();
  if (!r) return {};
  const std::int64_t now = detail::coarse_steady_ns();
  auto call = [&](const shm::board_call& c) {
    std::string s =
        std::string(name(static_cast<operation>(c.op))) + " #" + std::to_string(c.seq_plus_one - 1);
    if (c.group == op.group && c.seq_plus_one == op.seq + 1) return "this call (" + s + ")";
    if (c.group != op.group) {
      char g[40];
      std::snprintf(g, sizeof g, " of group 0x%llx", static_cast<unsigned long long>(c.group));
      s += g;
    }
    return s;
  };
  auto ago = [&](std::int64_t ns) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f s",
                  static_cast<double>(std::max<std::int64_t>(now - ns, 0)) / 1e9);
    return std::string(b);
  };
  if (r->in.any())
    return "its shared memory says it is in " + call(r->in) + ", made " + ago(r->in.ns) + " ago";
  if (r->left.any())
    return "its shared memory says it is in no collective: its last, " + call(r->left) +
           ", ended " + ago(r->left.ns) + " ago (busy outside dcomm, or stopped?)";
  return "its shared memory says it has made no collective call";
}

// While a peer's reader waits between frames with nothing staged, the
// eager messages its ring holds whole are taken here, by the op that polls
// (spin_shm) or the doorbell's listener, as read_frames would take them:
// a small message then costs no trip through the scheduler (waking the
// reader, which then wakes the op it completes): the op that waited for it
// goes on within its poll. Anything else (a control or data frame, a
// payload not all there yet, bytes of a frame already staged) stays for
// the reader. Whether a message taken woke an op other than `spinner`
// (whose handler then waits for the scheduler): the spinner's own receives
// only need its condition looked at again.
DCOMM_DECL bool transport::read_eager_inline(peer_link& l, shm_link& s, int peer,
                                             const op_state* spinner) {
  bool woke = false;
  while (l.between_frames && s.reader_waiting && l.begin == l.end && s.open()) {
    wire_header h;
    if (!s.ring.peek(&h, sizeof h) || h.magic != wire_magic || h.kind != msg_kind::eager ||
        s.ring.readable_bytes() - sizeof h < h.bytes)
      break;
    s.ring.read_some(nullptr, sizeof h);
    const payload_target t = eager_target(l, peer, h);
    s.ring.read_some(t.dst, h.bytes);  // no target: dropped (or refused: its op failed)
    if (t.item) {
      t.item->arrived += h.bytes;
      complete(*t.item);
      if (t.item->op != spinner) woke = true;
    } else if (t.msg) {
      file_unexpected(l, t.msg);
    } else {
      woke = true;
    }
  }
  return woke;
}

// Takes the small messages it can (read_eager_inline), wakes the readers
// whose rings have bytes (or whose peer is gone) and resumes writers that
// have room again. Whether any handler now waits to run (a message taken
// for `spinner` alone does not count: spin_shm looks at its condition).
DCOMM_DECL bool transport::poll_shm(const op_state* spinner) {
  bool any = false;
  for (int p : shm_peers_) {
    shm_link& s = *shm_of(p);
    if (read_eager_inline(*links_[static_cast<std::size_t>(p)], s, p, spinner)) any = true;
    if (s.wake_reader()) any = true;
    if (s.writer_blocked && s.open() && s.ring.writable()) {
      s.writer_blocked = false;
      start_write(p);
      any = true;
    }
  }
  return any;
}

// This rank's doorbell: while no operation polls, a peer that writes to
// it finds it asleep and writes its eventfd, which wakes this coroutine.
// The descriptor lives in this frame (an I/O object must not outlive its
// io_context, and the transport may); close_bell_if_unused closes it.
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> transport::listen_bell(
    std::shared_ptr<transport> self) {
  const auto me = static_cast<std::size_t>(self->shm_me_);
  const int fd = ::dup(self->shm_->bell_fds()[me]);
  if (fd < 0) co_return;  // out of descriptors: peers' writes are still seen when polling
  asio::posix::stream_descriptor descriptor(self->ex_, fd);
  struct forget {
    transport& t;
    ~forget() { t.bell_ = nullptr; }
  } guard{*self};
  self->bell_ = &descriptor;
  shm::doorbell_word& bell = self->shm_->bell(me);
  std::uint64_t count = 0;
  for (;;) {
    // Asleep first, then a last look: a write made before this store is
    // seen by the poll, one made after rings the bell.
    bell.state.store(shm::doorbell_word::asleep, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    self->poll_shm();
    self->wake_arena_holder();
    // A read, not a wait for readability: the reactor registers the
    // descriptor edge-triggered, and a wait started after the ring's edge
    // would sleep through it (a read is tried at once, and drains).
    auto [ec, n] =
        co_await descriptor.async_read_some(asio::buffer(&count, sizeof count), detail::use_task);
    if (ec || !descriptor.is_open()) co_return;
  }
}

// The bell asleep again after a spin that found what it waited for, then
// a last look: a write made before this store is seen by the poll, one
// made after rings the bell (as in listen_bell).
DCOMM_DECL void transport::settle_bell() {
  bell_settling_ = false;
  shm_->bell(static_cast<std::size_t>(shm_me_))
      .state.store(shm::doorbell_word::asleep, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  poll_shm();
  wake_arena_holder();
}

// Once no shared memory link is open, the doorbell closes too (its
// listener holds the transport).
DCOMM_DECL void transport::close_bell_if_unused() {
  if (!bell_ || !bell_->is_open()) return;
  for (int p : shm_peers_)
    if (shm_of(p)->open()) return;
  asio::error_code ignored;
  bell_->close(ignored);
}

// --- single copy (shm/single_copy.hpp) ---

DCOMM_DECL bool transport::may_read(int p) {
  shm_link* s = shm_of(p);
  return s && s->may_read();
}

DCOMM_DECL int transport::read_peer(op_state& op, int p, void* to, std::uint64_t from,
                                    std::size_t n) {
  shm_link& s = *shm_of(p);
  const int saved = errno;
  const auto read = s.read_memory(to, from, n);
  const int why = read == shm::read_result::done ? 0 : errno;
  errno = saved;
  if (why == ESRCH) {  // its process is gone (its link will say so too)
    if (op.lost_rank < 0) op.lost_rank = p;
    note_cause(fail_reason::peer_lost, p);
    std::rethrow_exception(make_error(
        errc::peer_lost, op, "rank " + std::to_string(p),
        "its process is gone (process_vm_readv: " + std::generic_category().message(why) + ")",
        links_[static_cast<std::size_t>(p)]->address));
  }
  return why;
}

// --- the arenas (cpu/algorithms/shm_arena.hpp) ---

DCOMM_DECL transport::arena_seat* transport::arena_of(const group_state& g) {
  if (!shm_ || g.size() < 2) return nullptr;
  for (arena_seat& seat : arenas_)
    if (seat.group == g.id) return &seat;
  if (g.id == 0) return nullptr;  // the world spans hosts
  for (int p : g.ranks)
    if (p != rank_ && !links_[static_cast<std::size_t>(p)]->link->abilities.host_arena)
      return nullptr;
  // Every member is on this host, linked through the segment. The claim's
  // key is never 0 (a free claim); a group id of 0 is the world's.
  const std::size_t i = shm::claim_arena(shm_->claims(), g.id);
  if (i == shm::group_arenas) return nullptr;  // all taken: messages
  arenas_.push_back({.group = g.id, .arena = shm_->arena(1 + i)});
  return &arenas_.back();
}

// Calls take an arena in the order they queued (the order they started).
DCOMM_DECL void transport::queue_for_arena(arena_seat& seat, op_state& op) {
  (seat.last ? seat.last->next_on_arena : seat.first) = &op;
  seat.last = &op;
}

DCOMM_DECL void transport::leave_arena(arena_seat& seat, op_state& op) {
  op_state* before = nullptr;
  for (op_state* i = seat.first; i && i != &op; i = i->next_on_arena) before = i;
  (before ? before->next_on_arena : seat.first) = op.next_on_arena;
  if (seat.last == &op) seat.last = before;
  op.next_on_arena = nullptr;
  op.on_arena = false;
  seat.reading_rings = false;
  if (!before && seat.first) seat.first->wake();  // its turn
}

// A reader of a ring handled every frame it read: the arena's holder
// waiting for the rings may go on, and an op that woke the reader polls
// again.
DCOMM_DECL void transport::reader_idle() {
  for (arena_seat& seat : arenas_)
    if (seat.reading_rings && seat.first) seat.first->wake();
  for (op_state* op = ops_; op; op = op->next_op)
    if (std::exchange(op->polls_after_readers, false)) op->wake();
}

DCOMM_DECL void transport::wake_arena_holder() {
  for (arena_seat& seat : arenas_)
    if (seat.first) seat.first->wake();
}

// After a release store that a sleeping peer must see: either its last
// look sees the store or this sees it asleep (shm::ring).
DCOMM_DECL void transport::ring_local_peers() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const auto& fds = shm_->bell_fds();
  for (std::size_t i = 0; i < fds.size(); ++i)
    if (static_cast<int>(i) != shm_me_) shm::ring(shm_->bell(i), fds[i]);
}

DCOMM_DECL bool transport::arena_peer_gone(op_state& op, int peer) {
  if (!links_[static_cast<std::size_t>(peer)]->lost) return false;
  fail_op(op, lost_error(op, peer));
  return true;
}

// Every peer has arrived at the step (its stamp was acquired): what its
// ring to this rank holds now includes every frame it wrote before (a
// report of a send of ours it refused, above all), which must fail this
// call, not the next one. (The mark is the link's, not the arena's: a
// step of another group's arena that notes later only asks for more.)
DCOMM_DECL void transport::note_arena_rings(const op_state& op) {
  for (int p : op.members)
    if (shm_link* s = p == rank_ ? nullptr : shm_of(p))
      s->read_before_step = s->ring.peer_written();
}

// Whether the readers have read that far. A reader handles what it read
// before it waits again (it waits only in shm_readable), and it runs on
// this executor: once the bytes are read, their frames are handled.
DCOMM_DECL bool transport::arena_rings_read(arena_seat& seat, const op_state& op) {
  for (int p : op.members) {
    shm_link* s = p == rank_ ? nullptr : shm_of(p);
    if (!s || links_[static_cast<std::size_t>(p)]->lost || s->peer_gone || !s->open()) continue;
    if (s->ring.consumed() < s->read_before_step) {
      seat.reading_rings = true;
      return false;
    }
  }
  seat.reading_rings = false;
  return true;
}

DCOMM_DECL void transport::arena_mismatch(op_state& op, int peer, const call_signature& theirs) {
  mismatched_call(op, peer, theirs);
}

}  // namespace dcomm::cpu
