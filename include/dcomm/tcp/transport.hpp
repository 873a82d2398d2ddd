// The TCP backend's transport: one socket per peer (from connect_mesh), on
// which every operation of every group travels as framed messages.
//
// Over the size rule (about 1,500 lines): it holds several jobs (posting and
// matching, the reader and writer, failure forwarding, probes and goodbyes),
// one file only until the tcp/ folder of the layout work (issue 15) gives
// each its header; the wire format already has its own (wire_format.hpp).
//
// Frames (a fixed wire_header, then `bytes` of payload for eager and data):
//   eager  small message, payload follows; matched on arrival
//   rts    "ready to send" a large message: header only, matched on arrival
//   cts    the receiver's answer once a matching receive is posted
//   data   the large payload, sent after cts, read straight into the buffer;
//          a send whose data becomes ready in parts (a CUDA tensor copied
//          to the host slice by slice) sends one data frame per part, each
//          with its offset (cookie2), in order
//   fail   "your call did not match mine", or "this collective failed
//          here": the peer fails its call too (and passes a collective's
//          failure on to the rest of the group)
//   probe  sent by a rank whose collective reached its deadline: "where are
//          you in this call?"; answered at once by probe_reply (entered it,
//          done with it, or not yet there). A peer that does not answer is
//          stopped or hung: the timeout names it, not the ranks in between.
//   bye    the last frame before an orderly close, naming the failure that
//          made this rank leave (if any), so that its peers blame the first
//          cause and not the rank that left because of it
// Messages are matched per link by (collective?, group, tag or sequence
// number, step), first in first out, so two messages with the same key
// arrive in the order they were sent. Large messages wait for a posted
// receive, so an unexpected message never holds more than the eager limit.
//
// Everything here runs on one strand: no locks. An operation ("call") owns
// its io_items; it completes only once no socket operation still references
// a buffer it was given, so callers may free their buffers right after.
#pragma once

#include <sys/ioctl.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/task.hpp"
#include "dcomm/tcp/pool.hpp"
#include "dcomm/tcp/wire_format.hpp"
#include "dcomm/tcp/mesh.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/reduce_op.hpp"

namespace dcomm::tcp {

struct match_key {
  std::uint8_t collective = 0;
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  std::uint32_t step = 0;
  friend bool operator==(const match_key&, const match_key&) = default;
};

struct match_key_hash {
  std::size_t operator()(const match_key& k) const noexcept {
    std::uint64_t h = k.group * 0x9e3779b97f4a7c15ull;
    h ^= k.seq + 0x632be59bd9b4e019ull + (h << 6) + (h >> 2);
    h ^= (std::uint64_t{k.step} << 1 | k.collective) + 0x94d049bb133111ebull + (h << 6) + (h >> 2);
    return static_cast<std::size_t>(h);
  }
};

inline match_key key_of(const wire_header& h) {
  return {h.collective, h.group, h.seq, h.step};
}

struct op_state;

enum class item_state : std::uint8_t {
  created,
  posted,         // receive waiting for its message
  awaiting_data,  // receive that sent cts
  queued,         // send whose frame waits to be written
  awaiting_cts,   // large send that sent rts
  done,
  failed,
};

// One message of a call, to or from one peer (a global rank).
struct io_item {
  op_state* op = nullptr;
  int peer = -1;
  bool is_send = false;
  match_key key{};
  call_signature sig{};
  void* recv_buffer = nullptr;
  const void* send_buffer = nullptr;
  std::size_t bytes = 0;
  item_state state = item_state::created;
  bool in_flight = false;  // a socket operation is reading into / writing from the buffer
  std::uint64_t id = 0;
  // A send whose data becomes ready in parts (transport::send_ready): it
  // always goes by rts, and its data frames follow the parts.
  bool staged = false;
  std::size_t ready = 0;      // staged send: bytes of send_buffer ready to go
  std::size_t queued = 0;     // staged send: bytes handed to data frames
  std::size_t written = 0;    // staged send: bytes written
  std::uint64_t peer_id = 0;  // staged send: the receiver's id, from its cts
  // A receive: payload bytes arrived so far (in order); with `progress`,
  // the op is woken each time that many more have arrived (a CUDA tensor's
  // receive copies each slice to the device as it lands).
  std::size_t arrived = 0;
  std::size_t progress = 0;
  io_item* next_in_op = nullptr;

  bool finished() const { return state == item_state::done || state == item_state::failed; }
};

// The items of one call, in the order it made them: a list threaded through
// the items, which the transport recycles.
class item_list {
 public:
  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = io_item;
    using difference_type = std::ptrdiff_t;
    using pointer = io_item*;
    using reference = io_item&;
    iterator() = default;
    explicit iterator(io_item* p) : p_(p) {}
    io_item& operator*() const { return *p_; }
    io_item* operator->() const { return p_; }
    iterator& operator++() {
      p_ = p_->next_in_op;
      return *this;
    }
    iterator operator++(int) {
      iterator old = *this;
      ++*this;
      return old;
    }
    friend bool operator==(const iterator&, const iterator&) = default;

   private:
    io_item* p_ = nullptr;
  };

  iterator begin() const { return iterator(head_); }
  iterator end() const { return iterator(); }
  bool empty() const { return head_ == nullptr; }
  void push_back(io_item* it) {
    (tail_ ? tail_->next_in_op : head_) = it;
    tail_ = it;
  }
  // Unlinks every item; the caller gives them back.
  io_item* release() {
    io_item* h = head_;
    head_ = tail_ = nullptr;
    return h;
  }

 private:
  io_item* head_ = nullptr;
  io_item* tail_ = nullptr;
};

// One operation in progress: its items, its deadline, how it failed.
struct op_state {
  op_state(asio::any_io_executor ex, detail::clock::time_point deadline_)
      : timer(ex, deadline_), deadline(deadline_) {}
  op_state(const op_state&) = delete;
  op_state& operator=(const op_state&) = delete;

  asio::steady_timer timer;  // expires at the deadline; cancelled to wake the op
  detail::clock::time_point deadline;
  std::exception_ptr failure;
  item_list items;
  // For messages, and for the fail frames a failed collective sends.
  const char* operation = "";
  bool collective = false;
  std::uint64_t group = 0;
  std::string_view group_name;  // the group_state's, which outlives the call
  std::uint64_t seq = 0;
  call_signature sig{};
  // A collective's group, in global ranks: whom to tell of its failure.
  // Borrowed from the group_state, which outlives the call.
  std::span<const int> members;
  int lost_rank = -1;  // failed because this rank's link closed
  // The rank whose failure a peer's fail frame reported (-1: this rank's
  // own). Passed on with the failure, so that the others name it too.
  int origin = -1;
  // A timed-out collective: the rank it blames (did not answer the probe,
  // or had not entered the call), passed on in its fail frames.
  int culprit = -1;
  bool notified = false;
  // Set once the deadline passed and the group was probed (allocated then
  // only): each member's answer, by group rank.
  struct probe_answers {
    std::vector<call_progress> answers;  // {} : no answer yet
    int awaited = 0;
  };
  std::unique_ptr<probe_answers> probe;
  // The transport's list of operations in progress.
  op_state* prev_op = nullptr;
  op_state* next_op = nullptr;

