// dcomm-trace's analysis: the ranks' flight recorder dumps merged into where
// each rank stood in each group, and a verdict: calls that differ between
// ranks at one sequence number, ranks that are gone (no dump while the others
// lost a peer), ranks that hold a group up (they have not entered the call
// the others wait in), point-to-point calls left waiting; and, for a job
// that was slow rather than stuck, a rank that called the collectives last
// most of the time (each record names the last caller: trace/stragglers.hpp).
//
// Times are each rank's own: "made 3.0 s before its dump" compares the
// call's queued time with the dump's, both read on that rank's steady clock,
// so ranks on different hosts need no common clock.
#pragma once

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dump_reader.hpp"

namespace dcomm_trace {

// "rank 2" or "ranks 0, 1, 3".
inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// "all_reduce #57"
inline std::string call_text(const op_entry& o) {
  return o.name + " #" + std::to_string(o.seq);
}

// What must agree between ranks: the op, and what it was given.
inline std::string signature(const op_entry& o) {
  std::string s = o.name;
  if (o.name != "barrier" && !o.name.ends_with("_object"))
    s += " " + o.dtype + " x " + std::to_string(o.count);
  if (o.peer >= 0) s += ", root " + std::to_string(o.peer);
  return s;
}

inline bool same_call(const op_entry& a, const op_entry& b) {
  if (a.name != b.name || a.peer != b.peer) return false;
  if (a.name == "barrier" || a.name.ends_with("_object")) return true;
  // Counts of the *_v ops are each rank's own.
  return a.dtype == b.dtype && (a.name.ends_with("_v") || a.count == b.count);
}

inline std::string seconds_before_dump(const rank_dump& d, std::int64_t ns) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", static_cast<double>(d.dumped_ns - ns) / 1e9);
  return b;
}

// "failed (timed out)", "started", "done"
inline std::string state_text(const op_entry& o) {
  if (o.state == "failed") return "failed (" + o.error + ")";
  return o.state;
}

class analysis {
 public:
  explicit analysis(std::vector<rank_dump> dumps) : dumps_(std::move(dumps)) {
    // A rank dumped twice (its failure's dump, then SIGUSR1's beside it;
    // or two paths given for one rank): the later dump says where it
    // stood, and the report gives each one's reason (the first failure's
    // message located the culprit).
    std::stable_sort(dumps_.begin(), dumps_.end(), [](const rank_dump& a, const rank_dump& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.dumped_ns > b.dumped_ns;
    });
    for (std::size_t i = 1; i < dumps_.size(); ++i)
      if (dumps_[i].rank == dumps_[i - 1].rank)
        earlier_[dumps_[i].rank].insert(earlier_[dumps_[i].rank].begin(),
                                        {dumps_[i].pid, dumps_[i].reason});
    dumps_.erase(
        std::unique(dumps_.begin(), dumps_.end(),
                    [](const rank_dump& a, const rank_dump& b) { return a.rank == b.rank; }),
        dumps_.end());
    for (const auto& d : dumps_) {
      world_ = std::max(world_, d.world_size);
      by_rank_[d.rank] = &d;
      for (const auto& g : d.groups)
        if (!groups_.count(g.id)) groups_[g.id] = g;
      for (const auto& o : d.ops)
        if (o.collective && !groups_.count(o.group))
          groups_[o.group] = {o.group, "group " + hex(o.group), {}};
    }
    for (auto& [id, g] : groups_)
      if (g.ranks.empty())  // not named in any dump: the ranks seen in it
        for (const auto& d : dumps_)
          for (const auto& o : d.ops)
            if (o.group == id && std::find(g.ranks.begin(), g.ranks.end(), d.rank) == g.ranks.end())
              g.ranks.push_back(d.rank);
  }

  analysis(const analysis&) = delete;  // by_rank_ points into dumps_
  analysis& operator=(const analysis&) = delete;

