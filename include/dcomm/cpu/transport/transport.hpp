// The CPU backend's transport: one link per peer (cpu/transport/link.hpp: a
// socket of the mesh, socket_link.hpp, or to a peer on this host a pair of
// shared memory rings, shm_link.hpp; make_link below picks), over which
// every operation of every group travels as framed messages (but the
// collectives that run in a host's arena: cpu/algorithms/shared_memory.hpp).
//
// This header holds the transport class and its operations' life (add,
// post, wait, abandon); its other jobs have headers of their own in
// cpu/transport/impl/, included at the end: sending.hpp (posting sends,
// queueing frames, taking items back), receiving.hpp (reading frames,
// matching them to receives), failure_forwarding.hpp (fail frames, probes,
// blame, the first cause), shutdown.hpp (goodbye, drain, close) and
// shm_links.hpp (the host's shared memory: polling, the doorbell, the
// arenas), revocation.hpp and agreement.hpp (recovery: docs/elastic.md).
// Beside it in cpu/transport/: the units of work (io_items.hpp), failed
// calls (failed_calls.hpp), groups and revocations (revocations.hpp),
// agreements (agreements.hpp); the frames are in cpu/wire_format.hpp.
// Messages are matched per link by (collective?, group, tag or sequence
// number, step), first in first out, so two messages with the same key
// arrive in the order they were sent. Large messages wait for a posted
// receive, so an unexpected message never holds more than the eager limit.
//
// Everything here runs on one strand: no locks. An operation ("call") owns
// its io_items; it completes only once no socket operation still references
// a buffer it was given, so callers may free their buffers right after.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cpu/startup/hosts.hpp"
#include "dcomm/cpu/startup/mesh.hpp"
#include "dcomm/cpu/transport/agreements.hpp"
#include "dcomm/cpu/transport/failed_calls.hpp"
#include "dcomm/cpu/transport/io_items.hpp"
#include "dcomm/cpu/transport/link.hpp"
#include "dcomm/cpu/transport/pool.hpp"
#include "dcomm/cpu/transport/revocations.hpp"
#include "dcomm/cpu/transport/shm_link.hpp"
#include "dcomm/cpu/transport/socket_link.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/task.hpp"
#include "dcomm/error.hpp"
#include "dcomm/shm/segment.hpp"

namespace dcomm::cpu {

struct transport_options {
  std::size_t eager_limit = 64 * 1024;
  std::size_t stage_bytes = 256 * 1024;
  std::size_t max_batch = 16;  // frames per gathered write
  // How long a waiting operation polls its shared memory links before it
  // sleeps until a peer rings (cpu/transport/impl/shm_links.hpp); 0: it sleeps at once.
  std::chrono::nanoseconds shm_spin = std::chrono::microseconds(20);
  // Polling yields the core between looks (set where the host's ranks
  // outnumber the cores: cpu/startup/connect.hpp).
  bool shm_yield = false;
  // Large messages to a rank of this host are read from the sender's
  // buffer in one copy where the kernel allows (shm/single_copy.hpp).
  bool shm_single_copy = false;
  // A lost peer or a timeout revokes the failed call's group
  // (backend_options::revoke_on_failure).
  bool revoke_on_failure = false;
};

// The segment this rank shares with the ranks of its host (shm/), and who
// they are: their global ranks, ascending, this one among them. Empty:
// every link is a socket.
struct shm_links {
  std::shared_ptr<shm::segment> segment;
  std::vector<int> local;
};

class transport : public std::enable_shared_from_this<transport>, private link_events {
 public:
  transport(asio::any_io_executor ex, int rank, int world, mesh_sockets sockets,
            transport_options options, shm_links shm = {}, std::vector<int> host_of = {},
            const std::vector<std::int64_t>& clock_offsets = {})
      : ex_(std::move(ex)),
        rank_(rank),
        world_(world),
        options_(options),
        groups_(world),
        hosts_(std::move(host_of)) {
    if (shm.segment) use_shm(shm);
    links_.reserve(sockets.size());
    shm_of_.resize(sockets.size());
    for (std::size_t p = 0; p < sockets.size(); ++p) {
      std::string address;
      asio::error_code ec;
      if (sockets[p].is_open()) {
        auto ep = sockets[p].remote_endpoint(ec);
        if (!ec) address = detail::endpoint_address(ep);
      }
      auto l = std::make_unique<peer_link>(make_link(static_cast<int>(p), std::move(sockets[p])));
      l->link->attach(*this, static_cast<int>(p), *l);
      l->address = std::move(address);
      l->stage.resize(options_.stage_bytes);
      // Room for what a call commonly has in flight per peer, so that the
      // lists rarely grow once a job runs (growth is kept, not repeated).
      l->posted.reserve(64);
      l->unexpected.reserve(64);
      l->awaiting_data.reserve(64);
      l->awaiting_cts.reserve(64);
      if (p < clock_offsets.size()) l->clock_offset_ns = clock_offsets[p];
      links_.push_back(std::move(l));
    }
  }

