// Agreement (communicator::agree): the protocol is in
// cpu/transport/agreements.hpp; here its records meet the links. A record
// is made by the first agree frame of an agreement or by this rank's entry,
// fed every frame and every lost link, and kept after it decided (a later
// coordinator may ask for the decision) until newer ones push it out.
// Part of cpu/transport/transport.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/cpu/transport/transport.hpp"

namespace dcomm::cpu {

DCOMM_EMIT_ON_USE_DEFINITION auto transport::agree(std::uint64_t group, std::string_view group_name,
                                                   std::uint64_t number, std::vector<int> members,
                                                   int me, bool flag, const char* operation,
                                                   detail::clock::time_point deadline)
    -> detail::task<agreed_value> {
  op_state op(ex_, deadline);
  op.operation = operation;
  op.group = group;
  op.group_name = group_name;
  op.seq = number;
  op.survives_revocation = true;  // what agreement is for
  add_op(op);
  agreement_slot& s = slot_for(group, number);
  s.members = std::move(members);
  s.record.enter(me, static_cast<int>(s.members.size()), flag);
  s.op = &op;
  for (;;) {
    if (op.failure) break;
    pump(s);
    if (s.record.decided()) {
      s.op = nullptr;
      remove_op(op);
      co_return *s.record.decided();
    }
    if (detail::clock::now() >= op.deadline) {
      fail_op(op, agreement_timeout(op, s));
      break;
    }
    co_await op.timer().async_wait(detail::use_task);
  }
  s.op = nullptr;
  remove_op(op);
  std::rethrow_exception(op.failure);
}

// The record of agreement `number` of `group`, made if new. Beyond
// max_agreements, the oldest that no call waits on goes.
DCOMM_DECL agreement_slot& transport::slot_for(std::uint64_t group,
                                                          std::uint64_t number) {
  auto [at, made] = agreements_.try_emplace({group, number});
  if (made) {
    at->second.group = group;
    at->second.number = number;
    at->second.order = ++agreement_order_;
    while (agreements_.size() > max_agreements) {
      auto oldest = agreements_.end();
      for (auto i = agreements_.begin(); i != agreements_.end(); ++i)
        if (!i->second.op && i != at &&
            (oldest == agreements_.end() || i->second.order < oldest->second.order))
          oldest = i;
      if (oldest == agreements_.end()) break;
      agreements_.erase(oldest);
    }
  }
  return at->second;
}

// Feeds the record what came, then sends what it says (entered records).
DCOMM_DECL void transport::pump(agreement_slot& s) {
  if (!s.record.entered()) return;
  for (auto& [from, m] : s.inbox) {
    const auto at = std::find(s.members.begin(), s.members.end(), from);
    if (at != s.members.end()) s.record.take(static_cast<int>(at - s.members.begin()), std::move(m));
  }
  s.inbox.clear();
  const auto out = s.record.step(
      [&](int i) { return peer_lost(s.members[static_cast<std::size_t>(i)]); });
  for (const agree_outgoing& o : out) {
    const int p = s.members[static_cast<std::size_t>(o.to)];
    if (p == rank_ || peer_lost(p) || stopped()) continue;
    wire_header h;
    h.kind = msg_kind::agree;
    h.group = s.group;
    h.seq = s.number;
    h.cookie = static_cast<std::uint64_t>(o.m.step);
    h.cookie2 = static_cast<std::uint64_t>(o.m.epoch + 1);
    auto payload = std::make_shared<std::string>(encode(o.m));
    h.bytes = payload->size();
    links_[static_cast<std::size_t>(p)]->frames.push_back(
        {h, payload->data(), h.bytes, nullptr, false, payload});
    start_write(p);
  }
  if (s.op && s.record.decided()) s.op->wake();
}

// A link was lost: every agreement looks again at who its coordinator is
// and whom it waits for (a decided one tells the next coordinator).
DCOMM_DECL void transport::pump_agreements() {
  for (auto& [key, s] : agreements_) {
    pump(s);
    if (s.op) s.op->wake();
  }
}

DCOMM_DECL void transport::on_agree_frame(int peer, const wire_header& h, const std::string& bytes) {
  agreement_slot& s = slot_for(h.group, h.seq);
  const std::vector<int>* members = groups_.members(h.group);
  const int size = s.record.entered() ? s.record.size()
                                      : members ? static_cast<int>(members->size()) : world_;
  auto m = decode(static_cast<agree_step>(h.cookie), static_cast<int>(h.cookie2) - 1, bytes, size);
  if (!m) {
    log(detail::log_level::warning, "rank " + std::to_string(rank_) + ": an agree frame from rank " +
                                        std::to_string(peer) + " that does not parse; dropped");
    return;
  }
  s.inbox.emplace_back(peer, std::move(*m));
  pump(s);
  if (s.op) s.op->wake();
}

DCOMM_DECL std::exception_ptr transport::agreement_timeout(const op_state& op,
                                                           const agreement_slot& s) const {
  std::vector<int> waiting;  // the coordinator, or as the coordinator the members not heard
  for (int i : s.record.waiting_for(
           [&](int i) { return peer_lost(s.members[static_cast<std::size_t>(i)]); }))
    waiting.push_back(s.members[static_cast<std::size_t>(i)]);
  std::string detail = "the deadline passed before the agreement was decided";
  if (!waiting.empty())
    detail += ", waiting for " + rank_list(waiting) +
              " (stopped, hung, or not in the agreement yet?)";
  return make_error(errc::timeout, op,
                    waiting.size() == 1 ? "rank " + std::to_string(waiting.front())
                                        : "ranks " + detail::format_ranks(waiting),
                    detail, waiting.size() == 1 ? peer_address(waiting.front()) : std::string());
}

}  // namespace dcomm::cpu