  // The whole report: the dumps, each group's positions, the verdict
  // (calls that differ first, then ranks gone, ranks behind, and
  // point-to-point calls left waiting).
  std::string report() {
    for (auto& f : findings_) f.clear();
    reported_gone_.clear();
    std::string out = "dcomm-trace: " + std::to_string(dumps_.size()) +
                      " dump(s) from a world of " + std::to_string(world_) + "\n";
    for (const auto& d : dumps_) {
      const std::string rank = "  rank " + std::to_string(d.rank) + " (pid ";
      auto earlier = earlier_.find(d.rank);
      if (earlier != earlier_.end())
        for (const auto& [pid, reason] : earlier->second)
          out += rank + std::to_string(pid) + ") dumped on: " + reason + "\n";
      out += rank + std::to_string(d.pid) +
             (earlier != earlier_.end() ? ") dumped again on: " : ") dumped on: ") + d.reason +
             "\n";
    }
    for (int r = 0; r < world_; ++r)
      if (!by_rank_.count(r)) out += "  rank " + std::to_string(r) + ": no dump\n";
    for (const auto& [id, g] : groups_) out += group_section(g);
    out += point_to_point_section();
    find_straggler();
    out += "verdict:\n";
    bool any = false;
    for (const auto& kind : findings_)
      for (const auto& f : kind) {
        out += "  " + f + "\n";
        any = true;
      }
    if (!any)
      out +=
          "  no calls differ and no rank is behind another: the ranks were not stuck in dcomm when "
          "they dumped\n";
    return out;
  }

 private:
  static std::string hex(std::uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
    return b;
  }

  static const op_entry* last_collective(const rank_dump& d, std::uint64_t group) {
    const op_entry* last = nullptr;
    for (const auto& o : d.ops)
      if (o.collective && o.group == group) last = &o;
    return last;
  }

  std::string group_section(const group_entry& g) {
    std::map<int, const op_entry*> last;  // member -> its last call in g (null: none)
    std::vector<int> absent;
    for (int m : g.ranks) {
      auto it = by_rank_.find(m);
      if (it == by_rank_.end())
        absent.push_back(m);
      else
        last[m] = last_collective(*it->second, g.id);
    }
    std::uint64_t front = 0;
    bool any = false;
    for (const auto& [m, o] : last)
      if (o) front = any ? std::max(front, o->seq) : o->seq, any = true;
    if (!any) return {};

    std::string out = g.name + " (" + hex(g.id) + ", " + ranks_text(g.ranks) + "):\n";
    // Ranks at one place (same call, same state) on one line.
    std::map<std::string, std::vector<int>> rows;
    for (const auto& [m, o] : last) {
      const rank_dump& d = *by_rank_.at(m);
      rows[o ? call_text(*o) + ", " + state_text(*o) + ", made " +
                   seconds_before_dump(d, o->queued_ns) + " before the dump"
             : std::string("no call recorded in this group")]
          .push_back(m);
    }
    for (const auto& [where, ranks] : rows) out += "  " + ranks_text(ranks) + ": " + where + "\n";
    if (!absent.empty()) out += "  " + ranks_text(absent) + ": no dump\n";

    find_mismatches(g);
    // Ranks held up at the front: in it and not done (waiting, or failed).
    std::vector<int> held;
    const op_entry* front_call = nullptr;
    for (const auto& [m, o] : last)
      if (o && o->seq == front && o->state != "done") {
        held.push_back(m);
        front_call = o;
      }
    if (held.empty()) return out;
    for (const auto& [m, o] : last) {
      if (o && o->seq >= front) continue;
      const rank_dump& d = *by_rank_.at(m);
      findings_[behind].push_back(
          "rank " + std::to_string(m) + " holds up " + g.name + ": it has not entered " +
          call_text(*front_call) + " (" + ranks_text(held) + " wait in it); " +
          (o ? "its last call there is " + call_text(*o) + ", " + state_text(*o) + ", made " +
                   seconds_before_dump(d, o->queued_ns) + " before its dump"
             : "it made no call in this group"));
    }
    if (!absent.empty()) gone(absent, g, held, *front_call);
    return out;
  }

  // Calls that differ between ranks at one sequence number of g.
  void find_mismatches(const group_entry& g) {
    std::map<std::uint64_t, std::vector<std::pair<int, const op_entry*>>> by_seq;
    for (const auto& d : dumps_)
      for (const auto& o : d.ops)
        if (o.collective && o.group == g.id) by_seq[o.seq].emplace_back(d.rank, &o);
    for (const auto& [seq, calls] : by_seq) {
      bool differs = false;
      for (const auto& [r, o] : calls) differs = differs || !same_call(*o, *calls.front().second);
      if (!differs) continue;
      std::string f =
          "the ranks made different calls at #" + std::to_string(seq) + " of " + g.name + ":";
      for (const auto& [r, o] : calls)
        f += "\n    rank " + std::to_string(r) + ": " + signature(*o) + "; " + state_text(*o);
      findings_[differ].push_back(f);
    }
  }