  void wake() { timer.cancel(); }
};

// How a collective failed, as a peer reported it (or as this rank found
// a mismatch): what its op here fails with, and what is passed on.
struct failed_call {
  errc code = errc::aborted;
  std::string peers{};
  std::string detail{};
  int origin = -1;   // the rank that found it
  int lost = -1;     // peer_lost: the rank lost
  int culprit = -1;  // timeout: the rank stuck; mismatch: the other side
  // A mismatch: the calls of the two ranks that disagree (the one that
  // found it, and the other), sent on with the fail frames (from here:
  // a map's values do not move).
  call_signature ours{};
  call_signature theirs{};
};

struct transport_options {
  std::size_t eager_limit = 64 * 1024;
  std::size_t stage_bytes = 256 * 1024;
  std::size_t max_batch = 16;  // frames per gathered write
};

class transport : public std::enable_shared_from_this<transport> {
 public:
  transport(asio::any_io_executor ex, int rank, int world, mesh_sockets sockets,
            transport_options options)
      : ex_(std::move(ex)), rank_(rank), world_(world), options_(options) {
    links_.reserve(sockets.size());
    for (auto& s : sockets) {
      auto l = std::make_unique<link>(std::move(s));
      l->stage.resize(options_.stage_bytes);
      l->batch_headers.resize(options_.max_batch);
      l->gather.reserve(2 * options_.max_batch);
      // Room for what a call commonly has in flight per peer, so that the
      // lists rarely grow once a job runs (growth is kept, not repeated).
      l->posted.reserve(64);
      l->unexpected.reserve(64);
      l->awaiting_data.reserve(64);
      l->awaiting_cts.reserve(64);
      asio::error_code ec;
      if (l->socket.is_open()) {
        auto ep = l->socket.remote_endpoint(ec);
        if (!ec) l->address = detail::endpoint_address(ep);
      }
      links_.push_back(std::move(l));
    }
  }

  // Starts one reader per peer; call once, on the strand.
  void start() {
    for (int p = 0; p < world_; ++p)
      if (p != rank_) detail::start(ex_, reader(shared_from_this(), p), [](std::exception_ptr) {});
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  const transport_options& options() const { return options_; }
  const asio::any_io_executor& get_executor() const { return ex_; }
  bool peer_lost(int p) const { return links_[static_cast<std::size_t>(p)]->lost; }
  // Whether rank p left in order, having failed nothing (its goodbye said so).
  bool left_in_order(int p) const {
    const link& l = *links_[static_cast<std::size_t>(p)];
    return l.said_bye && l.bye_reason == fail_reason::none;
  }
  // Whom the loss of rank p's link blames: the culprit its goodbye named,
  // or p itself (it left without one: died).
  int blame_for_loss(int p) const {
    const link& l = *links_[static_cast<std::size_t>(p)];
    return l.said_bye && l.bye_reason != fail_reason::none && l.bye_culprit >= 0 ? l.bye_culprit
                                                                                 : p;
  }
  const std::string& lost_reason(int p) const { return links_[static_cast<std::size_t>(p)]->why; }
  std::string peer_address(int p) const { return links_[static_cast<std::size_t>(p)]->address; }
  bool stopped() const { return aborted_ || closed_; }

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
    // A lost member does not fail the call here: that peer may have sent
    // its part before leaving (the messages wait in `unexpected`), or may
    // have no part to play with this rank. Posting to it fails (post_recv,
    // post_send), and the ranks that fail tell the rest with fail frames.
    if (op.collective) {
      auto& entered = entered_[op.group];
      entered = std::max(entered, op.seq + 1);
      auto it = failed_calls_.find(call_id{op.group, op.seq});
      if (it != failed_calls_.end()) return fail_reported(op, it->second);
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
  void post_recv(io_item& it) {
    it.id = ++next_id_;
    link& l = *links_[static_cast<std::size_t>(it.peer)];
    // Before the lost check: a peer that sent its last message and left
    // is no error for the receive that message was for.
    auto u = std::find_if(l.unexpected.begin(), l.unexpected.end(),
                          [&](auto& m) { return key_of(m->header) == it.key; });
    if (u != l.unexpected.end()) {
      unexpected_msg* msg = *u;
      l.unexpected.erase(u);
      const wire_header h = msg->header;
      const bool fits = check_match(it, h);
      if (fits && h.kind == msg_kind::eager && it.bytes)
        std::memcpy(it.recv_buffer, msg->payload.get(), it.bytes);
      unexpected_.give_back(msg);
      if (!fits) return;
      if (h.kind == msg_kind::rts) {
        if (l.lost) return fail_item(it, lost_error(*it.op, it.peer));
        return start_data(l, it, h);
      }
      return complete(it);
    }
    if (l.lost) return fail_item(it, lost_error(*it.op, it.peer));
    it.state = item_state::posted;
    l.posted.push_back(&it);
  }

  void post_send(io_item& it) {
    it.id = ++next_id_;
    link& l = *links_[static_cast<std::size_t>(it.peer)];
    if (l.lost) return fail_item(it, lost_error(*it.op, it.peer));
    wire_header h = header_for(it);
    if (it.bytes <= options_.eager_limit && !it.staged) {
      h.kind = msg_kind::eager;
      it.state = item_state::queued;
      l.frames.push_back({h, it.send_buffer, it.bytes, &it});
    } else {
      h.kind = msg_kind::rts;
      h.cookie = it.id;
      it.state = item_state::awaiting_cts;
      l.awaiting_cts.push_back(&it);
      l.frames.push_back({h, nullptr, 0, nullptr});
    }
    start_write(it.peer);
  }

  // A staged send's first `ready` bytes may go (posted with it.staged; the
  // parts are sent in order, once the receiver has answered).
  void send_ready(io_item& it, std::size_t ready) {
    it.ready = std::min(ready, it.bytes);
    if (it.state == item_state::queued) queue_parts(it);
  }

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
      if (op.probe && op.probe->awaited == 0) {
        fail_op(op, timeout_error(op));
        break;
      }
      auto [ec] = co_await op.timer.async_wait(detail::use_task);
      if (ec || op.failure || pred()) continue;
      if (!op.probe && probe_group(op)) continue;
      fail_op(op, timeout_error(op));
    }
    co_await abandon(op);
  }

