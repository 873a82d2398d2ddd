// Agreement among a group's live members (communicator::agree, ULFM's
// MPIX_Comm_agree): every member that returns returns the same decision,
// the AND of the flags counted and the members known failed, also when
// members die while it runs. What follows is the protocol, with no I/O:
// the transport feeds a record the messages that arrive and which members
// are lost, and sends what it says to (impl/agreement.hpp).
//
// A coordinator, the lowest member not known failed, decides in three
// steps: it gathers every live member's contribution (its flag, the
// members it holds failed, and any value it accepted or decided before),
// proposes a value and waits until every live member accepted it, then
// commits it. A member that finds its coordinator lost sends its
// contribution to the next one. The value proposed is a decided one if any
// contribution carries one, else the accepted value of the highest epoch
// (the coordinator's rank) if any, else a new one: so once any member
// returns a value (its commit came after every live member accepted it),
// every later coordinator proposes that value again. A link lost is a
// member failed: a process that dies closes its links, and a lost link is
// never made again. Rounds: four message delays without failures, four
// more per coordinator lost; the coordinator sends and receives 4(n - 1)
// small frames.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dcomm::cpu {

// A decision: the AND of the flags counted, and the members known failed
// when it was made (group ranks, ascending).
struct agreed_value {
  bool flag = true;
  std::vector<int> failed{};
  friend bool operator==(const agreed_value&, const agreed_value&) = default;
};

// An agree frame's step (its cookie).
enum class agree_step : std::uint64_t { contribution = 1, proposal, ack, commit };

struct agree_message {
  agree_step step = agree_step::contribution;
  // proposal, ack: the coordinator's group rank; contribution: the epoch
  // of `value` if it is an accepted one (-1: none).
  int epoch = -1;
  bool flag = true;            // contribution: the sender's flag
  bool decided = false;        // contribution: `value` is decided
  std::vector<int> failed{};   // contribution: the members the sender holds failed
  agreed_value value{};        // proposal, commit; contribution: accepted or decided
};

// The payload (the step and the epoch travel in the header): flag, decided,
// value.flag, a zero byte, two counts (uint32), then the two lists (int32).
inline std::string encode(const agree_message& m) {
  std::string out(12 + 4 * (m.failed.size() + m.value.failed.size()), '\0');
  out[0] = m.flag ? 1 : 0;
  out[1] = m.decided ? 1 : 0;
  out[2] = m.value.flag ? 1 : 0;
  const std::uint32_t counts[2] = {static_cast<std::uint32_t>(m.failed.size()),
                                   static_cast<std::uint32_t>(m.value.failed.size())};
  std::memcpy(out.data() + 4, counts, sizeof counts);
  std::size_t at = 12;
  for (const auto* list : {&m.failed, &m.value.failed})
    for (int r : *list) {
      const auto v = static_cast<std::int32_t>(r);
      std::memcpy(out.data() + at, &v, 4);
      at += 4;
    }
  return out;
}

// The largest payload a group of `size` sends.
inline std::size_t max_agree_payload(int size) {
  return 12 + 8 * static_cast<std::size_t>(size);
}

// Null if the bytes are not a message of a group of `size`.
inline std::optional<agree_message> decode(agree_step step, int epoch, const std::string& bytes,
                                           int size) {
  if (step < agree_step::contribution || step > agree_step::commit || bytes.size() < 12 ||
      epoch < -1 || epoch >= size)
    return std::nullopt;
  agree_message m;
  m.step = step;
  m.epoch = epoch;
  m.flag = bytes[0] != 0;
  m.decided = bytes[1] != 0;
  m.value.flag = bytes[2] != 0;
  std::uint32_t counts[2];
  std::memcpy(counts, bytes.data() + 4, sizeof counts);
  if (counts[0] > static_cast<std::uint32_t>(size) || counts[1] > static_cast<std::uint32_t>(size) ||
      bytes.size() != 12 + 4 * (std::size_t{counts[0]} + counts[1]))
    return std::nullopt;
  std::size_t at = 12;
  for (auto [list, n] : {std::pair{&m.failed, counts[0]}, std::pair{&m.value.failed, counts[1]}})
    for (std::uint32_t i = 0; i < n; ++i, at += 4) {
      std::int32_t v;
      std::memcpy(&v, bytes.data() + at, 4);
      if (v < 0 || v >= size) return std::nullopt;
      list->push_back(v);
    }
  return m;
}

// What to send: `m` to group rank `to`.
struct agree_outgoing {
  int to = -1;
  agree_message m{};
};

// One agreement on this rank, from its first message or its entry until
// the record is dropped (kept after it decided: a later coordinator may
// need this rank's decision).
class agreement_record {
 public:
  using failed_fn = std::function<bool(int)>;  // is group rank i known failed?

  bool entered() const { return me_ >= 0; }
  int size() const { return size_; }
  const std::optional<agreed_value>& decided() const { return decided_; }

  void enter(int me, int size, bool flag) {
    me_ = me;
    size_ = size;
    flag_ = flag;
    acked_.assign(static_cast<std::size_t>(size), false);
  }

  // A message from group rank `from`.
  void take(int from, agree_message m) {
    switch (m.step) {
      case agree_step::contribution:
        contributions_[from] = std::move(m);
        break;
      case agree_step::proposal:
        if (m.epoch == from) proposals_[from] = std::move(m.value);
        break;
      case agree_step::ack:
        if (proposing_ && m.epoch == me_ && from >= 0 && from < size_)
          acked_[static_cast<std::size_t>(from)] = true;
        break;
      case agree_step::commit:
        if (!decided_) decided_ = std::move(m.value);
        break;
    }
  }

