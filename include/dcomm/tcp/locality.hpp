// Which peers share this rank's host, learnt through the store at start-up:
// every rank publishes "<prefix>/host/<rank>" = its host identity
// (shm/host_identity.hpp), or nothing to share ("") where it takes TCP for
// every link; the ranks with this rank's identity are its host. Each pair
// decides alike (both read the same values), so a link is shared memory at
// both ends or at neither.
#pragma once

#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/shm/host_identity.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/tcp/published.hpp"

namespace dcomm::tcp {

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

inline asio::awaitable<void> publish_host(std::shared_ptr<store> s, const std::string& prefix,
                                          int rank, std::string host) {
  const std::string key = prefix + "/host/" + std::to_string(rank);
  co_await s->set(key, std::move(host));
}

// Every rank's host, as the lowest global rank that published the same
// identity (a rank that published "" is a host of its own): the same on
// every rank, since every rank reads the same values. The hierarchical
// collectives (tcp/algorithms/hierarchical.hpp) group ranks by it.
inline asio::awaitable<std::vector<int>> host_of_each_rank(std::shared_ptr<store> s,
                                                           const std::string& prefix, int rank,
                                                           int world, const std::string& mine,
                                                           detail::clock::time_point deadline) {
  std::vector<std::string> ids(static_cast<std::size_t>(world));
  for (int p = 0; p < world; ++p) {
    if (p == rank) {
      ids[static_cast<std::size_t>(p)] = mine;
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
  }
  std::vector<int> host(static_cast<std::size_t>(world));
  std::map<std::string, int> first;  // identity -> its lowest rank
  for (int p = 0; p < world; ++p) {
    const auto& id = ids[static_cast<std::size_t>(p)];
    host[static_cast<std::size_t>(p)] = id.empty() ? p : first.try_emplace(id, p).first->second;
  }
  co_return host;
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

}  // namespace dcomm::tcp
