// Failure forwarding: how a failure here becomes an error that names its
// first cause, and how the other ranks learn it. Fail frames (a collective
// that failed tells its group; a receive that refused a send tells the
// sender), probes at a collective's deadline (who is stuck), the blame for
// a lost link (a goodbye names the failure that made a rank leave), and the
// record of failed calls (failed_calls.hpp). Part of cpu/transport/transport.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/cpu/transport/transport.hpp"

namespace dcomm::cpu {

// Errors that name the op, its group and sequence number.
DCOMM_DECL std::exception_ptr transport::make_error(errc code, const op_state& op,
                                                    std::string peers, std::string detail,
                                                    std::string address) const {
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

// The connection to `peer` is gone. If the peer said goodbye naming the
// failure that made it leave, the first cause is blamed, not the peer.
DCOMM_DECL std::exception_ptr transport::lost_error(op_state& op, int peer) {
  const peer_link& l = *links_[static_cast<std::size_t>(peer)];
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
  if (!op.failure && op.finding.empty()) op.finding = detail;
  note_cause(fail_reason::peer_lost, culprit);
  return make_error(errc::peer_lost, op, "rank " + std::to_string(culprit), detail,
                    links_[static_cast<std::size_t>(culprit)]->address);
}

// At the deadline. After a probe (collectives), the ranks that did not
// answer or had not entered the call are to blame; else the peers whose
// messages this rank was still waiting for.
DCOMM_DECL std::exception_ptr transport::timeout_error(op_state& op) {
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
      // Named in the fail frames: a rank that had not entered holds the call
      // up for certain; a silent one may only be slow (and would blame itself).
      op.culprit = absent.empty() ? silent.front() : absent.front();
      std::sort(blamed.begin(), blamed.end());
      // The finding (what follows "the deadline passed: ") goes on to the
      // group in the fail frames.
      std::string& detail = op.finding;
      detail.clear();
      const char* separator = "";
      auto clause = [&](const std::vector<int>& ranks, const char* what) {
        if (ranks.empty()) return;
        detail += separator + rank_list(ranks) + what;
        separator = "; ";
      };
      // A silent rank of this host still has its board to read.
      std::vector<int> unread;
      for (int p : silent) {
        const std::string board = board_whereabouts(p, op);
        if (board.empty()) {
          unread.push_back(p);
          continue;
        }
        detail += std::string(separator) + "rank " + std::to_string(p) +
                  " did not answer a probe (stopped, hung, or blocking its thread?), and " + board;
        separator = "; ";
      }
      clause(unread, " did not answer a probe (stopped, hung, or blocking its thread?)");
      for (std::size_t i = 0; i < op.members.size(); ++i)
        if (op.probe->answers[i] == call_progress::not_entered && op.members[i] != rank_ &&
            !peer_lost(op.members[i])) {
          detail += separator + whereabouts(op.members[i], op, op.probe->where[i]);
          separator = "; ";
        }
      clause(waiting_too, " waited in it too");
      clause(finished, " had finished it");
      note_cause(fail_reason::timeout, op.culprit);
      return make_error(errc::timeout, op,
                        blamed.size() == 1 ? "rank " + std::to_string(blamed.front())
                                           : "ranks " + detail::format_ranks(blamed),
                        "the deadline passed: " + detail,
                        blamed.size() == 1 ? peer_address(blamed.front()) : std::string());
    }
  }
  std::vector<int> waiting;
  for (const auto& it : op.items)
    if (!it.finished()) waiting.push_back(it.peer);
  std::sort(waiting.begin(), waiting.end());
  waiting.erase(std::unique(waiting.begin(), waiting.end()), waiting.end());
  if (waiting.size() == 1) op.culprit = waiting.front();
  if (!waiting.empty()) op.finding = "it had not heard from " + rank_list(waiting);
  note_cause(fail_reason::timeout, op.culprit);
  return make_error(errc::timeout, op,
                    waiting.empty() ? "" : "ranks " + detail::format_ranks(waiting),
                    waiting.empty() ? "the deadline passed"
                                    : "the deadline passed without hearing from these peers");
}