  // Fails the op (if it has not failed), takes back its items and waits
  // until no socket operation references them; then throws the failure.
  detail::task<void> abandon(op_state& op, std::exception_ptr why = nullptr) {
    if (!op.failure)
      op.failure = why ? why : std::make_exception_ptr(std::runtime_error("abandoned"));
    if (op.collective && !op.notified) notify_group(op);
    for (auto& it : op.items) cancel_item(it, true);
    // A message in progress finishes on its own (the link stays usable);
    // one that does not within io_grace (a stopped peer, a full socket)
    // is stopped by closing its link.
    auto in_flight = [&op] {
      return std::any_of(op.items.begin(), op.items.end(), [](auto& i) { return i.in_flight; });
    };
    op.timer.expires_after(io_grace);
    while (in_flight()) {
      auto [ec] = co_await op.timer.async_wait(detail::use_task);
      if (!ec) break;
    }
    for (auto& it : op.items)
      if (it.in_flight && !links_[static_cast<std::size_t>(it.peer)]->lost)
        lose_link(it.peer, "closed after rank " + std::to_string(rank_) +
                               "'s call failed: a message in progress did not end in time");
    // Closing a link completes its socket operations promptly; the bound
    // only guards against a bug turning into a hang.
    op.timer.expires_after(std::chrono::seconds(10));
    while (in_flight()) {
      auto [ec] = co_await op.timer.async_wait(detail::use_task);
      if (!ec) {
        log(detail::log_level::error, "tcp transport: socket operations still pending 10 s after closing");
        break;
      }
    }
    std::rethrow_exception(op.failure);
  }

  static constexpr auto io_grace = std::chrono::seconds(1);

  // Fails every pending and future operation; closes every link (after a
  // goodbye, if it can go out at once).
  void abort() {
    if (aborted_) return;
    const bool was_closed = closed_;
    aborted_ = true;
    if (!was_closed) say_goodbye();
    for (auto& l : links_) close_link(*l);
    // fail_op only marks and wakes: the list does not change under us.
    for (op_state* op = ops_; op; op = op->next_op)
      fail_op(*op, make_error(errc::aborted, *op, {}, "the communicator was aborted"));
  }

  // The communicator was destroyed: fail what is still pending, and close
  // every link in order. What is queued (the fail frames of a call that just
  // failed among it) goes out first, then a goodbye naming the first failure
  // this rank saw; then the link is shut for sending and closed once the
  // peer has acknowledged every byte. (Closing with bytes unsent, or with
  // the peer's bytes unread, would reset the connection and lose them.) A
  // link still busy after `close_grace` is cut. `closed` runs once every
  // link is closed.
  void close(std::function<void()> closed = {}) {
    if (closed_ || aborted_) {
      if (closed) closed();
      return;
    }
    closed_ = true;
    on_closed_ = std::move(closed);
    for (op_state* op = ops_; op; op = op->next_op)
      fail_op(*op, make_error(errc::closed, *op, {}, "the communicator was destroyed"));
    say_goodbye();
    // Owned by its handler, not by the transport: a timer must not outlive
    // its io_context, and the transport may.
    auto timer = std::make_shared<asio::steady_timer>(ex_);
    close_timer_ = timer;
    drain(timer, detail::clock::now() + close_grace);
  }

  // One step of close(): every millisecond until each link is closed.
  void drain(const std::shared_ptr<asio::steady_timer>& timer, detail::clock::time_point cut) {
    const bool late = detail::clock::now() >= cut;
    bool open = false;
    for (auto& l : links_) {
      if (!l->socket.is_open()) continue;
      if (l->batch == 0 && l->frames.empty()) {
        asio::error_code ignored;
        if (!l->shut) l->socket.shutdown(detail::ip_tcp::socket::shutdown_send, ignored);
        l->shut = true;
        if (unacknowledged(l->socket) == 0 || late) {
          close_link(*l);
          continue;
        }
      } else if (late) {
        close_link(*l);
        continue;
      }
      open = true;
    }
    if (!open) return closed_all();  // also when none was open (a world of one)
    timer->expires_after(std::chrono::milliseconds(1));
    timer->async_wait([self = shared_from_this(), timer, cut](const asio::error_code& ec) {
      if (!ec) self->drain(timer, cut);
    });
  }

  // Bytes written to the link that its peer has not acknowledged yet.
  static std::size_t unacknowledged(detail::ip_tcp::socket& socket) {
#ifdef TIOCOUTQ
    int n = 0;
    if (::ioctl(socket.native_handle(), TIOCOUTQ, &n) == 0 && n > 0)
      return static_cast<std::size_t>(n);
#else
    (void)socket;
#endif
    return 0;
  }

  // After close(): the last link is closed.
  void closed_all() {
    if (auto timer = close_timer_.lock()) timer->cancel();
    if (auto closed = std::exchange(on_closed_, {})) closed();
  }

  static constexpr auto close_grace = std::chrono::seconds(2);

  // Where this rank is in call `seq` of `group` (a probe's answer).
  call_progress progress_of(std::uint64_t group, std::uint64_t seq) const {
    for (const op_state* op = ops_; op; op = op->next_op)
      if (op->collective && op->group == group && op->seq == seq) return call_progress::in_call;
    auto it = entered_.find(group);
    return it != entered_.end() && seq < it->second ? call_progress::finished
                                                    : call_progress::not_entered;
  }

  // Errors that name the op, its group and sequence number.
  std::exception_ptr make_error(errc code, const op_state& op, std::string peers,
                                std::string detail, std::string address = {}) const {
    std::string where;
    if (op.collective)
      where = "call #" + std::to_string(op.seq) + " on " + std::string(op.group_name) + ": ";
    else if (!op.group_name.empty())
      where = "tag " + std::to_string(static_cast<std::int64_t>(op.seq)) + " on " +
              std::string(op.group_name) + ": ";
    return std::make_exception_ptr(error(code, {.operation = op.operation,
                                                .rank = rank_,
                                                .peers = std::move(peers),
                                                .address = std::move(address),
                                                .detail = where + detail}));
  }

 private:
  struct frame {
    wire_header header{};
    const void* payload = nullptr;
    std::size_t bytes = 0;
    io_item* item = nullptr;  // the send whose payload this is (eager, data)
    bool cancelled = false;   // taken back before it was written: skipped
  };
  // An eager message or rts that arrived before its receive was posted.
  // Recycled with its payload buffer (at most eager_limit bytes).
  struct unexpected_msg {
    wire_header header{};
    std::unique_ptr<std::byte[]> payload;
    std::size_t capacity = 0;

    std::byte* reserve(std::size_t n) {
      if (capacity < n) {
        // Powers of two from 1 KiB: few regrowths as sizes vary.
        capacity = std::max<std::size_t>(std::bit_ceil(n), 1024);
        payload = std::make_unique_for_overwrite<std::byte[]>(capacity);
      }
      return payload.get();
    }
  };
  struct link {
    explicit link(detail::ip_tcp::socket s) : socket(std::move(s)) {}
    detail::ip_tcp::socket socket;
    std::string address;
    bool lost = false;
    std::string why;
    // The peer's goodbye: it left in order, after `bye_reason` caused by
    // rank `bye_culprit` (-1: none; it simply finished).
    bool shut = false;  // close(): shut for sending, waiting for the acknowledgements
    bool said_bye = false;
    fail_reason bye_reason = fail_reason::none;
    int bye_culprit = -1;
    // Receiving. Lists in arrival or posting order, searched from the
    // front: a message matches the oldest receive with its key, and the
    // match is nearly always at the front (MPI's queues work the same way).
    std::vector<io_item*> posted;
    std::vector<unexpected_msg*> unexpected;  // from the transport's pool
    std::vector<io_item*> awaiting_data;      // receives that sent cts
    std::vector<char> stage;
    std::size_t begin = 0, end = 0;
    io_item* reading = nullptr;  // the receive whose buffer a read targets
    // Sending.
    fifo<frame> frames;
    std::size_t batch = 0;               // frames at the front being written
    std::vector<io_item*> awaiting_cts;  // sends that sent rts
    // The batch's headers, copied: frames may move while it is written.
    std::vector<wire_header> batch_headers;
    std::vector<asio::const_buffer> gather;
  };
  struct call_id {
    std::uint64_t group, seq;
    friend bool operator==(const call_id&, const call_id&) = default;
  };
  struct call_id_hash {
    std::size_t operator()(const call_id& c) const noexcept {
      return static_cast<std::size_t>(c.group * 0x9e3779b97f4a7c15ull ^ c.seq);
    }
  };

