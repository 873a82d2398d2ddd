// When the members of a collective called it, as far as one rank has
// heard: the first and the last call's times and who made the last. What
// finds a straggler (trace/op_stats.hpp) without an extra round: each
// message of a call carries what its sender knew when it sent it (the
// frame header, cpu/wire_format.hpp; a record of the arena, shm/arena.hpp),
// and each rank merges what it receives. A call whose result needs every
// rank's input (all_reduce, all_gather, barrier, ...; the rooted ones by
// their confirmation) hears, through that chain, of every rank's call.
//
// Times are on the receiving rank's steady clock: a stamp from a rank of
// another boot is moved by the difference of the two ranks' (wall clock -
// steady clock), read at start-up and exchanged through the store
// (cpu/startup/locality.hpp). Ranks of one boot share the steady clock exactly;
// others are as close as their wall clocks (NTP: about a millisecond).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace dcomm::detail {

struct arrivals {
  std::int64_t first_ns = 0;  // steady clock; meaningful once last_rank >= 0
  std::int64_t last_ns = 0;
  int last_rank = -1;   // the world rank that called last
  bool others = false;  // heard of another rank's call (not only this rank's own)

  bool known() const { return last_rank >= 0; }
  std::int64_t spread_ns() const { return known() ? last_ns - first_ns : 0; }

  // A rank's call at `ns`.
  void note(std::int64_t ns, int rank) {
    if (!known()) {
      first_ns = last_ns = ns;
      last_rank = rank;
      return;
    }
    first_ns = std::min(first_ns, ns);
    if (ns > last_ns) {
      last_ns = ns;
      last_rank = rank;
    }
  }
  void merge(const arrivals& o) {
    if (!o.known()) return;
    if (!known()) {
      *this = o;
      return;
    }
    first_ns = std::min(first_ns, o.first_ns);
    if (o.last_ns > last_ns) {
      last_ns = o.last_ns;
      last_rank = o.last_rank;
    }
    others = others || o.others;
  }
};

// What travels in a frame header or an arena record: 16 bytes. The spread
// (last - first) in microseconds, rounded up, saturating at about 71
// minutes; last_rank -1: nothing known.
struct arrival_stamp {
  std::int64_t last_ns = 0;
  std::uint32_t spread_us = 0;
  std::int32_t last_rank = -1;
};
static_assert(sizeof(arrival_stamp) == 16);

inline arrival_stamp stamp_of(const arrivals& a) {
  if (!a.known()) return {};
  const std::int64_t us = (a.spread_ns() + 999) / 1000;
  const auto max = static_cast<std::int64_t>(std::numeric_limits<std::uint32_t>::max());
  return {a.last_ns, static_cast<std::uint32_t>(std::clamp<std::int64_t>(us, 0, max)), a.last_rank};
}

// A stamp another rank wrote (so it tells of that rank's call at least),
// on a clock `offset_ns` behind this rank's (this rank's time = theirs +
// offset_ns).
inline arrivals arrivals_of(const arrival_stamp& s, std::int64_t offset_ns = 0) {
  if (s.last_rank < 0) return {};
  const std::int64_t last = s.last_ns + offset_ns;
  return {last - static_cast<std::int64_t>(s.spread_us) * 1000, last, s.last_rank, true};
}

}  // namespace dcomm::detail
