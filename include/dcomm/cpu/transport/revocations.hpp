// The groups a transport knows of, and which of them are revoked
// (communicator::revoke). A revocation is a fact about a group id, kept for
// the life of the backend: every pending and later operation of the group,
// and of every group made from it (new_group, split), fails with
// errc::revoked. The transport spreads it by flooding (impl/revocation.hpp):
// the first time a rank learns that a group is revoked it tells every other
// member once, so that one that heard it from a rank that died halfway
// through telling tells the rest. A rank may hear of it before it has made
// the group itself (it is slow to call new_group): the record waits, and the
// group is born revoked and told on.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"

namespace dcomm::cpu {

struct revocation {
  std::uint64_t group = 0;  // the group revoked: the op's own, or one it was made from
  std::string group_name{};  // as the revoked group's errors name it ("" : unknown here)
  int revoker = -1;         // a world rank
  std::string why{};         // the revoker's words (revoke's argument, or the failure)
};

class group_registry {
 public:
  // The world group: every rank, for the life of the backend.
  explicit group_registry(int world) {
    known_group w;
    w.name = "the world group";
    for (int r = 0; r < world; ++r) w.members.push_back(r);
    groups_.emplace(group_state::world_id, std::move(w));
  }

  // A group made from `parent` on this rank (itself: a group of survivors,
  // communicator::shrink, which a revocation of the old group does not
  // reach), whose members are `members`
  // (global ranks): kept while `alive` is (the group's state). The groups of
  // dead handles go as groups are added, so that the registry stays as
  // large as the program's live groups. Returns the group's revocation if
  // it is born revoked (it or its parent was: a revocation it did not see).
  const revocation* add(std::uint64_t parent, std::uint64_t id, std::string name,
                        std::vector<int> members, std::weak_ptr<const void> alive) {
    prune();
    known_group g;
    g.name = std::move(name);
    g.parent = parent;
    g.members = std::move(members);
    g.alive = std::move(alive);
    groups_.insert_or_assign(id, std::move(g));
    if (auto r = revoked_.find(id); r != revoked_.end()) {
      if (r->second.group_name.empty()) r->second.group_name = groups_.at(id).name;
      return &r->second;
    }
    if (auto p = revoked_.find(parent); p != revoked_.end()) {
      revoked_.emplace(id, p->second);
      return &revoked_.at(id);
    }
    return nullptr;
  }

  // The members of group `id` (global ranks); null if this rank does not
  // know the group (yet).
  const std::vector<int>* members(std::uint64_t id) const {
    auto g = groups_.find(id);
    return g == groups_.end() ? nullptr : &g->second.members;
  }

  // The revocation that fails group `id`'s operations, or null.
  const revocation* revoked(std::uint64_t id) const {
    if (revoked_.empty()) return nullptr;  // every call asks: the common answer first
    auto r = revoked_.find(id);
    return r == revoked_.end() ? nullptr : &r->second;
  }

  // Records that `r.group` is revoked; returns the groups this revokes
  // here, the group and every group known to be made from it, none already
  // revoked (empty: this rank knew it already).
  std::vector<std::uint64_t> revoke(revocation r) {
    std::vector<std::uint64_t> now;
    if (revoked_.count(r.group)) return now;
    if (auto g = groups_.find(r.group); g != groups_.end() && r.group_name.empty())
      r.group_name = g->second.name;
    revoked_.emplace(r.group, r);
    now.push_back(r.group);
    // Descendants: a group's children are found by their parent link
    // (groups are few; revocations are rarer still).
    for (std::size_t i = 0; i < now.size(); ++i)
      for (auto& [id, g] : groups_)
        if (g.parent == now[i] && id != now[i] && !revoked_.count(id)) {
          revoked_.emplace(id, r);
          now.push_back(id);
        }
    return now;
  }

 private:
  struct known_group {
    std::string name;
    std::uint64_t parent = group_state::world_id;
    std::vector<int> members;
    std::weak_ptr<const void> alive;  // the world's: never looked at
  };

  void prune() {
    for (auto g = groups_.begin(); g != groups_.end();)
      if (g->first != group_state::world_id && g->second.alive.expired())
        g = groups_.erase(g);
      else
        ++g;
  }

  std::unordered_map<std::uint64_t, known_group> groups_;
  std::unordered_map<std::uint64_t, revocation> revoked_;
};

}  // namespace dcomm::cpu