  wire_header header_for(const io_item& it) const {
    wire_header h;
    h.collective = it.key.collective;
    h.sig = it.sig;
    h.group = it.key.group;
    h.seq = it.key.seq;
    h.step = it.key.step;
    h.bytes = it.bytes;
    return h;
  }

  // The connection to `peer` is gone. If the peer said goodbye naming the
  // failure that made it leave, the first cause is blamed, not the peer.
  std::exception_ptr lost_error(op_state& op, int peer) {
    const link& l = *links_[static_cast<std::size_t>(peer)];
    int culprit = peer;
    std::string detail = l.why.empty() ? std::string("the connection is closed") : l.why;
    if (l.said_bye && l.bye_culprit >= 0 && l.bye_culprit != peer && l.bye_culprit < world_) {
      culprit = l.bye_culprit;
      detail = "rank " + std::to_string(peer) + " left after " + describe(l.bye_reason) +
               (l.bye_culprit == rank_ ? std::string(" it blamed on this rank")
                                       : " caused by rank " + std::to_string(culprit)) +
               " (the first cause)";
    }
    if (op.lost_rank < 0) op.lost_rank = culprit;
    note_cause(fail_reason::peer_lost, culprit);
    return make_error(errc::peer_lost, op, "rank " + std::to_string(culprit), detail,
                      links_[static_cast<std::size_t>(culprit)]->address);
  }

  // At the deadline. After a probe (collectives), the ranks that did not
  // answer or had not entered the call are to blame; else the peers whose
  // messages this rank was still waiting for.
  std::exception_ptr timeout_error(op_state& op) {
    if (op.probe) {
      std::vector<int> silent, absent, waiting_too, finished;
      for (std::size_t i = 0; i < op.members.size(); ++i) {
        const int p = op.members[i];
        if (p == rank_ || peer_lost(p)) continue;
        switch (op.probe->answers[i]) {
          case call_progress::not_entered:
            absent.push_back(p);
            break;
          case call_progress::in_call:
            waiting_too.push_back(p);
            break;
          case call_progress::finished:
            finished.push_back(p);
            break;
          default:
            silent.push_back(p);
        }
      }
      if (!silent.empty() || !absent.empty()) {
        std::vector<int> blamed = silent;
        blamed.insert(blamed.end(), absent.begin(), absent.end());
        op.culprit = blamed.front();
        std::sort(blamed.begin(), blamed.end());
        std::string detail = "the deadline passed";
        const char* separator = ": ";
        auto clause = [&](const std::vector<int>& ranks, const char* what) {
          if (ranks.empty()) return;
          detail += separator + rank_list(ranks) + what;
          separator = "; ";
        };
        clause(silent, " did not answer a probe (stopped, hung, or blocking its thread?)");
        clause(absent, " had not entered this call (still in an earlier one?)");
        clause(waiting_too, " waited in it too");
        clause(finished, " had finished it");
        note_cause(fail_reason::timeout, op.culprit);
        return make_error(errc::timeout, op,
                          blamed.size() == 1 ? "rank " + std::to_string(blamed.front())
                                             : "ranks " + detail::format_ranks(blamed),
                          detail);
      }
    }
    std::vector<int> waiting;
    for (const auto& it : op.items)
      if (!it.finished()) waiting.push_back(it.peer);
    std::sort(waiting.begin(), waiting.end());
    waiting.erase(std::unique(waiting.begin(), waiting.end()), waiting.end());
    if (waiting.size() == 1) op.culprit = waiting.front();
    note_cause(fail_reason::timeout, op.culprit);
    return make_error(errc::timeout, op, waiting.empty() ? "" : "ranks " + detail::format_ranks(waiting),
                      waiting.empty() ? "the deadline passed"
                                      : "the deadline passed without hearing from these peers");
  }

  static std::string rank_list(const std::vector<int>& ranks) {
    return ranks.size() == 1 ? "rank " + std::to_string(ranks.front())
                             : "ranks " + detail::format_ranks(ranks);
  }

  void note_cause(fail_reason reason, int culprit) {
    if (first_reason_ != fail_reason::none || reason == fail_reason::none) return;
    first_reason_ = reason;
    first_culprit_ = culprit;
  }

  // A frame about a collective call as a whole (not one of its messages).
  static wire_header call_frame(msg_kind kind, const op_state& op) {
    wire_header h;
    h.kind = kind;
    h.collective = 1;
    h.sig = op.sig;
    h.group = op.group;
    h.seq = op.seq;
    return h;
  }

  // Asks every live member of a collective that reached its deadline where
  // it is in the call; the answers (or their absence) name the culprit.
  // False if there is nobody to ask.
  bool probe_group(op_state& op) {
    if (!op.collective || stopped()) return false;
    op.probe = std::make_unique<op_state::probe_answers>();
    op.probe->answers.assign(op.members.size(), call_progress{});
    const wire_header h = call_frame(msg_kind::probe, op);
    for (int p : op.members) {
      if (p == rank_ || peer_lost(p)) continue;
      links_[static_cast<std::size_t>(p)]->frames.push_back({h, nullptr, 0, nullptr});
      start_write(p);
      ++op.probe->awaited;
    }
    if (op.probe->awaited == 0) return false;
    op.timer.expires_after(probe_grace);
    return true;
  }

  // How long a probed rank has to answer: far more than a round trip, even
  // across hosts; a rank that cannot answer in that time is stuck.
  static constexpr auto probe_grace = std::chrono::milliseconds(250);

  void on_probe_reply(int peer, const wire_header& h) {
    for (op_state* op = ops_; op; op = op->next_op) {
      if (!op->collective || op->group != h.group || op->seq != h.seq || !op->probe) continue;
      for (std::size_t i = 0; i < op->members.size(); ++i)
        if (op->members[i] == peer && op->probe->answers[i] == call_progress{}) {
          op->probe->answers[i] = static_cast<call_progress>(h.cookie);
          if (--op->probe->awaited == 0) op->wake();
        }
    }
  }

  // The last frame on every live link before an orderly close.
  void say_goodbye() {
    const wire_header b = goodbye(first_reason_, first_culprit_);
    for (int p = 0; p < world_; ++p) {
      link& l = *links_[static_cast<std::size_t>(p)];
      if (p == rank_ || l.lost || !l.socket.is_open()) continue;
      l.frames.push_back({b, nullptr, 0, nullptr});
      start_write(p);
    }
  }

