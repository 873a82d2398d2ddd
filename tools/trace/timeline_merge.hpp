// Merges the ranks' timelines (DCOMM_TRACE's files, include/dcomm/trace/
// timeline.hpp) into one Chrome trace: one track group per rank (the rank
// is each file's "pid"), times on one clock.
//
// Alignment: ranks that share the first rank's boot id read the same
// steady clock, so their times are kept as they are. A rank booted
// elsewhere is moved by the difference between its and the first rank's
// (wall clock - steady clock), both read when each timeline started: its
// times land on the first rank's steady clock to within how well the two
// hosts' wall clocks agree (NTP: about a millisecond). The merged file
// says which ranks were aligned that way ("otherData").
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcomm_trace {

// Where rank files for DCOMM_TRACE=`base` are: base without ".json", then
// "-rank<r>.json" (as dcomm::trace::timeline::path_for).
inline std::string timeline_stem(std::string base) {
  if (base.ends_with(".json")) base.resize(base.size() - 5);
  return base + "-rank";
}

struct merge_result {
  int ranks = 0;
  std::vector<int> wall_aligned;  // ranks moved through the wall clock
  std::vector<std::string> problems;
};

// Reads `files` (rank timelines) and writes the merged trace to `out`.
// A file that cannot be read is a problem (named), not a failure of the rest.
inline merge_result merge_timelines(const std::vector<std::string>& files, const std::string& out) {
  merge_result r;
  nlohmann::json events = nlohmann::json::array();
  bool have_reference = false;
  std::string reference_boot;
  std::int64_t reference_offset = 0;  // wall - steady, ns, of the first rank read
  for (const auto& path : files) {
    nlohmann::json rank_events;
    try {
      std::ifstream in(path, std::ios::binary);
      if (!in) throw std::runtime_error("cannot be read");
      std::ostringstream text;
      text << in.rdbuf();
      rank_events = nlohmann::json::parse(text.str());
      if (!rank_events.is_array()) throw std::runtime_error("not a JSON array of trace events");
    } catch (const std::exception& e) {
      r.problems.push_back(path + ": " + e.what());
      continue;
    }
    std::string boot;
    std::int64_t offset = 0;
    int rank = -1;
    for (const auto& e : rank_events)
      if (e.value("name", std::string{}) == "dcomm_clock") {
        const auto& a = e.at("args");
        boot = a.value("boot_id", std::string{});
        offset = a.value("realtime_ns", std::int64_t{0}) - a.value("steady_ns", std::int64_t{0});
        rank = e.value("pid", -1);
      }
    if (rank < 0) {
      r.problems.push_back(path + ": no dcomm_clock entry: not a dcomm timeline");
      continue;
    }
    if (!have_reference) {
      have_reference = true;
      reference_boot = boot;
      reference_offset = offset;
    }
    const bool same_clock = !boot.empty() && boot == reference_boot;
    const double shift_us = same_clock ? 0.0 : static_cast<double>(offset - reference_offset) / 1e3;
    if (!same_clock) r.wall_aligned.push_back(rank);
    for (auto& e : rank_events) {
      if (e.contains("ts")) e["ts"] = e["ts"].get<double>() + shift_us;
      events.push_back(std::move(e));
    }
    ++r.ranks;
  }
  nlohmann::json merged = {{"traceEvents", std::move(events)},
                           {"otherData",
                            {{"merged_by", "dcomm-trace"},
                             {"clock", "the first rank's steady clock, microseconds"},
                             {"ranks_aligned_by_wall_clock", r.wall_aligned}}}};
  std::ofstream f(out, std::ios::binary | std::ios::trunc);
  f << merged.dump() << "\n";
  if (!f) r.problems.push_back(out + ": cannot be written");
  return r;
}

}  // namespace dcomm_trace
