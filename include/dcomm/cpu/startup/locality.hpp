// Which peers share this rank's host, learnt through the store at start-up:
// every rank publishes "<prefix>/host/<rank>" = its host identity
// (shm/host_identity.hpp), or nothing to share ("") where it takes TCP for
// every link; the ranks with this rank's identity are its host. Each pair
// decides alike (both read the same values), so a link is shared memory at
// both ends or at neither. The same value's second line is the rank's
// clock (its boot id, and its wall clock minus its steady clock), from
// which each rank learns how to read the times the others' messages tell
// (detail/arrivals.hpp).
#pragma once

#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dcomm/cpu/startup/published.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/shm/host_identity.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm::cpu {

// DCOMM_TRANSPORT's values: which links the ranks of one host use.
enum class link_choice {
  automatic,  // shared memory between ranks of a host, TCP between hosts
  shm,        // the same, and a rank that cannot tell its host fails
  tcp,        // TCP for every link (loopback on one host)
};

inline link_choice parse_link_choice(std::string_view v) {
  if (v.empty() || v == "auto") return link_choice::automatic;
  if (v == "shm") return link_choice::shm;
  if (v == "tcp") return link_choice::tcp;
  throw_error(errc::invalid_argument, {.operation = "cpu_backend",
                                       .expected = "DCOMM_TRANSPORT (or options::transport) "
                                                   "'auto', 'shm' or 'tcp'",
                                       .seen = "'" + std::string(v) + "'"});
}

// What this rank publishes: its host identity, or "" for no sharing.
inline std::string host_to_publish(link_choice choice, int rank, std::string id) {
  if (choice == link_choice::tcp) return {};
  if (id.empty()) id = shm::host_identity();
  if (id.empty() && choice == link_choice::shm)
    throw_error(errc::unsupported,
                {.operation = "cpu_backend",
                 .rank = rank,
                 .detail = "DCOMM_TRANSPORT=shm, but this rank cannot tell which host it is on "
                           "(/proc/sys/kernel/random/boot_id or /proc/self/ns/net unreadable); "
                           "set DCOMM_HOST_ID or DCOMM_TRANSPORT=auto"});
  return id;
}

// This rank's clock as it publishes it: "<boot id> <wall - steady, ns>".
inline std::string clock_to_publish() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  const auto ns = [](auto t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  };
  const auto steady = ns(std::chrono::steady_clock::now());
  const auto wall = ns(std::chrono::system_clock::now());
  return (boot.empty() ? "-" : boot) + " " + std::to_string(wall - steady);
}

// How far the clock published as `theirs` is behind `mine` (this rank's
// time = theirs + offset): 0 on one boot (one steady clock), else through
// the wall clocks; 0 where either cannot be read.
inline std::int64_t clock_offset(std::string_view theirs, std::string_view mine) {
  auto parse = [](std::string_view v, std::string_view& boot, long long& skew) {
    const auto space = v.find(' ');
    if (space == std::string_view::npos) return false;
    boot = v.substr(0, space);
    const auto digits = v.substr(space + 1);
    return std::from_chars(digits.data(), digits.data() + digits.size(), skew).ec == std::errc{};
  };
  std::string_view boot_t, boot_m;
  long long skew_t = 0, skew_m = 0;
  if (!parse(theirs, boot_t, skew_t) || !parse(mine, boot_m, skew_m)) return 0;
  if (boot_t == boot_m && boot_t != "-") return 0;
  return skew_t - skew_m;
}

// What a rank publishes: its host identity, then its clock.
DCOMM_EMIT_ON_USE asio::awaitable<void> publish_host(std::shared_ptr<store> s,
                                                     const std::string& prefix, int rank,
                                                     const std::string& host) {
  const std::string key = prefix + "/host/" + std::to_string(rank);
  co_await s->set(key, host + "\n" + clock_to_publish());
}

// What the ranks published: each rank's host, as the lowest global rank
// that published the same identity (a rank that published "" is a host of
// its own), the same on every rank, since every rank reads the same
// values (the hierarchical collectives, cpu/algorithms/hierarchical.hpp,
// group ranks by it); and how far each rank's clock is behind this one's.
struct peers_published {
  std::vector<int> host_of;
  std::vector<std::int64_t> clock_offsets;
};

DCOMM_EMIT_ON_USE asio::awaitable<peers_published> read_peers_published(
    std::shared_ptr<store> s, const std::string& prefix, int rank, int world,
    const std::string& mine, detail::clock::time_point deadline) {
  std::vector<std::string> ids(static_cast<std::size_t>(world));
  std::vector<std::string> clocks(static_cast<std::size_t>(world));
  const std::string my_clock = clock_to_publish();
  for (int p = 0; p < world; ++p) {
    if (p == rank) {
      ids[static_cast<std::size_t>(p)] = mine;
      clocks[static_cast<std::size_t>(p)] = my_clock;
      continue;
    }
    // Published before that rank connected its mesh, which is complete.
    const std::string key = prefix + "/host/" + std::to_string(p);
    const auto left = detail::time_left(deadline);
    std::exception_ptr failure;
    try {
      ids[static_cast<std::size_t>(p)] = co_await s->get(key, left);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) rethrow_unpublished(failure, "cpu_backend start-up", rank, p, key, "host");
    auto& id = ids[static_cast<std::size_t>(p)];
    if (const auto nl = id.find('\n'); nl != std::string::npos) {
      clocks[static_cast<std::size_t>(p)] = id.substr(nl + 1);
      id.resize(nl);
    }
  }
  peers_published out;
  out.host_of.resize(static_cast<std::size_t>(world));
  out.clock_offsets.resize(static_cast<std::size_t>(world));
  std::map<std::string, int> first;  // identity -> its lowest rank
  for (int p = 0; p < world; ++p) {
    const auto i = static_cast<std::size_t>(p);
    out.host_of[i] = ids[i].empty() ? p : first.try_emplace(ids[i], p).first->second;
    out.clock_offsets[i] = clock_offset(clocks[i], my_clock);
  }
  co_return out;
}

// The global ranks on this rank's host that share memory with it,
// ascending, this one included (alone where it published "").
inline std::vector<int> ranks_on_this_host(const std::vector<int>& host_of, int rank) {
  std::vector<int> local;
  for (int p = 0; p < static_cast<int>(host_of.size()); ++p)
    if (host_of[static_cast<std::size_t>(p)] == host_of[static_cast<std::size_t>(rank)])
      local.push_back(p);
  return local;
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::publish_host<void>(std::shared_ptr<store> s, const std::string& prefix, int rank, const std::string& host) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu::read_peers_published<void>(std::shared_ptr<store> s, const std::string& prefix, int rank, int world, const std::string& mine, detail::clock::time_point deadline) -> asio::awaitable<peers_published>)
// clang-format on
// End of the separate-compilation block.