  // The collective in progress here with this group and sequence number.
  op_state* active_call(std::uint64_t group, std::uint64_t seq) {
    for (op_state* op = ops_; op; op = op->next_op)
      if (op->collective && op->group == group && op->seq == seq) return op;
    return nullptr;
  }

  // For notify_group: both calls of a mismatch found here.
  void remember_mismatch(std::uint64_t group, std::uint64_t seq, int peer,
                         const call_signature& ours, const call_signature& theirs) {
    failed_call f;
    f.code = errc::mismatch;
    f.origin = rank_;
    f.culprit = peer;
    f.ours = ours;
    f.theirs = theirs;
    failed_calls_.try_emplace(call_id{group, seq}, std::move(f));
  }

  // Rank `peer` made a different collective call than `op`.
  void mismatched_call(op_state& op, int peer, const call_signature& theirs) {
    if (op.failure) return;
    note_cause(fail_reason::mismatch, peer);
    op.culprit = peer;
    auto e =
        make_error(errc::mismatch, op, "rank " + std::to_string(peer),
                   "ranks called different collectives: rank " + std::to_string(peer) + " called " +
                       describe(theirs) + ", this rank called " + describe(op.sig));
    remember_mismatch(op.group, op.seq, peer, op.sig, theirs);
    fail_op(op, std::move(e));
  }

  void fail_item(io_item& it, std::exception_ptr e) {
    it.state = item_state::failed;
    fail_op(*it.op, std::move(e));
  }

  void complete(io_item& it) {
    it.state = item_state::done;
    it.op->wake();
  }

  // A message from it.peer arrived for a posted receive: does it fit?
  bool check_match(io_item& it, const wire_header& h) {
    bool same_call = !h.collective || h.sig == it.sig;
    if (same_call && h.bytes == it.bytes) return true;
    std::string detail;
    if (!same_call)
      detail = "ranks called different collectives: rank " + std::to_string(it.peer) + " called " +
               describe(h.sig) + ", this rank called " + describe(it.sig);
    else
      detail = "message size mismatch: rank " + std::to_string(it.peer) + " sent " +
               std::to_string(h.bytes) + " bytes, this rank expects " + std::to_string(it.bytes) +
               " bytes (a receive never truncates)";
    auto e = make_error(errc::mismatch, *it.op, "rank " + std::to_string(it.peer), detail);
    note_cause(fail_reason::mismatch, it.peer);
    it.op->culprit = it.peer;
    fail_item(it, e);
    if (h.collective) {
      // abandon() tells the group, naming both calls
      remember_mismatch(h.group, h.seq, it.peer, it.sig, h.sig);
    } else {
      // Tell the sender, so its send fails now rather than at its deadline.
      wire_header f = h;
      f.kind = msg_kind::fail;
      f.sig = it.sig;
      f.bytes = it.bytes;
      f.cookie = static_cast<std::uint64_t>(fail_reason::mismatch);
      links_[static_cast<std::size_t>(it.peer)]->frames.push_back({f, nullptr, 0, nullptr});
      start_write(it.peer);
    }
    return false;
  }

  // A collective failed here: every other member learns it at once, so
  // ranks that do not talk to the culprit directly fail now too. A rank
  // told by a peer passes it on as well: its fail frames reach the others
  // before its links close, so that none of them takes the close for the
  // cause.
  void notify_group(op_state& op) {
    op.notified = true;
    fail_reason reason = fail_reason::other;
    try {
      std::rethrow_exception(op.failure);
    } catch (const error& e) {
      // Refused input is refused on every rank that passed it; nothing to tell.
      if (e.code() == errc::invalid_argument) return;
      if (e.code() == errc::mismatch) reason = fail_reason::mismatch;
      if (e.code() == errc::peer_lost) reason = fail_reason::peer_lost;
      if (e.code() == errc::timeout) reason = fail_reason::timeout;
    } catch (...) {
    }
    wire_header f = call_frame(msg_kind::fail, op);
    f.cookie = static_cast<std::uint64_t>(reason);
    f.cookie2 = static_cast<std::uint64_t>(
        (reason == fail_reason::peer_lost ? op.lost_rank : op.culprit) + 1);
    f.step = static_cast<std::uint32_t>((op.origin >= 0 ? op.origin : rank_) + 1);
    // A mismatch: the other call goes along (found here or reported), so
    // that every rank can name both calls.
    const void* payload = nullptr;
    if (reason == fail_reason::mismatch) {
      auto found = failed_calls_.find(call_id{op.group, op.seq});
      if (found != failed_calls_.end() && found->second.theirs.op != coll_op::p2p) {
        f.sig = found->second.ours;
        payload = &found->second.theirs;
        f.bytes = sizeof(call_signature);
      }
    }
    for (int p : op.members) {
      if (p == rank_ || peer_lost(p)) continue;
      links_[static_cast<std::size_t>(p)]->frames.push_back({f, payload, f.bytes, nullptr});
      start_write(p);
    }
  }

  // `theirs`: a collective mismatch's other call (the culprit's), if sent.
  void on_fail_frame(int peer, const wire_header& h, const call_signature* theirs) {
    const auto reason = static_cast<fail_reason>(h.cookie);
    // A collective's: cookie2 names the rank to blame (the lost one, the
    // one a timeout found stuck, the other side of a mismatch), step the
    // rank whose failure it reports (each plus one).
    const int blamed = h.cookie2 && h.cookie2 <= static_cast<std::uint64_t>(world_)
                           ? static_cast<int>(h.cookie2) - 1
                           : -1;
    failed_call f;
    f.origin = h.collective && h.step && h.step <= static_cast<std::uint32_t>(world_)
                   ? static_cast<int>(h.step) - 1
                   : peer;
    f.lost = reason == fail_reason::peer_lost ? blamed : -1;
    f.culprit = reason == fail_reason::peer_lost ? -1 : blamed;
    f.ours = h.sig;
    if (theirs) f.theirs = *theirs;
    const std::string reported =
        f.origin == peer ? "" : " (as rank " + std::to_string(peer) + " reports)";
    const std::string origin = "rank " + std::to_string(f.origin);
    f.peers = origin;
    switch (reason) {
      case fail_reason::mismatch:
        f.code = errc::mismatch;
        if (!h.collective)
          f.detail = "rank " + std::to_string(peer) + " expected " + std::to_string(h.bytes) +
                     " bytes for this message (a receive never truncates)";
        else if (theirs && blamed >= 0)
          f.detail = "ranks called different collectives: rank " + std::to_string(blamed) +
                     " called " + describe(*theirs) + ", " + origin + " called " + describe(h.sig) +
                     reported;
        else
          f.detail = "ranks called different collectives: " + origin + " called " +
                     describe(h.sig) + " and found a call that does not match" + reported;
        break;
      case fail_reason::peer_lost:
        f.code = errc::peer_lost;
        f.peers = "rank " + std::to_string(f.lost);
        f.detail = origin + " lost its connection to rank " + std::to_string(f.lost) +
                   " during this call" + reported;
        break;
      case fail_reason::timeout:
        f.code = errc::timeout;
        if (blamed >= 0) f.peers = "rank " + std::to_string(blamed);
        f.detail = origin + " reached its deadline in this call" +
                   (blamed >= 0 && blamed != f.origin
                        ? ", stuck on rank " + std::to_string(blamed) +
                              " (it did not answer, or had not entered the call)"
                        : std::string(" and gave up")) +
                   reported;
        break;
      default:
        f.code = errc::aborted;
        f.detail = origin + " gave up on this call" + reported;
        break;
    }
    for (op_state* op = ops_; op; op = op->next_op) {
      bool hit = h.collective ? op->collective && op->group == h.group && op->seq == h.seq
                              : !op->collective && op->group == h.group && op->seq == h.seq &&
                                    std::any_of(op->items.begin(), op->items.end(),
                                                [&](auto& i) { return i.peer == peer; });
      if (hit && !op->failure) fail_reported(*op, f);
    }
    note_cause(reason, f.lost >= 0 ? f.lost : f.culprit >= 0 ? f.culprit : f.origin);
    // For the call's op on this rank, if it has not started yet.
    if (h.collective) failed_calls_.try_emplace(call_id{h.group, h.seq}, std::move(f));
  }