DCOMM_DECL std::string transport::rank_list(const std::vector<int>& ranks) {
  return ranks.size() == 1 ? "rank " + std::to_string(ranks.front())
                           : "ranks " + detail::format_ranks(ranks);
}

DCOMM_DECL void transport::note_cause(fail_reason reason, int culprit) {
  if (first_reason_ != fail_reason::none || reason == fail_reason::none) return;
  first_reason_ = reason;
  first_culprit_ = culprit;
}

// A frame about a collective call as a whole (not one of its messages).
DCOMM_DECL wire_header transport::call_frame(msg_kind kind, const op_state& op) {
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
DCOMM_DECL bool transport::probe_group(op_state& op) {
  if (!op.collective || stopped()) return false;
  op.probe = std::make_unique<op_state::probe_answers>();
  op.probe->answers.assign(op.members.size(), call_progress{});
  op.probe->where.assign(op.members.size(), group_whereabouts{});
  const wire_header h = call_frame(msg_kind::probe, op);
  for (int p : op.members) {
    if (p == rank_ || peer_lost(p)) continue;
    links_[static_cast<std::size_t>(p)]->frames.push_back({h, nullptr, 0, nullptr});
    start_write(p);
    ++op.probe->awaited;
  }
  if (op.probe->awaited == 0) return false;
  op.timer().expires_after(probe_grace);
  return true;
}

DCOMM_DECL void transport::on_probe_reply(int peer, const wire_header& h) {
  for (op_state* op = ops_; op; op = op->next_op) {
    if (!op->collective || op->group != h.group || op->seq != h.seq || !op->probe) continue;
    for (std::size_t i = 0; i < op->members.size(); ++i)
      if (op->members[i] == peer && op->probe->answers[i] == call_progress{}) {
        op->probe->answers[i] = static_cast<call_progress>(h.cookie);
        op->probe->where[i] = {h.cookie2, h.sig.op, h.extra, h.bytes};
        if (--op->probe->awaited == 0) op->wake();
      }
  }
}

// Where this rank is in `group` (a probe's answer, group_whereabouts).
DCOMM_DECL void transport::tell_whereabouts(std::uint64_t group, wire_header& reply) const {
  const op_state* oldest = nullptr;
  for (const op_state* op = ops_; op; op = op->next_op)
    if (op->collective && op->group == group && (!oldest || op->seq < oldest->seq)) oldest = op;
  reply.cookie2 = 0;
  reply.extra = 0;
  if (oldest) {
    reply.cookie2 = oldest->seq + 1;
    reply.sig = oldest->sig;
    const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(detail::clock::now() -
                                                                           oldest->entered);
    reply.extra = static_cast<std::uint32_t>(
        std::clamp<std::int64_t>(ago.count(), 0, std::numeric_limits<std::uint32_t>::max()));
  }
  auto it = entered_.find(group);
  reply.bytes = it == entered_.end() ? 0 : it->second;
}

// "it is in broadcast #56 of the group (made 31.2 s ago)", or where it
// stopped: for a member that had not entered the timed-out call.
DCOMM_DECL std::string transport::whereabouts(int peer, const op_state& op,
                                              const group_whereabouts& w) const {
  std::string s = "rank " + std::to_string(peer) + " had not entered this call: ";
  if (w.in_call) {
    char ago[32];
    std::snprintf(ago, sizeof ago, "%.1f s", static_cast<double>(w.entered_ms_ago) / 1000.0);
    return s + "it is in " + name(w.op) + " #" + std::to_string(w.in_call - 1) + " (made " + ago +
           " ago)";
  }
  if (w.calls_entered == 0) return s + "it has made no call in this group yet";
  return s + "its last call in this group was #" + std::to_string(w.calls_entered - 1) +
         " (this is #" + std::to_string(op.seq) + "), and it has made none since" +
         " (busy outside dcomm?)";
}

// Where this rank is in call `seq` of `group` (a probe's answer).
DCOMM_DECL call_progress transport::progress_of(std::uint64_t group, std::uint64_t seq) const {
  for (const op_state* op = ops_; op; op = op->next_op)
    if (op->collective && op->group == group && op->seq == seq) return call_progress::in_call;
  auto it = entered_.find(group);
  return it != entered_.end() && seq < it->second ? call_progress::finished
                                                  : call_progress::not_entered;
}

// The collective in progress here with this group and sequence number.
DCOMM_DECL op_state* transport::active_call(std::uint64_t group, std::uint64_t seq) {
  for (op_state* op = ops_; op; op = op->next_op)
    if (op->collective && op->group == group && op->seq == seq) return op;
  return nullptr;
}

// For notify_group: both calls of a mismatch found here.
DCOMM_DECL void transport::remember_mismatch(std::uint64_t group, std::uint64_t seq, int peer,
                                             const call_signature& ours,
                                             const call_signature& theirs) {
  failed_call f;
  f.code = errc::mismatch;
  f.origin = rank_;
  f.culprit = peer;
  f.ours = ours;
  f.theirs = theirs;
  record_failure(group, seq, std::move(f));
}

// Adds to the record of failed calls (bounded: failed_calls.hpp).
DCOMM_DECL void transport::record_failure(std::uint64_t group, std::uint64_t seq, failed_call f) {
  auto e = entered_.find(group);
  const bool entered = e != entered_.end() && seq < e->second;
  failed_calls_.add(call_id{group, seq}, std::move(f), entered,
                    [this](const call_id& c) { return active_call(c.group, c.seq) != nullptr; });
}

// Rank `peer` made a different collective call than `op`.
DCOMM_DECL void transport::mismatched_call(op_state& op, int peer, const call_signature& theirs) {
  if (op.failure) return;
  note_cause(fail_reason::mismatch, peer);
  op.culprit = peer;
  auto e = make_error(errc::mismatch, op, "rank " + std::to_string(peer),
                      "ranks called different collectives: rank " + std::to_string(peer) +
                          " called " + describe(theirs) + ", this rank called " + describe(op.sig));
  remember_mismatch(op.group, op.seq, peer, op.sig, theirs);
  fail_op(op, std::move(e));
}

// A collective failed here: every other member learns it at once, so
// ranks that do not talk to the culprit directly fail now too. A rank
// told by a peer passes it on as well: its fail frames reach the others
// before its links close, so that none of them takes the close for the
// cause.
DCOMM_DECL void transport::notify_group(op_state& op) {
  op.notified = true;
  fail_reason reason = fail_reason::other;
  try {
    std::rethrow_exception(op.failure);
  } catch (const error& e) {
    // Refused input is refused on every rank that passed it, a revocation
    // told to every member already (impl/revocation.hpp): nothing to tell.
    if (e.code() == errc::invalid_argument || e.code() == errc::revoked) return;
    if (e.code() == errc::mismatch) reason = fail_reason::mismatch;
    if (e.code() == errc::peer_lost) reason = fail_reason::peer_lost;
    if (e.code() == errc::timeout) reason = fail_reason::timeout;
  } catch (...) {
  }
  // Failed for a send of this rank that a receive refused: the group's
  // calls do not differ; this rank gave up on this one.
  if (op.refused_send) reason = fail_reason::other;
  wire_header f = call_frame(msg_kind::fail, op);
  f.cookie = static_cast<std::uint64_t>(reason);
  f.cookie2 = static_cast<std::uint64_t>(
      (reason == fail_reason::peer_lost ? op.lost_rank : op.culprit) + 1);
  f.step = static_cast<std::uint32_t>((op.origin >= 0 ? op.origin : rank_) + 1);
  // A mismatch: the other call goes along (found here or reported), so
  // that every rank can name both calls. Then the finding, if any.
  const failed_call* found =
      reason == fail_reason::mismatch ? failed_calls_.find(call_id{op.group, op.seq}) : nullptr;
  const bool other_call = found && found->theirs.op != operation::send;
  if (other_call) f.sig = found->ours;
  const std::size_t said = std::min(op.finding.size(), max_finding_bytes);
  std::shared_ptr<std::string> payload;
  if (other_call || said) {
    payload = std::make_shared<std::string>();
    if (other_call)
      payload->append(reinterpret_cast<const char*>(&found->theirs), sizeof(call_signature));
    payload->append(op.finding, 0, said);
    f.bytes = payload->size();
    f.extra = static_cast<std::uint32_t>(said);
  }
  for (int p : op.members) {
    if (p == rank_ || peer_lost(p)) continue;
    links_[static_cast<std::size_t>(p)]->frames.push_back(
        {f, payload ? payload->data() : nullptr, f.bytes, nullptr, false, payload});
    start_write(p);
  }
}

// A fail frame: a collective failed on a peer (`theirs`: a mismatch's
// other call, the culprit's, if sent), or a receive of the peer refused a
// send from here.
DCOMM_DECL void transport::on_fail_frame(int peer, const wire_header& h,
                                         const call_signature* theirs, std::string finding) {
  if (!h.collective) return on_refused_send(peer, h);  // the only other fail frame (check_match)
  failed_call f = reported_failure(peer, h, theirs, std::move(finding));
  for (op_state* op = ops_; op; op = op->next_op)
    if (op->collective && op->group == h.group && op->seq == h.seq && !op->failure)
      fail_reported(*op, f);
  const auto reason = static_cast<fail_reason>(h.cookie);
  note_cause(reason, f.lost >= 0 ? f.lost : f.culprit >= 0 ? f.culprit : f.origin);
  // For the call's op on this rank, if it has not started yet.
  record_failure(h.group, h.seq, std::move(f));
}

// How a collective failed, from a peer's fail frame (`finding`: what the
// rank that found it said of the cause; empty: nothing said).
DCOMM_DECL failed_call transport::reported_failure(int peer, const wire_header& h,
                                                   const call_signature* theirs,
                                                   std::string finding) const {
  const auto reason = static_cast<fail_reason>(h.cookie);
  // A collective's: cookie2 names the rank to blame (the lost one, the
  // one a timeout found stuck, the other side of a mismatch), step the
  // rank whose failure it reports (each plus one).
  const int blamed = h.cookie2 && h.cookie2 <= static_cast<std::uint64_t>(world_)
                         ? static_cast<int>(h.cookie2) - 1
                         : -1;
  failed_call f;
  f.origin =
      h.step && h.step <= static_cast<std::uint32_t>(world_) ? static_cast<int>(h.step) - 1 : peer;
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
      if (theirs && blamed >= 0)
        f.detail = "ranks called different collectives: rank " + std::to_string(blamed) +
                   " called " + describe(*theirs) + ", " + origin + " called " + describe(h.sig) +
                   reported;
      else
        f.detail = "ranks called different collectives: " + origin + " called " + describe(h.sig) +
                   " and found a call that does not match" + reported;
      break;
    case fail_reason::peer_lost:
      f.code = errc::peer_lost;
      f.peers = "rank " + std::to_string(f.lost);
      f.detail = finding.empty() ? origin + " lost its connection to rank " +
                                       std::to_string(f.lost) + " during this call" + reported
                                 : origin + " lost rank " + std::to_string(f.lost) +
                                       " during this call: " + finding + reported;
      break;
    case fail_reason::timeout:
      f.code = errc::timeout;
      // Blamed itself (the reporting rank did not hear from this one in
      // time, or found it had not entered): its error names the rank that
      // gave up, not this one.
      if (blamed >= 0 && blamed != rank_) f.peers = "rank " + std::to_string(blamed);
      if (!finding.empty())
        f.detail = origin + " reached its deadline in this call: " + finding + reported;
      else
        f.detail = origin + " reached its deadline in this call" +
                   (blamed >= 0 && blamed != f.origin
                        ? ", stuck on rank " + std::to_string(blamed) +
                              " (it did not answer, or had not entered the call)"
                        : std::string(" and gave up")) +
                   reported;
      break;
    default:
      f.code = errc::aborted;
      f.detail =
          origin + " gave up on this call" + (finding.empty() ? "" : ": " + finding) + reported;
      break;
  }
  f.finding = std::move(finding);
  return f;
}

