// heal: brings every member of a communicator the state of the most
// advanced one (a joiner after grow(), a rank that fell behind or whose
// bits drifted), and checks that all of them hold the same bits: torchft's
// healing from a live peer, PCCL's shared state (docs/elastic.md).
//
//   std::vector<std::span<std::uint8_t>> state{dcomm::bytes_of(weights), dcomm::bytes_of(moments)};
//   dcomm::heal_result r = co_await dcomm::heal(comm, step, state);   // every member
//   step = r.step;   // the source's; r.healed: the members whose state was replaced
//
// What happens: every member says its step and its buffers' sizes, in one
// all_gather; the source is the lowest rank of the largest step. Where
// several members have that step, they say a digest of their bytes too
// (zlib's crc32, chained over the buffers), in a second all_gather.
// The members whose step or digest differs from the source's get its bytes:
// a broadcast per buffer in the group of the source and them (shared memory
// or the network, the backend's best algorithm for the size). Buffers whose
// number or sizes differ from the source's fail every member with
// errc::mismatch before any byte moves (a joiner allocates the same shapes).
// Needs zlib (link with -lz; Meson: dependency('zlib')).
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

// What heal() did: whose state everyone now holds, its step, and the
// members (ranks of the communicator) it was sent to; empty when every
// member held the same step and bits.
struct heal_result {
  int source = 0;
  std::int64_t step = 0;
  std::vector<int> healed;
};

// The bytes of a contiguous container of trivially copyable elements, for
// heal's state.
template <class Container>
requires std::is_trivially_copyable_v<typename Container::value_type> std::span<std::uint8_t>
bytes_of(Container& c) {
  return {reinterpret_cast<std::uint8_t*>(c.data()),
          c.size() * sizeof(typename Container::value_type)};
}

namespace detail {

// zlib's crc32 of every buffer in turn (it takes at most UINT_MAX bytes a call).
inline std::uint32_t state_digest(std::span<const std::span<std::uint8_t>> state) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (const auto& b : state) {
    const std::uint8_t* p = b.data();
    for (std::size_t left = b.size(); left > 0;) {
      const auto n = static_cast<uInt>(std::min<std::size_t>(left, 1u << 30));
      crc = ::crc32(crc, p, n);
      p += n;
      left -= n;
    }
  }
  return static_cast<std::uint32_t>(crc);
}

// What a member says of itself: step, digest (0 until known), then each
// buffer's size.
inline std::vector<std::int64_t> heal_claim(std::int64_t step,
                                            std::span<const std::span<std::uint8_t>> state) {
  std::vector<std::int64_t> claim{step, 0};
  for (const auto& b : state) claim.push_back(static_cast<std::int64_t>(b.size()));
  return claim;
}

// The source, and the members whose claim differs from its; throws
// errc::mismatch (the same on every member: all read the same claims) where
// a member's buffers differ in number or size from the source's.
inline heal_result plan_heal(const std::vector<std::vector<std::int64_t>>& claims, int rank) {
  heal_result plan;
  for (std::size_t r = 0; r < claims.size(); ++r)
    if (claims[r][0] > claims[static_cast<std::size_t>(plan.source)][0])
      plan.source = static_cast<int>(r);
  const auto& source = claims[static_cast<std::size_t>(plan.source)];
  plan.step = source[0];
  for (std::size_t r = 0; r < claims.size(); ++r) {
    const auto& c = claims[r];
    if (!std::equal(c.begin() + 2, c.end(), source.begin() + 2, source.end())) {
      // Appended piece by piece: g++ 12 -O2 warns falsely (-Wrestrict) on
      // a literal added to a temporary string here.
      auto sizes = [](const std::vector<std::int64_t>& v) {
        std::string s = std::to_string(v.size() - 2);
        s.append(" buffers of");
        for (std::size_t i = 2; i < v.size(); ++i) s.append(" ").append(std::to_string(v[i]));
        s.append(" bytes");
        return s;
      };
      throw_error(errc::mismatch, {.operation = "heal",
                                   .rank = rank,
                                   .peers = "rank " + std::to_string(r),
                                   .expected = sizes(source) + " (rank " +
                                               std::to_string(plan.source) + "'s, the source)",
                                   .seen = sizes(c)});
    }
    if (c[0] != source[0] || c[1] != source[1]) plan.healed.push_back(static_cast<int>(r));
  }
  return plan;
}

template <backend Backend>
asio::awaitable<heal_result> heal_op(communicator<Backend> comm, std::int64_t step,
                                     std::span<const std::span<std::uint8_t>> state, op_options o) {
  auto claims = co_await comm.all_gather_object(heal_claim(step, state), o, asio::use_awaitable);
  heal_result plan = plan_heal(claims, comm.rank());
  // Where several members lead, their bits decide too: they alone digest
  // theirs (a member behind gets the source's bytes whatever it holds).
  const auto leaders =
      std::count_if(claims.begin(), claims.end(), [&](const auto& c) { return c[0] == plan.step; });
  if (leaders > 1) {
    const std::int64_t digest =
        step == plan.step ? static_cast<std::int64_t>(state_digest(state)) : 0;
    const auto digests = co_await comm.all_gather_object(digest, o, asio::use_awaitable);
    for (std::size_t r = 0; r < claims.size(); ++r) claims[r][1] = digests[r];
    plan = plan_heal(claims, comm.rank());
  }
  if (plan.healed.empty()) co_return plan;
  std::vector<int> members = plan.healed;
  members.push_back(plan.source);
  std::sort(members.begin(), members.end());
  auto group = comm.new_group(members);
  if (!group) co_return plan;
  const int root =
      static_cast<int>(std::find(members.begin(), members.end(), plan.source) - members.begin());
  for (std::span<std::uint8_t> b : state)
    co_await group->broadcast(b, root, o, asio::use_awaitable);
  co_return plan;
}

}  // namespace detail

// Every member of comm calls it, with its step and its state (the same
// number of buffers, of the same sizes, on every member): the members
// behind the most advanced (largest step, then lowest rank) or holding
// other bits get its state. Returns what it did; each member's step is then
// the result's. The buffers must outlive the call. `o` applies to each of
// its collectives.
template <backend Backend, completion_token_for<heal_result> Token = default_token_t>
auto heal(const communicator<Backend>& comm, std::int64_t step,
          std::span<const std::span<std::uint8_t>> state, op_options o, Token&& token = {}) {
  const auto limit = o.timeout.value_or(comm.timeout()) * 4 + detail::blocking_grace;
  return detail::initiate(comm.get_executor(), detail::heal_op<Backend>(comm, step, state, o),
                          std::forward<Token>(token), "heal", limit);
}
template <backend Backend, completion_token_for<heal_result> Token = default_token_t>
auto heal(const communicator<Backend>& comm, std::int64_t step,
          std::span<const std::span<std::uint8_t>> state, Token&& token = {}) {
  return heal(comm, step, state, op_options{}, std::forward<Token>(token));
}

}  // namespace dcomm
