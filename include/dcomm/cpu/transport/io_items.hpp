// The transport's units of work: an io_item is one message of a call, to or
// from one peer; an op_state is one call in progress, owning its items (a
// list threaded through them, recycled by the transport). Messages are
// matched by their match_key: (collective?, group, tag or sequence number,
// step). What travels on a link is in cpu/transport/link.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/detail/arrivals.hpp"
#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/clock.hpp"

namespace dcomm::cpu {

struct match_key {
  std::uint8_t collective = 0;
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  std::uint32_t step = 0;
  friend bool operator==(const match_key&, const match_key&) = default;
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
  bool offered = false;       // large send: its rts offered the buffer for a single copy
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
  // `ex`: the transport's executor, which outlives every op.
  op_state(const asio::any_io_executor& ex, detail::clock::time_point deadline_)
      : deadline(deadline_), executor_(&ex) {}
  op_state(const op_state&) = delete;
  op_state& operator=(const op_state&) = delete;

  // Expires at the deadline; cancelled to wake the op. Made when the op
  // first waits: most small calls over shared memory never do, and making
  // an Asio I/O object locks its io_context's service registry.
  asio::steady_timer& timer() {
    if (!timer_) timer_.emplace(*executor_, deadline);
    return *timer_;
  }

  detail::clock::time_point deadline;
  detail::clock::time_point entered{};  // when the caller made the call
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
  // What the rank that found the failure said of its cause (a timeout's
  // probe or shared memory reading, a lost link's reason), here or as a
  // peer's fail frame reported it: passed on in this op's fail frames, so
  // that every member's error gives the whole cause. Empty: none to pass.
  std::string finding;
  bool notified = false;
  // Runs on a revoked group (an agreement: impl/agreement.hpp).
  bool survives_revocation = false;
  // Failed because a receive of a peer refused an earlier send from here
  // (cpu/transport/impl/failure_forwarding.hpp): a collective tells its group it gave up,
  // not that the group's calls differ.
  bool refused_send = false;
  // Set once the deadline passed and the group was probed (allocated then
  // only): each member's answer, by group rank.
  // Each member's answer, and where it was in the group (a probe_reply).
  struct probe_answers {
    std::vector<call_progress> answers;  // {} : no answer yet
    std::vector<group_whereabouts> where;
    int awaited = 0;
  };
  std::unique_ptr<probe_answers> probe;
  // Waits in its group's arena (polled while it waits); the next call
  // queued for the arena (cpu/algorithms/shm_arena.hpp).
  bool on_arena = false;
  op_state* next_on_arena = nullptr;
  // Sleeps after a poll that woke readers: the next reader that waits
  // again wakes it (transport::wait, shm_readable).
  bool polls_after_readers = false;
  // Has spun already (transport::holds_within_spin): wait() sleeps at once.
  bool spun = false;
  // What the call says of itself once it ends (op_report): the links its
  // messages took (transports bits), the algorithm that ran, and when its
  // ranks called it, as far as its messages told (collectives).
  std::uint8_t carried = 0;
  dcomm::algorithm ran = dcomm::algorithm::automatic;
  detail::arrivals arrivals;
  // The transport's list of operations in progress.
  op_state* prev_op = nullptr;
  op_state* next_op = nullptr;

  // A wake with no wait pending is lost, as Asio's cancel is: the waits
  // look at their condition again before they sleep.
  void wake() {
    if (timer_) timer_->cancel();
  }

 private:
  const asio::any_io_executor* executor_;
  std::optional<asio::steady_timer> timer_;
};

}  // namespace dcomm::cpu
