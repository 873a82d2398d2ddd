// dcomm-trace: reads the ranks' flight recorder dumps and says where each
// rank stood and why the job stopped (tools/trace/verdict.hpp).
//
//   dcomm-trace DIR            the dcomm-trace-rank<r>.json files in DIR (and
//                              the -later.json ones beside them)
//   dcomm-trace FILE...        those dumps
//   dcomm-trace --merge-timeline PATH
//                              merges the ranks' timelines (DCOMM_TRACE=PATH:
//                              PATH-rank<r>.json, ".json" dropped from PATH)
//                              into PATH (tools/trace/timeline_merge.hpp)
//
// Exit status: 0 when every file was read, 1 when one could not be (the
// others are still used) or none was found, 2 for a usage error
// (dcomm/command_line.hpp reads the command line).
#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <dcomm/command_line.hpp>
#include <string>
#include <vector>

#include "trace/dump_reader.hpp"
#include "trace/timeline_merge.hpp"
#include "trace/verdict.hpp"

namespace {

// The rank timelines for DCOMM_TRACE=`base`, in rank order.
std::vector<std::string> timeline_files(const std::string& base) {
  const std::string stem = dcomm_trace::timeline_stem(base);
  const auto slash = stem.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : stem.substr(0, slash);
  const std::string prefix = slash == std::string::npos ? stem : stem.substr(slash + 1);
  std::vector<std::pair<int, std::string>> found;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (!name.starts_with(prefix) || !name.ends_with(".json")) continue;
      const std::string number = name.substr(prefix.size(), name.size() - prefix.size() - 5);
      if (number.empty() || number.size() > 9 ||
          number.find_first_not_of("0123456789") != std::string::npos)
        continue;
      found.emplace_back(std::stoi(number), dir + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  for (auto& [rank, path] : found) paths.push_back(std::move(path));
  return paths;
}

int merge_timeline(const std::string& base) {
  const auto files = timeline_files(base);
  if (files.empty()) {
    std::fprintf(stderr, "dcomm-trace: no %s<r>.json timelines to merge\n",
                 dcomm_trace::timeline_stem(base).c_str());
    return 1;
  }
  const auto r = dcomm_trace::merge_timelines(files, base);
  for (const auto& p : r.problems) std::fprintf(stderr, "dcomm-trace: %s\n", p.c_str());
  std::printf("dcomm-trace: merged the timelines of %d rank(s) into %s", r.ranks, base.c_str());
  if (!r.wall_aligned.empty())
    std::printf(" (%s aligned by wall clock)", dcomm_trace::ranks_text(r.wall_aligned).c_str());
  std::printf("\n");
  return r.problems.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string timeline;
  std::vector<std::string> inputs;
  dcomm::command_line cl(
      "dcomm-trace",
      "The first merges the flight recorder dumps of a job's ranks (DCOMM_TRACE_DIR's\n"
      "dcomm-trace-rank<r>.json files) and says where each rank stood: calls that\n"
      "differ between ranks, ranks gone, ranks that hold a group up.\n"
      "The second merges the ranks' timelines (DCOMM_TRACE=PATH) into PATH, one\n"
      "Chrome trace (ui.perfetto.dev) with a track per rank, on one clock.");
  cl.synopsis("DIR | FILE...\n       dcomm-trace --merge-timeline PATH");
  cl.option("merge-timeline", timeline, "PATH", "merge PATH-rank<r>.json into PATH");
  cl.arguments("DIR | FILE", inputs, "a folder of dumps, or dump files");
  cl.parse(argc, argv);
  if (!timeline.empty()) {
    if (!inputs.empty()) cl.fail("--merge-timeline takes no dumps");
    return merge_timeline(timeline);
  }
  if (inputs.empty()) cl.fail("missing DIR or FILE...");
  std::vector<std::string> paths;
  for (const auto& a : inputs) {
    if (dcomm_trace::is_directory(a)) {
      auto in = dcomm_trace::dumps_in(a);
      if (in.empty())
        std::fprintf(stderr, "dcomm-trace: no dcomm-trace-rank*.json in %s\n", a.c_str());
      paths.insert(paths.end(), in.begin(), in.end());
    } else {
      paths.push_back(a);
    }
  }
  int status = 0;
  std::vector<dcomm_trace::rank_dump> dumps;
  for (const auto& p : paths) {
    try {
      dumps.push_back(dcomm_trace::read_dump(p));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dcomm-trace: %s\n", e.what());
      status = 1;
    }
  }
  if (dumps.empty()) {
    std::fprintf(stderr, "dcomm-trace: no dump to read\n");
    return 1;
  }
  std::fputs(dcomm_trace::analysis(std::move(dumps)).report().c_str(), stdout);
  return status;
}
