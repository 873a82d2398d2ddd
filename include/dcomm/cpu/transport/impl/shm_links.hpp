// The transport's links to peers on the same host (cpu/startup/connect.hpp decides
// which): the same frames as on a socket, written to and read from a pair
// of shared memory rings (shm/channel.hpp), so that matching, mismatch
// detection, probes, failure forwarding and goodbyes work unchanged. The
// socket to such a peer carries nothing; it stays open so that the kernel
// tells when the peer is gone (closed, killed, crashed) at once.
//
// Waiting: an operation that waits polls the rings for up to `shm_spin`
// (the readers run between polls); then this rank says in its doorbell
// word that it sleeps, and a peer that writes to it wakes its executor
// through the eventfd, which listen_bell watches. Part of cpu/transport/transport.hpp.
#pragma once

#include <sched.h>
#include <sys/socket.h>
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
#include <tuple>
#include <utility>

#include "dcomm/cpu/transport/transport.hpp"
#include "dcomm/detail/clock.hpp"

namespace dcomm::cpu {

// Links to the ranks of shm.local go through the segment.
inline void transport::use_shm(shm_links shm) {
  const auto me = std::find(shm.local.begin(), shm.local.end(), rank_);
  shm_me_ = static_cast<int>(me - shm.local.begin());
  for (std::size_t i = 0; i < shm.local.size(); ++i) {
    const int p = shm.local[i];
    if (p == rank_) continue;
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    l.shm = std::make_unique<shm::channel>(*shm.segment, static_cast<std::size_t>(shm_me_), i);
    l.shm_local = i;
    shm_peers_.push_back(p);
  }
  shm_ = std::move(shm.segment);
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
inline void transport::post_whereabouts(const op_state* left) {
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
inline std::string transport::board_whereabouts(int peer, const op_state& op) const {
  const peer_link& l = *links_[static_cast<std::size_t>(peer)];
  if (!shm_ || !l.shm) return {};
  const auto r = shm_->board(l.shm_local).read();
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

// Writing: the link's frames in order, as far as the ring has room; the
// rest once the reader made some (poll_shm). A send is done once its
// frame is in the ring: the buffer is free again.
inline void transport::shm_write(int peer) {
  peer_link& l = *links_[static_cast<std::size_t>(peer)];
  if (l.shm_writer_blocked || l.lost || !l.socket.is_open()) return;
  while (!l.frames.empty()) {
    outgoing_frame& f = l.frames.front();
    std::size_t& done = l.shm_frame_written;
    if (done == 0 && f.cancelled) {
      l.frames.pop_front();
      continue;
    }
    constexpr std::size_t header_bytes = sizeof(wire_header);
    const std::size_t total = header_bytes + f.bytes;
    if (done < header_bytes)
      done +=
          l.shm->write_some(reinterpret_cast<const char*>(&f.header) + done, header_bytes - done);
    if (done >= header_bytes && done < total)
      done += l.shm->write_some(static_cast<const char*>(f.payload) + (done - header_bytes),
                                total - done);
    if (done < total) {
      // The ring is full: the frame goes on once the peer has read. It is
      // in progress (batch 1): a failed call's cancel leaves it be.
      l.batch = 1;
      if (f.item) f.item->in_flight = true;
      l.shm->flush();
      if (l.shm->writable()) continue;
      l.shm_writer_blocked = true;
      return;
    }
    done = 0;
    l.batch = 0;
    l.bytes_written += total;
    io_item* it = f.item;
    const std::size_t bytes = f.bytes;
    l.frames.pop_front();
    if (!it) continue;
    it->in_flight = false;
    it->written += bytes;
    if (!it->finished() && (!it->staged || it->written == it->bytes)) complete(*it);
    it->op->wake();  // also when its op is draining
  }
  l.shm->flush();
}

// Reading: waits until the ring from the peer holds bytes; throws once
// the link is closed here (operation_aborted) or the peer is gone and
// everything it wrote has been read (eof), as a socket read would.
DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> transport::shm_readable(peer_link& l) {
  asio::steady_timer wake(l.socket.get_executor(), detail::clock::time_point::max());
  struct forget {
    peer_link& l;
    ~forget() {
      l.shm_wake = nullptr;
      l.shm_reader_waiting = false;
    }
  } guard{l};
  for (;;) {
    if (!l.socket.is_open()) throw asio::system_error(asio::error::operation_aborted);
    if (l.shm->readable()) co_return;
    if (l.shm_peer_gone) throw asio::system_error(asio::error::eof);
    // Every frame read so far is handled: the arena's holder may go on,
    // and an op that woke this reader polls again.
    for (arena_seat& seat : arenas_)
      if (seat.reading_rings && seat.first) seat.first->wake();
    for (op_state* op = ops_; op; op = op->next_op)
      if (std::exchange(op->polls_after_readers, false)) op->wake();
    l.shm_wake = &wake;
    l.shm_reader_waiting = true;
    co_await wake.async_wait(detail::use_task);
    l.shm_wake = nullptr;
    l.shm_reader_waiting = false;
    wake.expires_at(detail::clock::time_point::max());
  }
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
inline bool transport::read_eager_inline(peer_link& l, int peer, const op_state* spinner) {
  bool woke = false;
  while (l.shm_between_frames && l.shm_reader_waiting && l.begin == l.end && l.socket.is_open()) {
    wire_header h;
    if (!l.shm->peek(&h, sizeof h) || h.magic != wire_magic || h.kind != msg_kind::eager ||
        l.shm->readable_bytes() - sizeof h < h.bytes)
      break;
    l.shm->read_some(nullptr, sizeof h);
    const payload_target t = eager_target(l, peer, h);
    l.shm->read_some(t.dst, h.bytes);  // no target: dropped (or refused: its op failed)
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
inline bool transport::poll_shm(const op_state* spinner) {
  bool any = false;
  for (int p : shm_peers_) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (read_eager_inline(l, p, spinner)) any = true;
    if (l.shm_reader_waiting && (l.shm->readable() || l.shm_peer_gone)) {
      l.shm_reader_waiting = false;
      if (l.shm_wake) l.shm_wake->cancel();
      any = true;
    }
    if (l.shm_writer_blocked && l.socket.is_open() && l.shm->writable()) {
      l.shm_writer_blocked = false;
      shm_write(p);
      any = true;
    }
  }
  return any;
}

// Nothing is written to the socket of a shared memory link: it becomes
// readable only when the peer closes it or dies. Readiness can be spurious
// where several threads run the io_context (one of them may handle a
// readiness event of the socket's after this wait began that was true
// before it: a socket not yet connected reports a hang-up): a peek that
// would block means the peer is still there.
DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> transport::watch_shm_peer(
    std::shared_ptr<transport> self, int peer) {
  peer_link& l = *self->links_[static_cast<std::size_t>(peer)];
  asio::error_code ec;
  for (;;) {
    std::tie(ec) = co_await l.socket.async_wait(asio::socket_base::wait_read, detail::use_task);
    if (ec) break;
    wire_header h;
    const auto n = ::recv(l.socket.native_handle(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    // A peer that left start-up before its transport ran said why on the
    // socket (mesh_detail::say_goodbye, transport::leave_start_up): its
    // goodbye names the culprit, as one through the ring would.
    if (!l.said_bye && n == static_cast<ssize_t>(sizeof h) && h.magic == wire_magic &&
        h.kind == msg_kind::bye) {
      l.said_bye = true;
      std::tie(l.bye_reason, l.bye_culprit) = read_goodbye(h, self->world_);
    }
    break;
  }
  l.shm_peer_gone = true;
  if (l.shm_reader_waiting) {
    l.shm_reader_waiting = false;
    if (l.shm_wake) l.shm_wake->cancel();
  }
  // A writer waiting for room that a gone peer will never make.
  if (l.shm_writer_blocked && !l.lost && !ec)
    self->lose_link(peer, "writing to it failed: it closed the connection");
}

// Start-up failed here after the transport started: goodbyes name the
// rank `failure` blames. Peers still in their own start-up watch only the
// socket (mesh_detail::watch), so a shared memory link's goodbye also goes
// there; nothing else is ever sent on that socket, so it goes out at once.
inline void transport::leave_start_up(const std::exception_ptr& failure) {
  auto [reason, culprit] = mesh_detail::cause_of(failure);
  note_cause(reason, culprit);
  const wire_header bye = goodbye(first_reason_, first_culprit_);
  for (int p : shm_peers_) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (!l.socket.is_open()) continue;
    [[maybe_unused]] auto sent =
        ::send(l.socket.native_handle(), &bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
}

// This rank's doorbell: while no operation polls, a peer that writes to
// it finds it asleep and writes its eventfd, which wakes this coroutine.
// The descriptor lives in this frame (an I/O object must not outlive its
// io_context, and the transport may); close_bell_if_unused closes it.
DCOMM_EMIT_ON_USE_DEFINITION inline detail::task<void> transport::listen_bell(
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

// The bell asleep again after a spin that found what it waited for, then
// a last look: a write made before this store is seen by the poll, one
// made after rings the bell (as in listen_bell).
inline void transport::settle_bell() {
  bell_settling_ = false;
  shm_->bell(static_cast<std::size_t>(shm_me_))
      .state.store(shm::doorbell_word::asleep, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  poll_shm();
  wake_arena_holder();
}

// Once no shared memory link is open, the doorbell closes too (its
// listener holds the transport).
inline void transport::close_bell_if_unused() {
  if (!bell_ || !bell_->is_open()) return;
  for (int p : shm_peers_)
    if (links_[static_cast<std::size_t>(p)]->socket.is_open()) return;
  asio::error_code ignored;
  bell_->close(ignored);
}

// --- single copy (shm/single_copy.hpp) ---

inline bool transport::may_read(int p) {
  using direct = peer_link::direct_reads;
  peer_link& l = *links_[static_cast<std::size_t>(p)];
  if (!l.shm || !options_.shm_single_copy || l.shm_direct == direct::refused) return false;
  if (l.shm_direct == direct::untried) {
    l.shm_direct = shm::is_reachable(shm_->identity(l.shm_local), shm_->base()) ? direct::allowed
                                                                                : direct::refused;
    if (l.shm_direct == direct::refused)
      log(detail::log_level::info, "rank " + std::to_string(rank_) + " cannot read rank " +
                                       std::to_string(p) +
                                       "'s memory (process_vm_readv): its large messages and "
                                       "collectives go through shared memory in two copies");
  }
  return l.shm_direct == direct::allowed;
}

inline int transport::read_peer(op_state& op, int p, void* to, std::uint64_t from, std::size_t n) {
  peer_link& l = *links_[static_cast<std::size_t>(p)];
  const int saved = errno;
  const auto read = shm::read_process(
      shm_->identity(l.shm_local).pid.load(std::memory_order_relaxed), to, from, n);
  const int why = read == shm::read_result::done ? 0 : errno;
  errno = saved;
  if (!why) l.bytes_read_directly += n;
  if (read == shm::read_result::refused) l.shm_direct = peer_link::direct_reads::refused;
  if (why == ESRCH) {  // its process is gone (its link will say so too)
    if (op.lost_rank < 0) op.lost_rank = p;
    note_cause(fail_reason::peer_lost, p);
    std::rethrow_exception(make_error(
        errc::peer_lost, op, "rank " + std::to_string(p),
        "its process is gone (process_vm_readv: " + std::generic_category().message(why) + ")",
        l.address));
  }
  return why;
}

// A large message from a peer of this host, offered at rts.cookie2: read
// into the receive's buffer at once. False: it goes through the ring (the
// kernel refused, the peer is not the process its identity says, or the
// peer withdrew an offer meanwhile, perhaps this one: then what was read
// may be torn, and the ring brings it again if the send still stands).
inline bool transport::read_directly(peer_link& l, io_item& it, const wire_header& rts) {
  if (!it.bytes || !may_read(it.peer)) return false;
  const shm::process_identity& peer = shm_->identity(l.shm_local);
  const auto read = shm::read_process(peer.pid.load(std::memory_order_relaxed), it.recv_buffer,
                                      rts.cookie2, it.bytes);
  if (read == shm::read_result::refused) l.shm_direct = peer_link::direct_reads::refused;
  if (read != shm::read_result::done) return false;
  l.bytes_read_directly += it.bytes;
  // The reads above come before this look: unless the count moved, the
  // sender still held the buffer after them.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return l.shm->withdrawn_by_peer() == rts.extra;
}

// A send whose buffer a peer may be reading leaves awaiting_cts without its
// answer (its call failed, the link closed): say so before the buffer goes
// back to the caller.
inline void transport::withdraw_offer(peer_link& l, io_item& it) {
  if (it.offered && l.shm) l.shm->withdraw();
  it.offered = false;
}

// --- the arenas (cpu/algorithms/shm_arena.hpp) ---

inline transport::arena_seat* transport::arena_of(const group_state& g) {
  if (!shm_ || g.size() < 2) return nullptr;
  for (arena_seat& seat : arenas_)
    if (seat.group == g.id) return &seat;
  if (g.id == 0) return nullptr;  // the world spans hosts
  for (int p : g.ranks)
    if (p != rank_ && !shm_link(p)) return nullptr;
  // Every member is on this host, linked through the segment. The claim's
  // key is never 0 (a free claim); a group id of 0 is the world's.
  const std::size_t i = shm::claim_arena(shm_->claims(), g.id);
  if (i == shm::group_arenas) return nullptr;  // all taken: messages
  arenas_.push_back({.group = g.id, .arena = shm_->arena(1 + i)});
  return &arenas_.back();
}

// Calls take an arena in the order they queued (the order they started).
inline void transport::queue_for_arena(arena_seat& seat, op_state& op) {
  (seat.last ? seat.last->next_on_arena : seat.first) = &op;
  seat.last = &op;
}

inline void transport::leave_arena(arena_seat& seat, op_state& op) {
  op_state* before = nullptr;
  for (op_state* i = seat.first; i && i != &op; i = i->next_on_arena) before = i;
  (before ? before->next_on_arena : seat.first) = op.next_on_arena;
  if (seat.last == &op) seat.last = before;
  op.next_on_arena = nullptr;
  op.on_arena = false;
  seat.reading_rings = false;
  if (!before && seat.first) seat.first->wake();  // its turn
}

inline void transport::wake_arena_holder() {
  for (arena_seat& seat : arenas_)
    if (seat.first) seat.first->wake();
}

// After a release store that a sleeping peer must see: either its last
// look sees the store or this sees it asleep (shm::ring).
inline void transport::ring_local_peers() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const auto& fds = shm_->bell_fds();
  for (std::size_t i = 0; i < fds.size(); ++i)
    if (static_cast<int>(i) != shm_me_) shm::ring(shm_->bell(i), fds[i]);
}

inline bool transport::arena_peer_gone(op_state& op, int peer) {
  if (!links_[static_cast<std::size_t>(peer)]->lost) return false;
  fail_op(op, lost_error(op, peer));
  return true;
}

// Every peer has arrived at the step (its stamp was acquired): what its
// ring to this rank holds now includes every frame it wrote before (a
// report of a send of ours it refused, above all), which must fail this
// call, not the next one. (The mark is the link's, not the arena's: a
// step of another group's arena that notes later only asks for more.)
inline void transport::note_arena_rings(const op_state& op) {
  for (int p : op.members) {
    if (p == rank_ || !shm_link(p)) continue;
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    l.shm_read_before_step = l.shm->peer_written();
  }
}

// Whether the readers have read that far. A reader handles what it read
// before it waits again (it waits only in shm_readable), and it runs on
// this executor: once the bytes are read, their frames are handled.
inline bool transport::arena_rings_read(arena_seat& seat, const op_state& op) {
  for (int p : op.members) {
    if (p == rank_ || !shm_link(p)) continue;
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (l.lost || l.shm_peer_gone || !l.socket.is_open()) continue;
    if (l.shm->consumed() < l.shm_read_before_step) {
      seat.reading_rings = true;
      return false;
    }
  }
  seat.reading_rings = false;
  return true;
}

inline void transport::arena_mismatch(op_state& op, int peer, const call_signature& theirs) {
  mismatched_call(op, peer, theirs);
}

}  // namespace dcomm::cpu