// Fails `op` with a failure a peer reported.
DCOMM_DECL void transport::fail_reported(op_state& op, const failed_call& f) {
  op.origin = f.origin;
  if (f.lost >= 0) op.lost_rank = f.lost;
  op.culprit = f.culprit;
  if (!op.failure) op.finding = f.finding;  // passed on (notify_group)
  std::string peers = f.peers, detail = f.detail, address;
  if (f.code == errc::mismatch && op.collective) {
    // Between two other ranks: blame the side whose call is not ours.
    if (f.theirs.op != operation::send && f.culprit >= 0 && op.sig == f.ours)
      peers = "rank " + std::to_string(f.culprit);
    detail += "; this rank called " + describe(op.sig);
  }
  // Where the rank to blame is (as this rank's own timeout or loss says).
  const int blamed = f.code == errc::peer_lost ? f.lost : f.code == errc::timeout ? f.culprit : -1;
  if (blamed >= 0 && blamed != rank_)
    address = peer_address(blamed);
  else if (f.code == errc::timeout && blamed == rank_ && f.origin != rank_)
    address = peer_address(f.origin);  // the peers named are the rank that gave up
  fail_op(op, make_error(f.code, op, std::move(peers), std::move(detail), std::move(address)));
}

// A receive of `peer` refused a send from here (sizes or dtypes differ).
// The frame names the send (group, tag as seq), what the receive expected
// (bytes, sig) and what the send had (cookie2: bytes, extra: dtype). The
// send fails if its op is still in progress (a large send waits for cts;
// an eager one may not have resumed yet); else the operation here waiting
// on the peer fails now (the oldest), or if none is, the next one that
// posts a message to it (report_refused_send): a blocking send of an eager
// message returns before its receiver sees it, so that is the earliest the
// sender can learn it.
DCOMM_DECL void transport::on_refused_send(int peer, const wire_header& h) {
  note_cause(fail_reason::mismatch, peer);
  const refused_send r{.group = h.group,
                       .tag = h.seq,
                       .sent = h.cookie2,
                       .sent_type = static_cast<dtype>(h.extra),
                       .expected = h.bytes,
                       .receive = h.sig};
  for (op_state* op = ops_; op; op = op->next_op)
    if (!op->collective && op->group == h.group && op->seq == h.seq &&
        std::any_of(op->items.begin(), op->items.end(),
                    [&](const io_item& i) { return i.is_send && i.peer == peer; })) {
      if (op->failure) return;
      op->culprit = peer;
      return fail_op(*op,
                     make_error(errc::mismatch, *op, "rank " + std::to_string(peer),
                                refused_send_detail(r, peer, "this send"), peer_address(peer)));
    }
  op_state* waiting = nullptr;  // ops_ lists the newest first
  for (op_state* op = ops_; op; op = op->next_op)
    if (!op->failure &&
        (std::any_of(op->items.begin(), op->items.end(),
                     [&](const io_item& i) { return i.peer == peer && !i.finished(); }) ||
         (op->on_arena &&
          std::find(op->members.begin(), op->members.end(), peer) != op->members.end())))
      waiting = op;
  if (waiting) return fail_for_refused_send(*waiting, peer, r);
  // The first one stands: it is the one to fix.
  auto& pending = links_[static_cast<std::size_t>(peer)]->refused;
  if (!pending) pending = r;
}