  // Members without a dump while others wait at the front of g.
  void gone(const std::vector<int>& absent, const group_entry& g, const std::vector<int>& held,
            const op_entry& front_call) {
    std::vector<int> lost;  // the held ranks that lost a peer there
    for (int m : held) {
      const op_entry* o = last_collective(*by_rank_.at(m), g.id);
      if (o && o->state == "failed" && o->error == "peer lost") lost.push_back(m);
    }
    for (int m : absent) {
      if (reported_gone_.count(m)) continue;
      reported_gone_.insert(m);
      findings_[gone_away].push_back(
          lost.empty()
              ? "rank " + std::to_string(m) + " left no dump while " + ranks_text(held) +
                    " waited in " + call_text(front_call) + " of " + g.name +
                    ": it died, hung where SIGUSR1 could not reach it, or ran without "
                    "DCOMM_TRACE_DIR"
              : "rank " + std::to_string(m) + " is gone: it left no dump, and " + ranks_text(lost) +
                    " lost a peer in " + call_text(front_call) + " of " + g.name);
    }
  }

  // A rank that called last in at least 3/4 of the collectives a dump
  // measured (8 at least), 1 ms or more after the first rank on average:
  // from the first dump that measured any (every rank's records agree).
  void find_straggler() {
    for (const auto& d : dumps_) {
      std::map<int, std::pair<std::size_t, std::int64_t>> last;  // rank -> (times, total ns)
      std::size_t measured = 0;
      for (const auto& o : d.ops)
        if (o.collective && o.state == "done" && o.last_caller >= 0) {
          ++measured;
          auto& [times, ns] = last[o.last_caller];
          ++times;
          ns += o.last_caller_after_ns;
        }
      if (measured == 0) continue;
      for (const auto& [rank, figures] : last) {
        const auto [times, ns] = figures;
        const double mean_ms = static_cast<double>(ns) / 1e6 / static_cast<double>(times);
        if (measured < 8 || 4 * times < 3 * measured || mean_ms < 1.0) continue;
        char b[64];
        std::snprintf(b, sizeof b, "%.3f ms", mean_ms);
        findings_[straggler].push_back(
            "rank " + std::to_string(rank) + " is a straggler: it called last in " +
            std::to_string(times) + " of the " + std::to_string(measured) + " collectives rank " +
            std::to_string(d.rank) + " recorded, on average " + b + " after the first rank");
      }
      return;
    }
  }

  // Sends and receives that had not ended when their rank dumped.
  std::string point_to_point_section() {
    std::string out;
    for (const auto& d : dumps_)
      for (const auto& o : d.ops) {
        if (o.collective || !o.pending()) continue;
        const std::string peer = world_rank_text(o.group, o.peer);
        const std::string line = "rank " + std::to_string(d.rank) + " waits in " + o.name +
                                 (o.name == "send" ? " to " : " from ") + peer + " (tag " +
                                 std::to_string(o.seq) + ", " + o.dtype + " x " +
                                 std::to_string(o.count) + "), made " +
                                 seconds_before_dump(d, o.queued_ns) + " before its dump";
        out += "  " + line + "\n";
        findings_[waiting].push_back(line);
      }
    return out.empty() ? out : "point to point:\n" + out;
  }

  // A group rank as its world rank, where the group's members are known.
  std::string world_rank_text(std::uint64_t group, int group_rank) const {
    auto it = groups_.find(group);
    if (it != groups_.end() && group_rank >= 0 &&
        static_cast<std::size_t>(group_rank) < it->second.ranks.size())
      return "rank " + std::to_string(it->second.ranks[static_cast<std::size_t>(group_rank)]);
    return "group rank " + std::to_string(group_rank) + " of " + hex(group);
  }

  std::vector<rank_dump> dumps_;
  // A rank's dumps before the one kept, oldest first: (pid, reason).
  std::map<int, std::vector<std::pair<long, std::string>>> earlier_;
  int world_ = 0;
  std::map<int, const rank_dump*> by_rank_;
  std::map<std::uint64_t, group_entry> groups_;
  enum finding_kind { differ, gone_away, behind, waiting, straggler, kinds };
  std::vector<std::string> findings_[kinds];
  std::set<int> reported_gone_;
};

}  // namespace dcomm_trace
