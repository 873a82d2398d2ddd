// The transport's record of collective calls that failed: how each failed
// (as a peer's fail frame reported it, or as this rank found a mismatch),
// and the rule that keeps the record bounded for the life of a backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/error.hpp"

namespace dcomm::cpu {

// How a collective failed, as a peer reported it (or as this rank found
// a mismatch): what its op here fails with, and what is passed on.
struct failed_call {
  errc code = errc::aborted;
  std::string peers{};
  std::string detail{};
  int origin = -1;        // the rank that found it
  int lost = -1;          // peer_lost: the rank lost
  int culprit = -1;       // timeout: the rank stuck; mismatch: the other side
  std::string finding{};  // the origin's words on the cause (op_state::finding)
  // A mismatch: the calls of the two ranks that disagree (the one that
  // found it, and the other), sent on with the fail frames (from here:
  // a map's values do not move).
  call_signature ours{};
  call_signature theirs{};
};

// A collective call: its group and sequence number.
struct call_id {
  std::uint64_t group, seq;
  friend bool operator==(const call_id&, const call_id&) = default;
};
struct call_id_hash {
  std::size_t operator()(const call_id& c) const noexcept {
    return static_cast<std::size_t>(c.group * 0x9e3779b97f4a7c15ull ^ c.seq);
  }
};

// Collectives that failed, by call. A record is read for three things:
//  1. a call this rank has not entered yet fails at once when it does
//     (transport::add_op), with the error a peer reported;
//  2. while the call's op fails here, its fail frames name both calls of
//     a mismatch (transport::notify_group);
//  3. a late frame of the call (from a peer still in it) is dropped rather
//     than kept as an unexpected message (transport::keep_unexpected).
// The rule that keeps it bounded: a record stays while this rank has not
// entered its call (1), and while its op here is in progress (2); once
// entered, it stays for `keep_calls` more collective calls entered here (on
// any group), long enough for the peers still in the failed call to leave
// it (they are told by fail frames, or reach their deadline) and their late
// frames to arrive (3). A frame later still is kept as unexpected, as the
// frames of a call that failed without a record (a timeout here) are. And at
// most `max_records` in all: beyond that, the oldest go first (a peer
// reporting failures of calls this rank never makes).
class failed_call_record {
 public:
  static constexpr std::uint64_t keep_calls = 64;
  static constexpr std::size_t max_records = 1024;

  const failed_call* find(const call_id& c) const {
    auto it = records_.find(c);
    return it == records_.end() ? nullptr : &it->second.call;
  }
  bool contains(const call_id& c) const { return records_.contains(c); }
  std::size_t size() const { return records_.size(); }

  // Records how call `c` failed, unless it is recorded already (the first
  // report stands). `entered`: this rank has entered the call. `active(c)`
  // tells whether call c's op is in progress here (those are kept).
  template <class Active>
  void add(const call_id& c, failed_call f, bool entered, Active active) {
    records_.try_emplace(c, entry{std::move(f), entered_, ++added_, entered});
    if (records_.size() > max_records) drop_oldest(active);
  }

  // This rank enters call `c` (every collective, failed or not): its record
  // (if any) counts from now; every `keep_calls` calls, the old records go.
  template <class Active>
  void enter(const call_id& c, Active active) {
    ++entered_;
    if (records_.empty()) return;
    if (auto it = records_.find(c); it != records_.end()) {
      it->second.entered = true;
      it->second.stamp = entered_;
    }
    if (entered_ % keep_calls == 0) prune(active);
  }

 private:
  struct entry {
    failed_call call;
    // entered: when this rank entered the call (its count of calls
    // entered); else when the record was made.
    std::uint64_t stamp = 0;
    std::uint64_t order = 0;  // the how-manyth record: ties of stamp, oldest first
    bool entered = false;
  };

  template <class Active>
  void prune(Active active) {
    std::erase_if(records_, [&](const auto& r) {
      return r.second.entered && entered_ - r.second.stamp >= keep_calls && !active(r.first);
    });
  }

  template <class Active>
  void drop_oldest(Active active) {
    while (records_.size() > max_records) {
      auto oldest = records_.end();
      for (auto it = records_.begin(); it != records_.end(); ++it)
        if (!active(it->first) &&
            (oldest == records_.end() || std::pair(it->second.stamp, it->second.order) <
                                             std::pair(oldest->second.stamp, oldest->second.order)))
          oldest = it;
      if (oldest == records_.end()) return;  // all in progress here: none may go
      records_.erase(oldest);
    }
  }

  std::unordered_map<call_id, entry, call_id_hash> records_;
  std::uint64_t entered_ = 0;  // collective calls this rank has entered
  std::uint64_t added_ = 0;    // records made
};

}  // namespace dcomm::cpu