// What a refused send had and what the receive of `peer` expected:
// "<send> had 40 bytes (float32 x 10), rank 1 expected 40 bytes (int32 x
// 10): dtype mismatch".
DCOMM_DECL std::string transport::refused_send_detail(const refused_send& r, int peer,
                                                      const std::string& send) {
  return send + " had " + describe_message(r.sent_type, r.sent) + ", rank " + std::to_string(peer) +
         " expected " + describe_message(r.receive.type, r.expected) + ": " +
         p2p_mismatch(r.sent_type, r.sent, r.receive.type, r.expected) +
         (r.sent != r.expected ? " (a receive never truncates)" : "");
}

// An item is posted to `it.peer`: if a send of ours to it was refused and
// no operation has reported that yet, this one does (true: `it` failed).
DCOMM_DECL bool transport::report_refused_send(io_item& it) {
  auto& pending = links_[static_cast<std::size_t>(it.peer)]->refused;
  if (!pending || it.op->failure) return false;
  const refused_send r = *pending;
  pending.reset();
  it.state = item_state::failed;
  fail_for_refused_send(*it.op, it.peer, r);
  return true;
}

// A call that enters the arena needs every member: the first send of
// ours one of them refused, not reported yet, fails it (true).
DCOMM_DECL bool transport::report_refused_send_in_arena(op_state& op) {
  for (int p : op.members) {
    auto& pending = links_[static_cast<std::size_t>(p)]->refused;
    if (p == rank_ || !pending || op.failure) continue;
    const refused_send r = *pending;
    pending.reset();
    fail_for_refused_send(op, p, r);
    return true;
  }
  return false;
}