  // Fails `op` with a failure a peer reported.
  void fail_reported(op_state& op, const failed_call& f) {
    op.origin = f.origin;
    if (f.lost >= 0) op.lost_rank = f.lost;
    op.culprit = f.culprit;
    std::string peers = f.peers, detail = f.detail;
    if (f.code == errc::mismatch && op.collective) {
      // Between two other ranks: blame the side whose call is not ours.
      if (f.theirs.op != coll_op::p2p && f.culprit >= 0 && op.sig == f.ours)
        peers = "rank " + std::to_string(f.culprit);
      detail += "; this rank called " + describe(op.sig);
    }
    fail_op(op, make_error(f.code, op, std::move(peers), std::move(detail)));
  }

  // The data frames of a staged send's ready bytes not handed out yet.
  void queue_parts(io_item& it) {
    if (it.queued >= it.ready || it.finished()) return;
    if (links_[static_cast<std::size_t>(it.peer)]->lost)
      return fail_item(it, lost_error(*it.op, it.peer));
    wire_header d = header_for(it);
    d.kind = msg_kind::data;
    d.cookie = it.peer_id;
    d.cookie2 = it.queued;
    d.bytes = it.ready - it.queued;
    links_[static_cast<std::size_t>(it.peer)]->frames.push_back(
        {d, static_cast<const char*>(it.send_buffer) + it.queued, d.bytes, &it});
    it.queued = it.ready;
    start_write(it.peer);
  }

  // A large receive found its rts: ask for the data.
  void start_data(link& l, io_item& it, const wire_header& rts) {
    it.state = item_state::awaiting_data;
    l.awaiting_data.push_back(&it);
    wire_header c = rts;
    c.kind = msg_kind::cts;
    c.cookie = rts.cookie;
    c.cookie2 = it.id;
    l.frames.push_back({c, nullptr, 0, nullptr});
    start_write(it.peer);
  }

  // Takes back an item of a failed op. I/O in progress on its buffer can
  // only be stopped by closing the link (the stream would be out of step).
  void cancel_item(io_item& it, bool let_io_finish) {
    if (it.finished() && !it.in_flight) return;
    link& l = *links_[static_cast<std::size_t>(it.peer)];
    switch (it.state) {
      case item_state::posted:
        std::erase(l.posted, &it);
        break;
      case item_state::awaiting_data:
        std::erase(l.awaiting_data, &it);
        break;
      case item_state::awaiting_cts:
        std::erase(l.awaiting_cts, &it);
        break;
      case item_state::queued:
        // Marked, not erased: cheaper, and the frames of the write in
        // progress are counted by position. A staged send may have several.
        for (std::size_t i = l.batch; i < l.frames.size(); ++i)
          if (l.frames[i].item == &it) {
            l.frames[i].cancelled = true;
            l.frames[i].item = nullptr;
            if (!it.staged) break;
          }
        break;
      default:
        break;
    }
    // I/O in progress on the item's buffer: a send being written finishes
    // on its own, a receive being read drops the rest of its payload
    // (read_into); abandon waits for either (`let_io_finish`). Otherwise
    // only closing the link stops it (the stream would be out of step).
    if (it.in_flight && !let_io_finish) {
      if (!l.lost)
        lose_link(it.peer, "closed after rank " + std::to_string(rank_) +
                               "'s call failed in the middle of a message");
    }
    if (!it.finished()) it.state = item_state::failed;
  }

  void close_link(link& l) {
    asio::error_code ignored;
    if (!l.socket.is_open()) return;
    l.socket.shutdown(detail::ip_tcp::socket::shutdown_both, ignored);
    l.socket.close(ignored);
    if (closed_ &&
        std::none_of(links_.begin(), links_.end(), [](auto& k) { return k->socket.is_open(); }))
      closed_all();
  }

  // The connection to `peer` is gone: everything that needs it fails.
  void lose_link(int peer, std::string why) {
    link& l = *links_[static_cast<std::size_t>(peer)];
    if (l.lost) return;
    l.lost = true;
    l.why = std::move(why);
    // Gone without a goodbye: killed or crashed. That is a failure of the
    // job even if no call needed the peer yet; the goodbye names it.
    if (!l.said_bye && !stopped()) note_cause(fail_reason::peer_lost, peer);
    close_link(l);
    bool failed_any = false;
    auto fail_pending = [&](io_item* it) {
      if (it->finished()) return;
      failed_any = true;
      fail_item(*it, lost_error(*it->op, peer));
    };
    for (auto* it : l.posted) fail_pending(it);
    l.posted.clear();
    for (auto* it : l.awaiting_data) fail_pending(it);
    l.awaiting_data.clear();
    for (auto* it : l.awaiting_cts) fail_pending(it);
    l.awaiting_cts.clear();
    for (std::size_t i = 0; i < l.frames.size(); ++i)
      if (l.frames[i].item) fail_pending(l.frames[i].item);
    l.frames.truncate(l.batch);
    // Staged sends between parts are in no list of the link.
    for (op_state* op = ops_; op; op = op->next_op)
      for (auto& it : op->items)
        if (it.peer == peer && it.staged && it.state == item_state::queued && !it.in_flight)
          fail_pending(&it);
    // l.unexpected stays: those messages arrived before the link closed.
    // Calls that still needed this peer have failed above; the others
    // learn it when they post to it, and calls not yet started when they
    // start (add_op). A peer that finished and left is no error by itself.
    if (!stopped() && failed_any)
      log(detail::log_level::warning,
          "rank " + std::to_string(rank_) + " lost rank " + std::to_string(peer) + ": " + l.why);
  }