  // What to send now, given who is known failed (entered records only).
  std::vector<agree_outgoing> step(const failed_fn& failed) {
    std::vector<agree_outgoing> out;
    if (!entered()) return out;
    const int c = coordinator(failed);
    if (decided_) {
      if (c == me_ && committed_as_ != me_) {
        commit_to_all(failed, out);
      } else if (c != me_ && told_ != c) {
        agree_message m{.step = agree_step::contribution, .decided = true, .value = *decided_};
        out.push_back({c, std::move(m)});
        told_ = c;
      }
      return out;
    }
    if (c != me_) return follow(c, failed, out);
    if (!proposing_) {
      for (int i = 0; i < size_; ++i)
        if (i != me_ && !failed(i) && !contributions_.count(i)) return out;  // not all in
      propose(failed, out);
      if (decided_) return out;
    }
    for (int i = 0; i < size_; ++i)
      if (i != me_ && !failed(i) && !acked_[static_cast<std::size_t>(i)]) return out;
    decided_ = proposal_;
    commit_to_all(failed, out);
    return out;
  }

  // The live members this rank waits for (group ranks), for a timeout's
  // error: the coordinator, or, as the coordinator, those whose
  // contribution or acknowledgement has not come.
  std::vector<int> waiting_for(const failed_fn& failed) const {
    std::vector<int> who;
    if (!entered() || decided_) return who;
    const int c = coordinator(failed);
    if (c != me_) return {c};
    for (int i = 0; i < size_; ++i)
      if (i != me_ && !failed(i) &&
          (proposing_ ? !acked_[static_cast<std::size_t>(i)] : !contributions_.count(i)))
        who.push_back(i);
    return who;
  }

 private:
  int coordinator(const failed_fn& failed) const {
    for (int i = 0; i < me_; ++i)
      if (!failed(i)) return i;
    return me_;
  }

  std::vector<agree_outgoing>& follow(int c, const failed_fn& failed,
                                      std::vector<agree_outgoing>& out) {
    if (told_ != c) {
      agree_message m{.step = agree_step::contribution, .epoch = accepted_epoch_, .flag = flag_};
      for (int i = 0; i < size_; ++i)
        if (failed(i)) m.failed.push_back(i);
      if (accepted_) m.value = *accepted_;
      out.push_back({c, std::move(m)});
      told_ = c;
    }
    // Accepted from this coordinator alone: one that a lower, lost rank
    // would have been is taken once this rank knows it lost too.
    if (auto p = proposals_.find(c); p != proposals_.end() && accepted_epoch_ < c) {
      accepted_ = p->second;
      accepted_epoch_ = c;
      out.push_back({c, {.step = agree_step::ack, .epoch = c}});
    }
    return out;
  }

  void propose(const failed_fn& failed, std::vector<agree_outgoing>& out) {
    for (const auto& [from, m] : contributions_)
      if (m.decided) {
        decided_ = m.value;
        commit_to_all(failed, out);
        return;
      }
    int best = accepted_ ? accepted_epoch_ : -1;
    const agreed_value* chosen = accepted_ ? &*accepted_ : nullptr;
    for (const auto& [from, m] : contributions_)
      if (m.epoch > best) best = m.epoch, chosen = &m.value;
    if (chosen) {
      proposal_ = *chosen;
    } else {
      proposal_ = {.flag = flag_};
      for (int i = 0; i < size_; ++i)
        if (failed(i)) proposal_.failed.push_back(i);
      for (const auto& [from, m] : contributions_) {
        proposal_.flag = proposal_.flag && m.flag;
        proposal_.failed.insert(proposal_.failed.end(), m.failed.begin(), m.failed.end());
      }
      std::sort(proposal_.failed.begin(), proposal_.failed.end());
      proposal_.failed.erase(std::unique(proposal_.failed.begin(), proposal_.failed.end()),
                             proposal_.failed.end());
    }
    proposing_ = true;
    accepted_ = proposal_;
    accepted_epoch_ = me_;
    acked_[static_cast<std::size_t>(me_)] = true;
    for (int i = 0; i < size_; ++i)
      if (i != me_ && !failed(i))
        out.push_back({i, {.step = agree_step::proposal, .epoch = me_, .value = proposal_}});
  }

  void commit_to_all(const failed_fn& failed, std::vector<agree_outgoing>& out) {
    committed_as_ = me_;
    for (int i = 0; i < size_; ++i)
      if (i != me_ && !failed(i))
        out.push_back({i, {.step = agree_step::commit, .epoch = me_, .value = *decided_}});
  }

  int me_ = -1;
  int size_ = 0;
  bool flag_ = true;
  // As a member: the coordinator told of this rank's contribution, the
  // value it accepted (and from whom), proposals from a coordinator it did
  // not follow yet, the decision.
  int told_ = -1;
  std::optional<agreed_value> accepted_;
  int accepted_epoch_ = -1;
  std::map<int, agreed_value> proposals_;
  std::optional<agreed_value> decided_;
  // As the coordinator.
  std::map<int, agree_message> contributions_;
  bool proposing_ = false;
  agreed_value proposal_;
  std::vector<bool> acked_;
  int committed_as_ = -1;
};

struct op_state;

// A record as the transport keeps it (impl/agreement.hpp).
struct agreement_slot {
  std::uint64_t group = 0, number = 0, order = 0;
  std::vector<int> members{};                          // global ranks (once entered)
  agreement_record record{};
  std::vector<std::pair<int, agree_message>> inbox{};  // (global rank, message), not taken yet
  op_state* op = nullptr;                              // the call waiting on it
};

}  // namespace dcomm::cpu
