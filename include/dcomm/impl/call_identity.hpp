// A call's identity: how the ranks of a group agree, without a message,
// which call a message belongs to. This header states the rule and holds
// the front end's part of it; the backend's part (step and signature) is
// named below where it lives.
//
// A call is known by (group id, sequence number, step) plus its signature:
//
// - Group id. The world group is 0. A group made by new_group is
//   mix(parent id, n, its members), by split mix(parent id, n, color), where
//   n counts the groups made from the parent so far (group_state::children).
//   Every member of the parent makes its groups in the same order (new_group
//   and split are called in the same order on every member: documented in
//   communicator.hpp), so every member derives the same id for the same
//   group, and different groups get different ids. A refused split takes no
//   n (so it cannot shift the next group's id on this rank only).
//
// - Sequence number. A collective takes its group's next number
//   (group_state::next_seq) when the front end accepts it: after its
//   arguments and options are checked. A refused call (errc::invalid_argument
//   on this rank) takes none, so the next call still matches the other
//   ranks'. Every rank calls a group's collectives in the same order, so equal
//   numbers mean the same call. An object collective made of two backend
//   calls takes two numbers, in the same order everywhere (broadcast_object).
//   Point-to-point operations take no number: their place carries the tag,
//   and the backend matches (group, peer, tag) first in, first out.
//
// - Step. Inside one call, which message of the algorithm; the backend
//   chooses it (tcp: cpu/call.hpp, algorithm steps, slices, and the rooted
//   operations' confirmation at cpu::confirmation_step and above).
//
// - Signature. What the call was called with (operation, dtype, count, reduce
//   op, root, algorithm, slices), in the backend's terms (tcp:
//   cpu::call_signature in cpu/wire_format.hpp, carried by every message).
//   Ranks whose calls under the same (group, sequence number) differ fail
//   with errc::mismatch instead of mixing data (cpu/call.hpp says why every
//   mismatch is caught before any rank completes).
//
// The backend receives the first two in op_context (group, seq) and keeps
// them on every message of the call.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "dcomm/backend.hpp"

namespace dcomm::detail {

// splitmix64's finaliser: ids of different groups differ in every bit.
inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline constexpr std::uint64_t world_group_id = group_state::world_id;

// The parent's count of groups made from it: the n of the ids below. Taken
// once per accepted new_group or split, on every member, in call order.
inline std::uint64_t next_child_index(group_state& parent) {
  return parent.children.fetch_add(1);
}

// new_group: `members` are parent group ranks, sorted.
inline std::uint64_t new_group_id(std::uint64_t parent, std::uint64_t index,
                                  std::span<const int> members) {
  std::uint64_t id = mix64(parent ^ mix64(index + 1));
  for (int m : members) id = mix64(id ^ static_cast<std::uint64_t>(m));
  return id;
}

// shrink: the survivors (global ranks, in old group rank order) of the
// parent's agreement number `agreement`.
inline std::uint64_t shrink_group_id(std::uint64_t parent, std::uint64_t agreement,
                                     std::span<const int> survivors) {
  std::uint64_t id = mix64(parent ^ mix64(~agreement));
  for (int m : survivors) id = mix64(id ^ static_cast<std::uint64_t>(m));
  return id;
}

// split: every rank passing `color` to the same split gets the same group.
inline std::uint64_t split_group_id(std::uint64_t parent, std::uint64_t index, std::int64_t color) {
  return mix64(parent ^ mix64(index + 1) ^ mix64(static_cast<std::uint64_t>(color) << 1));
}

// The options a call runs with: each field its own where set, else the
// handle's defaults (communicator::with), else the group's timeout.
inline op_options effective_options(const op_options& call, const op_options& defaults) {
  op_options o = call;
  if (!o.timeout) o.timeout = defaults.timeout;
  if (o.algorithm == dcomm::algorithm::automatic) o.algorithm = defaults.algorithm;
  if (!o.stream) o.stream = defaults.stream;
  return o;
}

// The group's next sequence number: only for a call that was accepted.
inline std::uint64_t take_sequence_number(group_state& group) {
  return group.next_seq.fetch_add(1);
}

// A collective: numbered unless `refused` (then seq is 0 and never used:
// the call completes with its refusal without reaching the backend).
inline op_context collective_context(const std::shared_ptr<group_state>& group, operation op,
                                     const op_options& o, bool refused) {
  const auto now = detail::clock::now();
  return {.group = group,
          .operation = op,
          .seq = refused ? 0 : take_sequence_number(*group),
          .deadline = now + o.timeout.value_or(group->timeout),
          .algorithm = o.algorithm,
          .stream = o.stream,
          .issued = now};
}

// An agreement: numbered by the group's count of agreements, apart from
// its collectives, so that members whose calls before it differ in number
// (some failed, some completed a call the failure revoked) still meet.
inline op_context agreement_context(const std::shared_ptr<group_state>& group,
                                    const op_options& o, operation op = operation::agree) {
  const auto now = detail::clock::now();
  return {.group = group,
          .operation = op,
          .seq = group->agreements.fetch_add(1),
          .deadline = now + o.timeout.value_or(group->timeout),
          .issued = now};
}

// A point-to-point operation: the tag where a collective has its number.
inline op_context p2p_context(const std::shared_ptr<group_state>& group, operation op, int tag,
                              const op_options& o) {
  const auto now = detail::clock::now();
  return {.group = group,
          .operation = op,
          .seq = static_cast<std::uint64_t>(static_cast<std::int64_t>(tag)),
          .deadline = now + o.timeout.value_or(group->timeout),
          .algorithm = o.algorithm,
          .stream = o.stream,
          .issued = now};
}

}  // namespace dcomm::detail