  // Writing: frames go out in order, several per gathered write.
  void start_write(int peer) {
    link& l = *links_[static_cast<std::size_t>(peer)];
    if (l.batch > 0 || l.frames.empty() || l.lost) return;
    l.gather.clear();
    std::size_t total = 0;
    while (!l.frames.empty() && l.frames.front().cancelled) l.frames.pop_front();
    if (l.frames.empty()) return;
    while (l.batch < l.frames.size() && l.batch < options_.max_batch) {
      frame& f = l.frames[l.batch];
      if (f.cancelled) {
        ++l.batch;  // written as nothing, popped with the batch
        continue;
      }
      wire_header& h = l.batch_headers[l.batch] = f.header;
      l.gather.push_back(asio::buffer(&h, sizeof h));
      if (f.bytes > 0) l.gather.push_back(asio::buffer(f.payload, f.bytes));
      if (f.item) f.item->in_flight = true;
      total += sizeof f.header + f.bytes;
      ++l.batch;
      if (f.bytes > options_.eager_limit) break;  // a large payload goes on its own
    }
    // A span, not the vector: the write operation keeps a copy of the
    // sequence, and a copied vector would allocate on every write.
    // Its operation memory from the pool: no allocation per write.
    detail::with_pooled_handler(
        ex_,
        [self = shared_from_this(), peer](const asio::error_code& ec, std::size_t) {
          self->on_written(peer, ec);
        },
        [&](auto handler) {
          asio::async_write(
              l.socket, std::span<const asio::const_buffer>(l.gather),
              [total](const asio::error_code& ec, std::size_t done) -> std::size_t {
                return ec ? 0 : total - done;
              },
              std::move(handler));
        });
  }

  void on_written(int peer, const asio::error_code& ec) {
    link& l = *links_[static_cast<std::size_t>(peer)];
    for (std::size_t i = 0; i < l.batch; ++i) {
      io_item* it = l.frames[i].item;
      if (!it) continue;
      it->in_flight = false;
      it->written += l.frames[i].bytes;
      if (ec)
        fail_item(*it, lost_error(*it->op, peer));
      else if (!it->finished() && (!it->staged || it->written == it->bytes))
        complete(*it);
      it->op->wake();  // also when its op is draining
    }
    l.frames.pop_front(l.batch);
    l.batch = 0;
    if (ec) {
      if (!l.lost) lose_link(peer, "writing to it failed: " + ec.message());
      return;
    }
    start_write(peer);
  }

  // Reading: one coroutine per peer parses frames out of a staging buffer;
  // payloads for posted receives go straight into the receiver's buffer.
  // `exact`: read no further than n bytes, so that a large payload behind
  // them is left in the socket for read_payload to read straight into its
  // buffer instead of through the stage (a copy of half of each chunk).
  static detail::task<void> fill(link& l, std::size_t n, bool exact = false) {
    if (l.end - l.begin >= n) co_return;
    if (l.begin > 0) {
      std::memmove(l.stage.data(), l.stage.data() + l.begin, l.end - l.begin);
      l.end -= l.begin;
      l.begin = 0;
    }
    while (l.end < n) {
      auto [ec, got] = co_await l.socket.async_read_some(
          asio::buffer(l.stage.data() + l.end, (exact ? n : l.stage.size()) - l.end), detail::use_task);
      if (ec) throw asio::system_error(ec);
      l.end += got;
    }
  }

  // Reads n payload bytes into dst (nullptr: discard them).
  static detail::task<void> read_payload(link& l, char* dst, std::size_t n) {
    for (;;) {
      std::size_t take = std::min(n, l.end - l.begin);
      if (dst && take) std::memcpy(dst, l.stage.data() + l.begin, take);
      l.begin += take;
      n -= take;
      if (dst) dst += take;
      if (n == 0) co_return;
      if (dst && n >= l.stage.size() / 4) {
        auto [ec, got] = co_await asio::async_read(
            l.socket, asio::buffer(dst, n),
            [n](const asio::error_code& ec, std::size_t done) -> std::size_t {
              return ec ? 0 : n - done;
            },
            detail::use_task);
        if (ec) throw asio::system_error(ec);
        co_return;
      }
      co_await fill(l, std::min(n, l.stage.size()));
    }
  }

  static detail::task<void> reader(std::shared_ptr<transport> self, int peer) {
    link& l = *self->links_[static_cast<std::size_t>(peer)];
    std::string why;
    try {
      co_await self->read_frames(l, peer);
    } catch (const dcomm::error& e) {
      why = e.what();
    } catch (const std::system_error& e) {
      if (e.code() != asio::error::eof)
        why = "reading from it failed: " + e.code().message();
      else if (!l.said_bye)
        why =
            "it closed the connection without a goodbye (killed, crashed, or exited without "
            "closing dcomm)";
      else if (l.bye_reason == fail_reason::none)
        why = "it closed the connection (finished: destroyed its communicator or exited)";
      else
        why = std::string("it left after ") + describe(l.bye_reason) + " in a call";
    } catch (const std::exception& e) {
      why = std::string("reading from it failed: ") + e.what();
    }
    if (l.reading) {
      io_item* it = l.reading;
      l.reading = nullptr;
      it->in_flight = false;
      it->op->wake();
    }
    if (!l.lost) self->lose_link(peer, why);
  }