// Whether report_refused_send_in_arena would fail `op`.
DCOMM_DECL bool transport::refused_send_pending(const op_state& op) const {
  if (op.failure) return false;
  for (int p : op.members)
    if (p != rank_ && links_[static_cast<std::size_t>(p)]->refused) return true;
  return false;
}

// Fails `op`, which needs `peer`, with the mismatch of an earlier send to
// it, and takes its items back at once: a message that arrives next (on the
// same link, right behind the fail frame) is for a later receive, not for a
// receive of this failed op.
DCOMM_DECL void transport::fail_for_refused_send(op_state& op, int peer, const refused_send& r) {
  op.refused_send = true;
  op.culprit = peer;
  const std::string rank = "rank " + std::to_string(peer);
  const std::string group = r.group == op.group && !op.group_name.empty()
                                ? std::string(op.group_name)
                                : std::string("another group");
  const std::string send =
      "the send (tag " + std::to_string(static_cast<std::int64_t>(r.tag)) + " on " + group + ")";
  std::string detail = "an earlier send to " + rank +
                       " did not match its receive: " + refused_send_detail(r, peer, send);
  if (!op.failure) op.finding = detail;
  fail_op(op, make_error(errc::mismatch, op, rank, std::move(detail), peer_address(peer)));
  for (auto& it : op.items) cancel_item(it, true);
}

