// How a group's ranks fall on hosts, for the hierarchical collectives
// (cpu/algorithms/hierarchical.hpp): each rank's host is known from
// start-up (cpu/startup/locality.hpp: the lowest global rank with its identity),
// the same on every rank, so every rank of a group derives the same layout
// and the same algorithm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"

namespace dcomm::cpu {

// One group's hosts, seen from this rank. Hosts are ordered by their
// lowest group rank; ranks within a host ascend.
struct host_layout {
  int group_size = 1;
  int hosts = 1;
  // The group's ranks on this rank's host, and this rank's index among them.
  std::vector<int> local;
  int local_rank = 0;
  // Each host's lowest group rank (its leader), and this rank's host's index.
  std::vector<int> leaders;
  int host_rank = 0;
  // Each host's group ranks; each group rank's host's index and its index
  // among its host's ranks.
  std::vector<std::vector<int>> members;
  std::vector<int> host_index;
  std::vector<int> local_index;
  // Every host holds as many of the group's ranks; then `peers` holds, per
  // host, the rank whose local index is this rank's (the stripe it works in).
  bool uniform = false;
  std::vector<int> peers;

  // More than one host, and some host with more than one rank: where going
  // through the hosts beats treating every rank alike.
  bool spans() const { return hosts > 1 && hosts < group_size; }
};

// `host_of`: each global rank's host (empty: every rank its own).
inline host_layout make_host_layout(const group_state& g, const std::vector<int>& host_of) {
  host_layout h;
  const int n = g.size();
  h.group_size = n;
  auto host = [&](int group_rank) {
    const int global = g.ranks[static_cast<std::size_t>(group_rank)];
    return host_of.empty() ? global : host_of[static_cast<std::size_t>(global)];
  };
  // members[k]: host k's group ranks, hosts in order of their lowest rank.
  std::vector<std::vector<int>> members;
  std::vector<int> host_ids;
  int mine = 0;
  for (int r = 0; r < n; ++r) {
    std::size_t k = 0;
    while (k < host_ids.size() && host_ids[k] != host(r)) ++k;
    if (k == host_ids.size()) {
      host_ids.push_back(host(r));
      members.emplace_back();
    }
    if (r == g.rank) mine = static_cast<int>(k);
    h.host_index.push_back(static_cast<int>(k));
    h.local_index.push_back(static_cast<int>(members[k].size()));
    members[k].push_back(r);
  }
  h.hosts = static_cast<int>(members.size());
  h.host_rank = mine;
  h.local = members[static_cast<std::size_t>(mine)];
  for (std::size_t i = 0; i < h.local.size(); ++i)
    if (h.local[i] == g.rank) h.local_rank = static_cast<int>(i);
  h.uniform = true;
  for (const auto& m : members) {
    h.leaders.push_back(m.front());
    if (m.size() != h.local.size()) h.uniform = false;
  }
  if (h.uniform)
    for (const auto& m : members) h.peers.push_back(m[static_cast<std::size_t>(h.local_rank)]);
  h.members = std::move(members);
  return h;
}

// The layouts of the groups this rank has used, made once per group (a
// call allocates nothing for it); on the transport's executor only.
class host_layouts {
 public:
  explicit host_layouts(std::vector<int> host_of = {}) : host_of_(std::move(host_of)) {}

  const host_layout& of(const group_state& g) {
    auto it = by_group_.find(g.id);
    if (it == by_group_.end()) it = by_group_.emplace(g.id, make_host_layout(g, host_of_)).first;
    return it->second;
  }
  // Global rank p's host (the lowest global rank on it).
  int host_of(int p) const { return host_of_.empty() ? p : host_of_[static_cast<std::size_t>(p)]; }

 private:
  std::vector<int> host_of_;
  std::unordered_map<std::uint64_t, host_layout> by_group_;
};

}  // namespace dcomm::cpu
