// Revocation (communicator::revoke, cpu/transport/revocations.hpp): a
// group revoked here, or by a peer's revoke frame, fails every operation
// of it and of the groups made from it, now and later, with errc::revoked
// naming the revoker and why. The frame is spread by flooding: a rank
// tells every other member the first time it learns of it, before it
// fails its own operations, so that a fail frame it then sends about a
// call of the group (on the same ordered link) never overtakes it. Part
// of cpu/transport/transport.hpp.
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

DCOMM_DECL void transport::revoke(std::uint64_t group, std::string why) {
  if (why.size() > max_finding_bytes) why.resize(max_finding_bytes);
  apply_revocation({.group = group, .revoker = rank_, .why = std::move(why)}, rank_);
}

DCOMM_DECL void transport::add_group(std::uint64_t parent, std::uint64_t id, std::string name,
                                     std::vector<int> members, std::weak_ptr<const void> alive) {
  const revocation* born_revoked =
      groups_.add(parent, id, std::move(name), std::move(members), std::move(alive));
  // Heard of before this rank made the group: the members this rank could
  // not tell then are told now (its parent's revocation was told with it).
  if (born_revoked && born_revoked->group == id) tell_revocation(*born_revoked, -1);
}

// A revoke frame: cookie names the revoker (plus one), the payload why.
DCOMM_DECL void transport::on_revoke(int peer, const wire_header& h, std::string why) {
  const int revoker = h.cookie && h.cookie <= static_cast<std::uint64_t>(world_)
                          ? static_cast<int>(h.cookie) - 1
                          : peer;
  apply_revocation({.group = h.group, .revoker = revoker, .why = std::move(why)}, peer);
}

DCOMM_DECL void transport::apply_revocation(revocation r, int heard_from) {
  const std::vector<std::uint64_t> now = groups_.revoke(std::move(r));
  if (now.empty()) return;  // known already: told already
  const revocation& kept = *groups_.revoked(now.front());
  tell_revocation(kept, heard_from);
  for (op_state* op = ops_; op; op = op->next_op)
    if (std::find(now.begin(), now.end(), op->group) != now.end() && !op->failure &&
        !op->survives_revocation)
      fail_op(*op, revoked_error(*op, kept));
}

// Tells every live member of the revoked group but this rank and the one
// it heard from (the group unknown here yet: add_group tells them).
DCOMM_DECL void transport::tell_revocation(const revocation& r, int heard_from) {
  const std::vector<int>* members = groups_.members(r.group);
  if (!members || stopped()) return;
  wire_header h;
  h.kind = msg_kind::revoke;
  h.group = r.group;
  h.cookie = static_cast<std::uint64_t>(r.revoker + 1);
  h.bytes = r.why.size();
  auto payload = std::make_shared<std::string>(r.why);
  for (int p : *members) {
    if (p == rank_ || p == heard_from || p == r.revoker || peer_lost(p)) continue;
    links_[static_cast<std::size_t>(p)]->frames.push_back(
        {h, payload->data(), h.bytes, nullptr, false, payload});
    start_write(p);
  }
}

DCOMM_DECL std::exception_ptr transport::revoked_error(const op_state& op,
                                                       const revocation& r) const {
  const std::string by = r.revoker == rank_ ? "this rank" : "rank " + std::to_string(r.revoker);
  const std::string what = r.group_name.empty() ? std::string("a group") : r.group_name;
  std::string detail = by + " revoked " + what;
  if (r.group != op.group) detail += ", which this group was made from";
  if (!r.why.empty()) detail += ": " + r.why;
  return make_error(errc::revoked, op, "rank " + std::to_string(r.revoker), std::move(detail),
                    r.revoker == rank_ ? std::string() : peer_address(r.revoker));
}

// backend_options::revoke_on_failure: a lost peer or a timeout revokes
// the failed operation's group, so that every member's operations of it
// (and of the groups made from it) fail at once, not only this call's.
DCOMM_DECL void transport::revoke_after(const op_state& op) {
  try {
    std::rethrow_exception(op.failure);
  } catch (const error& e) {
    if (e.code() == errc::peer_lost || e.code() == errc::timeout)
      revoke(op.group, "after its " + std::string(op.operation) + " failed: " + e.what());
  } catch (...) {
  }
}

}  // namespace dcomm::cpu