DCOMM_EMIT_ON_USE_DEFINITION auto transport::abandon(op_state& op, std::exception_ptr why)
    -> detail::task<void> {
  if (!op.failure)
    op.failure = why ? why : std::make_exception_ptr(std::runtime_error("abandoned"));
  if (op.collective && !op.notified) notify_group(op);
  if (options_.revoke_on_failure) revoke_after(op);  // after the call's own fail frames
  for (auto& it : op.items) cancel_item(it, true);
  // A message in progress finishes on its own (the link stays usable);
  // one that does not within io_grace (a stopped peer, a full socket)
  // is stopped by closing its link.
  auto in_flight = [&op] {
    return std::any_of(op.items.begin(), op.items.end(), [](auto& i) { return i.in_flight; });
  };
  op.timer().expires_after(io_grace);
  while (in_flight()) {
    auto [ec] = co_await op.timer().async_wait(detail::use_task);
    if (!ec) break;
  }
  for (auto& it : op.items)
    if (it.in_flight && !links_[static_cast<std::size_t>(it.peer)]->lost)
      lose_link(it.peer, "closed after rank " + std::to_string(rank_) +
                             "'s call failed: a message in progress did not end in time");
  // Closing a link completes its socket operations promptly; the bound
  // only guards against a bug turning into a hang.
  op.timer().expires_after(std::chrono::seconds(10));
  while (in_flight()) {
    auto [ec] = co_await op.timer().async_wait(detail::use_task);
    if (!ec) {
      log(detail::log_level::error,
          "tcp transport: socket operations still pending 10 s after closing");
      break;
    }
  }
  std::rethrow_exception(op.failure);
}

}  // namespace dcomm::cpu