  // One frame after another, in one coroutine frame: a nested coroutine
  // per message would allocate (Asio recycles few frames per thread), so
  // the helpers are awaited only when the stage cannot serve the bytes.
  detail::task<void> read_frames(link& l, int peer) {
    for (;;) {
      // While a large payload is due (we sent cts), read headers on their own:
      // one more small read per frame, one copy less per payload byte.
      if (l.end - l.begin < sizeof(wire_header))
        co_await fill(l, sizeof(wire_header), !l.awaiting_data.empty());
      wire_header h;
      std::memcpy(&h, l.stage.data() + l.begin, sizeof h);
      l.begin += sizeof h;
      if (h.magic != wire_magic || h.kind < msg_kind::eager || h.kind > msg_kind::bye)
        throw_error(errc::protocol_error,
                    {.operation = "tcp transport",
                     .rank = rank_,
                     .peers = "rank " + std::to_string(peer),
                     .detail = "a frame that is not dcomm's (different dcomm versions?)"});
      const match_key key = key_of(h);
      switch (h.kind) {
        case msg_kind::eager: {
          io_item* it = take_posted(l, key);
          if (it && !check_match(*it, h)) {
            if (!from_stage(l, nullptr, h.bytes))
              co_await read_payload(l, nullptr, h.bytes);  // refused
            break;
          }
          if (it) {
            if (!from_stage(l, static_cast<char*>(it->recv_buffer), h.bytes) &&
                !co_await read_into(l, *it, h.bytes))
              break;  // cancelled meanwhile
            complete(*it);
            break;
          }
          if (h.collective && !keep_unexpected(peer, h)) {
            if (!from_stage(l, nullptr, h.bytes)) co_await read_payload(l, nullptr, h.bytes);
            break;
          }
          unexpected_msg* msg = unexpected_.take();
          msg->header = h;
          char* payload = reinterpret_cast<char*>(msg->reserve(h.bytes));
          if (!from_stage(l, payload, h.bytes)) co_await read_payload(l, payload, h.bytes);
          // A receive may have been posted while the payload was read.
          if (io_item* late = take_posted(l, key)) {
            if (check_match(*late, h)) {
              if (late->bytes) std::memcpy(late->recv_buffer, payload, late->bytes);
              complete(*late);
            }
            unexpected_.give_back(msg);
            break;
          }
          l.unexpected.push_back(msg);
          break;
        }
        case msg_kind::rts: {
          io_item* it = take_posted(l, key);
          if (it) {
            if (check_match(*it, h)) start_data(l, *it, h);
          } else if (!h.collective || keep_unexpected(peer, h)) {
            unexpected_msg* msg = unexpected_.take();
            msg->header = h;
            l.unexpected.push_back(msg);
          }
          break;
        }
        case msg_kind::cts: {
          auto found = std::find_if(l.awaiting_cts.begin(), l.awaiting_cts.end(),
                                    [&](io_item* i) { return i->id == h.cookie; });
          if (found == l.awaiting_cts.end()) break;  // that send was cancelled
          io_item* it = *found;
          l.awaiting_cts.erase(found);
          if (it->staged) {
            it->peer_id = h.cookie2;
            it->state = item_state::queued;
            queue_parts(*it);
            break;
          }
          wire_header d = header_for(*it);
          d.kind = msg_kind::data;
          d.cookie = h.cookie2;
          it->state = item_state::queued;
          l.frames.push_back({d, it->send_buffer, it->bytes, it});
          start_write(peer);
          break;
        }
        case msg_kind::data: {
          // The whole payload, or a staged send's next part (at offset cookie2).
          auto found = std::find_if(l.awaiting_data.begin(), l.awaiting_data.end(),
                                    [&](io_item* i) { return i->id == h.cookie; });
          if (found == l.awaiting_data.end() || h.cookie2 != (*found)->arrived ||
              h.bytes > (*found)->bytes - (*found)->arrived) {
            if (!from_stage(l, nullptr, h.bytes))
              co_await read_payload(l, nullptr, h.bytes);  // its receive was cancelled
            break;
          }
          io_item* it = *found;
          char* dst = static_cast<char*>(it->recv_buffer) + it->arrived;
          if (from_stage(l, dst, h.bytes))
            it->arrived += h.bytes;
          else if (!co_await read_into(l, *it, h.bytes))
            break;  // cancelled meanwhile
          if (it->arrived == it->bytes) {
            std::erase(l.awaiting_data, it);
            complete(*it);
          } else if (it->progress) {
            it->op->wake();
          }
          break;
        }
        case msg_kind::fail: {
          // A collective's may carry the other call of a mismatch.
          call_signature theirs{};
          const bool carries = h.collective && h.bytes == sizeof theirs;
          const std::size_t payload = h.collective ? h.bytes : 0;
          if (!from_stage(l, carries ? &theirs : nullptr, payload))
            co_await read_payload(l, carries ? reinterpret_cast<char*>(&theirs) : nullptr, payload);
          on_fail_frame(peer, h, carries ? &theirs : nullptr);
          break;
        }
        case msg_kind::probe: {
          wire_header reply = h;
          reply.kind = msg_kind::probe_reply;
          reply.cookie = static_cast<std::uint64_t>(progress_of(h.group, h.seq));
          l.frames.push_back({reply, nullptr, 0, nullptr});
          start_write(peer);
          break;
        }
        case msg_kind::probe_reply:
          on_probe_reply(peer, h);
          break;
        case msg_kind::bye:
          l.said_bye = true;
          std::tie(l.bye_reason, l.bye_culprit) = read_goodbye(h, world_);
          break;
      }
    }
  }

  // A collective message no receive was posted for: kept for its receive,
  // unless its call failed here already (then nobody will want it), or
  // this rank is in that call and made a different one (a mismatch,
  // whatever the message's step: algorithms of different calls need not
  // use the same steps).
  bool keep_unexpected(int peer, const wire_header& h) {
    if (failed_calls_.contains(call_id{h.group, h.seq})) return false;
    op_state* op = active_call(h.group, h.seq);
    if (!op) return true;
    if (op->failure) return false;
    if (!(h.sig == op->sig)) {
      mismatched_call(*op, peer, h.sig);
      return false;
    }
    return true;
  }

  // Takes n payload bytes from the stage if it holds them all (dst ==
  // nullptr: discards them).
  static bool from_stage(link& l, void* dst, std::size_t n) {
    if (l.end - l.begin < n) return false;
    if (dst && n) std::memcpy(dst, l.stage.data() + l.begin, n);
    l.begin += n;
    return true;
  }

  // Reads `bytes` of payload to the receive's buffer at it.arrived, in
  // pieces (with it.progress, of that size, waking the op after each). A
  // receive cancelled meanwhile (its call failed) has the rest read and
  // dropped, so the link stays in step; false then: `it` is no longer ours.
  detail::task<bool> read_into(link& l, io_item& it, std::size_t bytes) {
    it.in_flight = true;
    l.reading = &it;
    while (bytes) {
      if (it.state == item_state::failed) {
        l.reading = nullptr;
        it.in_flight = false;
        it.op->wake();
        co_await read_payload(l, nullptr, bytes);
        co_return false;
      }
      const std::size_t step = std::min(bytes, it.progress ? it.progress : read_piece);
      co_await read_payload(l, static_cast<char*>(it.recv_buffer) + it.arrived, step);
      it.arrived += step;
      bytes -= step;
      if (bytes && it.progress) it.op->wake();
    }
    l.reading = nullptr;
    it.in_flight = false;
    co_return true;
  }
  // How much a payload read may take at once before it checks whether its
  // receive was cancelled.
  static constexpr std::size_t read_piece = std::size_t{1} << 20;

  io_item* take_posted(link& l, const match_key& key) {
    auto p =
        std::find_if(l.posted.begin(), l.posted.end(), [&](io_item* i) { return i->key == key; });
    if (p == l.posted.end()) return nullptr;
    io_item* it = *p;
    l.posted.erase(p);
    return it;
  }

  asio::any_io_executor ex_;
  int rank_;
  int world_;
  transport_options options_;
  std::vector<std::unique_ptr<link>> links_;
  op_state* ops_ = nullptr;  // operations in progress, a list through op_state
  object_pool<io_item> items_;
  object_pool<unexpected_msg> unexpected_;
  vector_pool<std::byte> scratch_memory_;
  vector_pool<io_item*> item_slots_;
  // Collectives that failed before this rank started them (or were
  // refused here): the error their op gets in add_op, and whom it names.
  std::unordered_map<call_id, failed_call, call_id_hash> failed_calls_;
  // Per group, how many of its collectives this rank has entered (probes).
  std::unordered_map<std::uint64_t, std::uint64_t> entered_;
  // The first failure this rank saw and whom it blamed: said in goodbyes.
  fail_reason first_reason_ = fail_reason::none;
  int first_culprit_ = -1;
  std::weak_ptr<asio::steady_timer> close_timer_;  // close(): drains the links
  std::function<void()> on_closed_;                // close(): every link is closed
  std::uint64_t next_id_ = 0;
  bool aborted_ = false;
  bool closed_ = false;
};

}  // namespace dcomm::tcp