  // Starts one reader per peer, then the links' own work (a shared memory
  // link watches its socket), the doorbell's listener; once, on the strand
  // (cpu/transport/impl/receiving.hpp).
  void start();
  // What the link to rank p counts calls as carried by: "shm" (shared
  // memory, a rank of this host) or "tcp".
  std::string_view link_name(int p) const {
    return links_[static_cast<std::size_t>(p)]->link->abilities.carries == transports::shm ? "shm"
                                                                                           : "tcp";
  }
  std::uint64_t bytes_sent_to(int p) const {
    return p == rank_ ? 0 : links_[static_cast<std::size_t>(p)]->bytes_written;
  }
  std::uint64_t bytes_read_directly_from(int p) const {
    return p == rank_ ? 0 : links_[static_cast<std::size_t>(p)]->link->bytes_read_directly;
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  // How group g's ranks fall on hosts (cpu/startup/hosts.hpp).
  const host_layout& hosts_of(const group_state& g) { return hosts_.of(g); }
  const transport_options& options() const { return options_; }
  const asio::any_io_executor& get_executor() const { return ex_; }
  bool peer_lost(int p) const { return links_[static_cast<std::size_t>(p)]->lost; }
  // Whether rank p left in order, having failed nothing (its goodbye said so).
  bool left_in_order(int p) const {
    const peer_link& l = *links_[static_cast<std::size_t>(p)];
    return l.said_bye && l.bye_reason == fail_reason::none;
  }
  // Whom the loss of rank p's link blames: the culprit its goodbye named,
  // or p itself (it left without one: died).
  int blame_for_loss(int p) const {
    const peer_link& l = *links_[static_cast<std::size_t>(p)];
    return l.said_bye && l.bye_reason != fail_reason::none && l.bye_culprit >= 0 ? l.bye_culprit
                                                                                 : p;
  }
  std::string peer_address(int p) const { return links_[static_cast<std::size_t>(p)]->address; }
  bool stopped() const { return aborted_ || closed_; }

  // Revocation (cpu/transport/impl/revocation.hpp): revokes `group` and
  // the groups made from it, here and on every member; a group made on
  // this rank from `parent` (kept while `alive` is).
  void revoke(std::uint64_t group, std::string why);
  void add_group(std::uint64_t parent, std::uint64_t id, std::string name,
                 std::vector<int> members, std::weak_ptr<const void> alive);
  // Agreement `number` of `group` among its live members (cpu/transport/agreements.hpp,
  // impl/agreement.hpp): `members` global ranks, `me` this rank's group rank.
  DCOMM_EMIT_ON_USE detail::task<agreed_value> agree(std::uint64_t group,
                                                     std::string_view group_name,
                                                     std::uint64_t number, std::vector<int> members,
                                                     int me, bool flag, const char* operation,
                                                     detail::clock::time_point deadline);

  void add_op(op_state& op) {
    op.next_op = ops_;
    if (ops_) ops_->prev_op = &op;
    ops_ = &op;
    if (aborted_ || closed_) {
      fail_op(op, make_error(aborted_ ? errc::aborted : errc::closed, op, {},
                             aborted_ ? "the communicator was aborted"
                                      : "the communicator was destroyed"));
      return;
    }
    if (const revocation* r = groups_.revoked(op.group); r && !op.survives_revocation)
      return fail_op(op, revoked_error(op, *r));
    // A lost member does not fail the call here: that peer may have sent
    // its part before leaving (the messages wait in `unexpected`), or may
    // have no part to play with this rank. Posting to it fails (post_recv,
    // post_send), and the ranks that fail tell the rest with fail frames.
    if (op.collective) {
      post_whereabouts(nullptr);
      auto& entered = entered_[op.group];
      entered = std::max(entered, op.seq + 1);
      const call_id id{op.group, op.seq};
      failed_calls_.enter(
          id, [this](const call_id& c) { return active_call(c.group, c.seq) != nullptr; });
      if (const failed_call* f = failed_calls_.find(id)) return fail_reported(op, *f);
      // A message of this call that came early, from a rank that made a
      // different call: whatever its step, the calls do not match.
      for (int p : op.members) {
        if (p == rank_) continue;
        for (const unexpected_msg* m : links_[static_cast<std::size_t>(p)]->unexpected)
          if (m->header.collective && m->header.group == op.group && m->header.seq == op.seq &&
              !(m->header.sig == op.sig))
            return mismatched_call(op, p, m->header.sig);
      }
    }
  }
  void remove_op(op_state& op) {
    (op.prev_op ? op.prev_op->next_op : ops_) = op.next_op;
    if (op.next_op) op.next_op->prev_op = op.prev_op;
    op.prev_op = op.next_op = nullptr;
    if (op.collective) post_whereabouts(&op);
  }

  // Items come from a free list; an op gives its items back when it ends,
  // by which time none of them is posted, queued or in flight (wait and
  // abandon see to that).
  io_item& new_item(op_state& op) {
    io_item* it = items_.take();
    it->op = &op;
    op.items.push_back(it);
    return *it;
  }
  void release_items(op_state& op) {
    for (io_item* it = op.items.release(); it;) {
      io_item* next = it->next_in_op;
      // Only if the op's coroutine was destroyed mid-flight (its executor
      // went away): take the item back from the link before reusing it.
      if (!it->finished() || it->in_flight) cancel_item(*it, false);
      *it = io_item{};
      items_.give_back(it);
      it = next;
    }
  }

  // Scratch memory and item lists for the algorithms, reused across calls.
  vector_pool<std::byte>& scratch_memory() { return scratch_memory_; }
  vector_pool<io_item*>& item_slots() { return item_slots_; }

  void fail_op(op_state& op, std::exception_ptr e) {
    if (op.failure) return;
    op.failure = std::move(e);
    op.wake();
  }

  // Posting. The item's fields (peer, key, sig, buffer, bytes) are set.
  void post_recv(io_item& it);  // cpu/transport/impl/receiving.hpp
  void post_send(io_item& it);  // cpu/transport/impl/sending.hpp
  // A staged send's first `ready` bytes may go (posted with it.staged; the
  // parts are sent in order, once the receiver has answered).
  void send_ready(io_item& it, std::size_t ready);

  // Waits until pred() holds; on failure or at the deadline, cancels the
  // op's items, waits until no I/O touches its buffers, and throws.
  // A collective that reaches its deadline first probes its group (see
  // probe_group) and fails once every member answered or `probe_grace`
  // passed, naming the ranks that did not answer or had not entered it.
  template <class Pred>
  detail::task<void> wait(op_state& op, Pred pred) {
    for (;;) {
      if (op.failure) break;
      if (pred()) co_return;
      if (op.failure) break;  // pred() may fail it (the arena's checks do)
      if (op.probe && op.probe->awaited == 0) {
        fail_op(op, timeout_error(op));
        break;
      }
      // Messages from this host may be a few hundred nanoseconds away: poll
      // for them before sleeping (what it wakes runs once this waits).
      // It may also have finished this op's sends (a blocked writer went on):
      // a wake before the wait below would be lost, so look again.
      if (options_.shm_spin.count() > 0 && waits_on_shm(op) && !std::exchange(op.spun, false)) {
        const bool found = spin_shm(op, [&] { return op.failure != nullptr || pred(); });
        if (op.failure) break;
        if (found && pred()) continue;
        // It woke a reader (or a writer went on): once the reader has
        // handled its frames it wakes this op to poll again (shm_readable),
        // for what those frames started (a cts: the data comes next).
        op.polls_after_readers = found;
      }
      // Never sleep failed: a look above may have failed the op, and its
      // wake came before this wait.
      if (op.failure) break;
      auto [ec] = co_await op.timer().async_wait(detail::use_task);
      op.polls_after_readers = false;
      if (ec || op.failure || pred()) continue;
      if (!op.probe && probe_group(op)) continue;
      fail_op(op, timeout_error(op));
    }
    co_await abandon(op);
  }

  // wait()'s first looks without its coroutine frame: whether pred()
  // holds now or within one spin over shared memory (false: the caller
  // co_awaits wait(), which sleeps, probes and fails as it does).
  template <class Pred>
  bool holds_within_spin(op_state& op, Pred pred) {
    if (op.failure) return false;
    if (pred()) return !op.failure;
    if (op.failure || options_.shm_spin.count() <= 0 || !waits_on_shm(op)) return false;
    const bool found = spin_shm(op, [&] { return op.failure != nullptr || pred(); });
    if (found && !op.failure && pred()) return true;
    op.spun = true;
    op.polls_after_readers = found;  // as wait() leaves it before it sleeps
    return false;
  }

  // Fails the op (if it has not failed), takes back its items and waits
  // until no socket operation references them; then throws the failure.
  DCOMM_EMIT_ON_USE detail::task<void> abandon(op_state& op, std::exception_ptr why = nullptr);

  static constexpr auto io_grace = std::chrono::seconds(1);

  // The host's ranks outnumber this process's cores (options::shm_yield).
  bool outnumbered() const { return options_.shm_yield; }
  // Whether an unfinished item of the op goes through shared memory, or
  // it waits in the arena.
  bool waits_on_shm(const op_state& op) const {
    if (op.on_arena) return true;
    if (shm_peers_.empty()) return false;
    return std::any_of(op.items.begin(), op.items.end(), [this](const io_item& i) {
      return !i.finished() && links_[static_cast<std::size_t>(i.peer)]->link->abilities.polled;
    });
  }

  // An arena this rank meets its group in (cpu/algorithms/shm_arena.hpp): the host's,
  // for the world group where every rank is on this host, or a group's
  // own (shm/arena.hpp). The calls queued for it (the first holds it: a
  // list through op_state), which of this rank's two records its next
  // step uses, and whether its last step saw every other rank arrive
  // (else a call failed mid-step here).
  struct arena_seat {
    std::uint64_t group = 0;
    shm::arena arena;
    op_state* first = nullptr;
    op_state* last = nullptr;
    std::size_t record = 0;
    bool synced = true;
    bool reading_rings = false;  // the holder waits for the readers

    std::size_t next_record() { return std::exchange(record, record ^ 1); }
  };
  // The arena group `g` meets in (claimed the first time: groups whose
  // ranks all share this host); null where it has none.
  arena_seat* arena_of(const group_state& g);
  bool arena_serves(const group_state& g) { return arena_of(g) != nullptr; }
  void queue_for_arena(arena_seat& seat, op_state& op);
  void leave_arena(arena_seat& seat, op_state& op);
  void ring_local_peers();
  bool arena_peer_gone(op_state& op, int peer);
  // A step ends once the frames each member wrote to this rank before it
  // arrived there are read (and handled), as over one ordered link.
  void note_arena_rings(const op_state& op);
  bool arena_rings_read(arena_seat& seat, const op_state& op);
  bool report_refused_send_in_arena(op_state& op);
  bool refused_send_pending(const op_state& op) const;
  void arena_mismatch(op_state& op, int peer, const call_signature& theirs);
  // Single copy between ranks of this host (shm/single_copy.hpp), for the
  // arena's large all_reduce: whether this rank may read `peer`'s memory
  // (options' shm_single_copy and the kernel; asked once per link), and a
  // read of it: 0, or errno (a refusal marks the link; a peer whose
  // process is gone fails the op with errc::peer_lost naming it).
  bool may_read(int peer);
  int read_peer(op_state& op, int peer, void* to, std::uint64_t from, std::size_t n);

  // Shutdown (cpu/transport/impl/shutdown.hpp). abort(): fails every pending and future
  // operation and closes every link. close(): the communicator was
  // destroyed; fails what is pending and closes every link in order, then
  // runs `closed`.
  void abort();
  void close(std::function<void()> closed = {});
  void leave_start_up(const std::exception_ptr& failure);
  static constexpr auto close_grace = std::chrono::seconds(2);

  // Where this rank is in call `seq` of `group` (a probe's answer).
  call_progress progress_of(std::uint64_t group, std::uint64_t seq) const;
  void tell_whereabouts(std::uint64_t group, wire_header& reply) const;
  std::string whereabouts(int peer, const op_state& op, const group_whereabouts& w) const;

  // Errors that name the op, its group and sequence number
  // (cpu/transport/impl/failure_forwarding.hpp).
  std::exception_ptr make_error(errc code, const op_state& op, std::string peers,
                                std::string detail, std::string address = {}) const;

 private:
  // Which kind of link reaches rank p: a shared memory link to a rank of
  // this host's segment (start-up says which ranks share it:
  // cpu/startup/connect.hpp), a socket to every other. A new kind of link
  // is chosen here.
  std::unique_ptr<link> make_link(int p, detail::ip_tcp::socket s) {
    if (shm_ && p != rank_) {
      const auto local = std::find(shm_local_.begin(), shm_local_.end(), p);
      if (local != shm_local_.end()) {
        auto l = std::make_unique<shm_link>(
            std::move(s), ex_, *shm_, static_cast<std::size_t>(shm_me_),
            static_cast<std::size_t>(local - shm_local_.begin()), rank_, options_.shm_single_copy);
        shm_of_[static_cast<std::size_t>(p)] = l.get();
        shm_peers_.push_back(p);
        return l;
      }
    }
    return std::make_unique<socket_link>(std::move(s), ex_, options_.max_batch,
                                         options_.eager_limit);
  }

  // What the links tell (link_events, a private base).
  std::shared_ptr<link_events> keep_alive() override { return {shared_from_this(), this}; }
  void written(int peer, std::size_t frames, std::size_t bytes,
               const asio::error_code& ec) override;
  void write_queued(int peer) override { start_write(peer); }
  void reader_idle() override;
  void heard_goodbye(int peer, const wire_header& bye) override;
  void lose(int peer, std::string why) override { lose_link(peer, std::move(why)); }

  // Sending (cpu/transport/impl/sending.hpp).
  wire_header header_for(const io_item& it) const;
  void queue_parts(io_item& it);
  void start_write(int peer);
  void cancel_item(io_item& it, bool let_io_finish);
  void withdraw_offer(peer_link& l, io_item& it);

  // Receiving (cpu/transport/impl/receiving.hpp).
  bool check_match(io_item& it, const wire_header& h);
  void start_data(peer_link& l, io_item& it, const wire_header& rts);
  io_item* take_posted(peer_link& l, const match_key& key);
  bool keep_unexpected(int peer, const wire_header& h);
  static bool from_stage(peer_link& l, void* dst, std::size_t n);
  DCOMM_EMIT_ON_USE detail::task<void> fill(peer_link& l, std::size_t n, bool exact = false);
  DCOMM_EMIT_ON_USE detail::task<void> read_payload(peer_link& l, char* dst, std::size_t n);
  DCOMM_EMIT_ON_USE static detail::task<void> reader(std::shared_ptr<transport> self, int peer);
  DCOMM_EMIT_ON_USE detail::task<void> read_frames(peer_link& l, int peer);
  wire_header take_header(peer_link& l, int peer) const;
  // Where an eager or data frame's payload goes: into a receive's buffer at
  // its `arrived` (item, dst), into an unexpected message (msg, dst), or
  // nowhere (all null: read and dropped).
  struct payload_target {
    char* dst = nullptr;
    io_item* item = nullptr;
    unexpected_msg* msg = nullptr;
  };
  payload_target eager_target(peer_link& l, int peer, const wire_header& h);
  payload_target data_target(peer_link& l, const wire_header& h);
  void file_unexpected(peer_link& l, unexpected_msg* msg);
  void data_arrived(peer_link& l, io_item& it);
  void on_control_frame(peer_link& l, int peer, const wire_header& h);
  void on_rts(peer_link& l, int peer, const wire_header& h);
  void on_cts(peer_link& l, int peer, const wire_header& h);
  DCOMM_EMIT_ON_USE detail::task<bool> read_into(peer_link& l, io_item& it, std::size_t bytes);
  // How much a payload read may take at once before it checks whether its
  // receive was cancelled.
  static constexpr std::size_t read_piece = std::size_t{1} << 20;

  // Failure forwarding (cpu/transport/impl/failure_forwarding.hpp).
  std::exception_ptr lost_error(op_state& op, int peer);
  std::exception_ptr timeout_error(op_state& op);
  static std::string rank_list(const std::vector<int>& ranks);
  void note_cause(fail_reason reason, int culprit);
  static wire_header call_frame(msg_kind kind, const op_state& op);
  bool probe_group(op_state& op);
  // How long a probed rank has to answer: far more than a round trip, even
  // across hosts; a rank that cannot answer in that time is stuck.
  static constexpr auto probe_grace = std::chrono::milliseconds(250);
  void on_probe_reply(int peer, const wire_header& h);
  op_state* active_call(std::uint64_t group, std::uint64_t seq);
  void record_failure(std::uint64_t group, std::uint64_t seq, failed_call f);
  void remember_mismatch(std::uint64_t group, std::uint64_t seq, int peer,
                         const call_signature& ours, const call_signature& theirs);
  void mismatched_call(op_state& op, int peer, const call_signature& theirs);
  void notify_group(op_state& op);
  void on_fail_frame(int peer, const wire_header& h, const call_signature* theirs,
                     std::string finding);
  failed_call reported_failure(int peer, const wire_header& h, const call_signature* theirs,
                               std::string finding) const;
  void fail_reported(op_state& op, const failed_call& f);
  void on_refused_send(int peer, const wire_header& h);
  bool report_refused_send(io_item& it);
  void fail_for_refused_send(op_state& op, int peer, const refused_send& r);
  static std::string refused_send_detail(const refused_send& r, int peer, const std::string& send);

  // Revocation (cpu/transport/impl/revocation.hpp).
  void on_revoke(int peer, const wire_header& h, std::string why);
  void apply_revocation(revocation r, int heard_from);
  void tell_revocation(const revocation& r, int heard_from);
  std::exception_ptr revoked_error(const op_state& op, const revocation& r) const;
  void revoke_after(const op_state& op);

  // Agreement (cpu/transport/impl/agreement.hpp).
  static constexpr std::size_t max_agreements = 64;
  agreement_slot& slot_for(std::uint64_t group, std::uint64_t number);
  void pump(agreement_slot& s);
  void pump_agreements();
  void on_agree_frame(int peer, const wire_header& h, const std::string& bytes);
  std::exception_ptr agreement_timeout(const op_state& op, const agreement_slot& s) const;

  // The host's shared memory (cpu/transport/impl/shm_links.hpp).
  void use_shm(const shm_links& shm);
  // Rank p's shared memory link (null: p is reached otherwise).
  shm_link* shm_of(int p) const { return shm_of_[static_cast<std::size_t>(p)]; }
  void post_whereabouts(const op_state* left);
  std::string board_whereabouts(int peer, const op_state& op) const;
  bool poll_shm(const op_state* spinner = nullptr);
  bool read_eager_inline(peer_link& l, shm_link& s, int peer, const op_state* spinner);
  DCOMM_EMIT_ON_USE static detail::task<void> listen_bell(std::shared_ptr<transport> self);
  template <class Pred>
  bool spin_shm(const op_state& spinner, Pred pred);
  void settle_bell();
  void close_bell_if_unused();
  void wake_arena_holder();

  // Shutdown (cpu/transport/impl/shutdown.hpp).
  void drain(const std::shared_ptr<asio::steady_timer>& timer, detail::clock::time_point cut);
  void closed_all();
  void say_goodbye();
  void close_link(peer_link& l);
  void lose_link(int peer, std::string why);

  void fail_item(io_item& it, std::exception_ptr e) {
    it.state = item_state::failed;
    fail_op(*it.op, std::move(e));
  }

  void complete(io_item& it) {
    it.state = item_state::done;
    it.op->wake();
  }

  asio::any_io_executor ex_;
  int rank_;
  int world_;
  transport_options options_;
  std::vector<std::unique_ptr<peer_link>> links_;
  op_state* ops_ = nullptr;  // operations in progress, a list through op_state
  object_pool<io_item> items_;
  object_pool<unexpected_msg> unexpected_;
  vector_pool<std::byte> scratch_memory_;
  vector_pool<io_item*> item_slots_;
  // Collectives that failed before this rank started them (or were
  // refused here): the error their op gets in add_op, and whom it names.
  failed_call_record failed_calls_;
  group_registry groups_;  // the groups this rank knows, and the revoked ones
  std::map<std::pair<std::uint64_t, std::uint64_t>, agreement_slot> agreements_;
  std::uint64_t agreement_order_ = 0;
  // Per group, how many of its collectives this rank has entered (probes).
  std::unordered_map<std::uint64_t, std::uint64_t> entered_;
  host_layouts hosts_;
  // The first failure this rank saw and whom it blamed: said in goodbyes.
  fail_reason first_reason_ = fail_reason::none;
  int first_culprit_ = -1;
  std::weak_ptr<asio::steady_timer> close_timer_;  // close(): drains the links
  std::function<void()> on_closed_;                // close(): every link is closed
  std::uint64_t next_id_ = 0;
  // Shared memory: the segment, this rank's place in it, the peers reached
  // through it, and this rank's doorbell (a dup of its eventfd).
  std::shared_ptr<shm::segment> shm_;
  int shm_me_ = -1;
  std::vector<int> shm_local_;  // the ranks of the segment, this one among them
  std::vector<int> shm_peers_;
  std::vector<shm_link*> shm_of_;                   // per rank: its link's, where it is one
  asio::posix::stream_descriptor* bell_ = nullptr;  // listen_bell's, while it runs
  bool bell_settling_ = false;                      // settle_bell is posted
  // The arenas this rank has a seat at (reserved once: calls hold
  // pointers to them).
  std::vector<arena_seat> arenas_;
  bool aborted_ = false;
  bool closed_ = false;
};

}  // namespace dcomm::cpu

#include "dcomm/cpu/transport/impl/spin.hpp"
// The members' bodies: header-only everywhere, in the separate-compilation
// mode in the library alone (DCOMM_DECL, detail/asio.hpp).
#if !defined(DCOMM_SEPARATE_COMPILATION) || defined(DCOMM_SOURCE)
#include "dcomm/cpu/transport/impl/agreement.hpp"
#include "dcomm/cpu/transport/impl/failure_forwarding.hpp"
#include "dcomm/cpu/transport/impl/receiving.hpp"
#include "dcomm/cpu/transport/impl/revocation.hpp"
#include "dcomm/cpu/transport/impl/sending.hpp"
#include "dcomm/cpu/transport/impl/shm_links.hpp"
#include "dcomm/cpu/transport/impl/shutdown.hpp"
#endif

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::agree<void>(std::uint64_t group, std::string_view group_name, std::uint64_t number, std::vector<int> members, int me, bool flag, const char* operation, detail::clock::time_point deadline) -> detail::task<agreed_value>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::abandon<void>(op_state& op, std::exception_ptr why) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::fill<void>(peer_link& l, std::size_t n, bool exact) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::read_payload<void>(peer_link& l, char* dst, std::size_t n) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::reader<void>(std::shared_ptr<transport> self, int peer) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::read_frames<void>(peer_link& l, int peer) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::read_into<void>(peer_link& l, io_item& it, std::size_t bytes) -> detail::task<bool>)
DCOMM_INSTANTIATE(auto dcomm::cpu::transport::listen_bell<void>(std::shared_ptr<transport> self) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
