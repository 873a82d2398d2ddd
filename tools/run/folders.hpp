// The folders and files dcomm-run prepares before it starts the ranks:
// --log-dir (for --tee/--redirects), --trace-dir and --timeline.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "options.hpp"

namespace dcomm_run {

// --trace-dir: made if missing, this node's ranks' old dumps removed (so
// the verdict reads this job's; a rank's later dump too: see
// trace/flight_recorder.hpp), and named to the ranks.
bool prepare_trace_dir(const options& o) {
  if (o.trace_dir.empty()) return true;
  if (::mkdir(o.trace_dir.c_str(), 0777) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "dcomm-run: cannot make --trace-dir %s: %s\n", o.trace_dir.c_str(),
                 std::strerror(errno));
    return false;
  }
  for (int local = 0; local < o.nproc; ++local)
    for (const char* end : {".json", "-later.json"})
      std::remove(
          (o.trace_dir + "/dcomm-trace-rank" + std::to_string(o.node_rank * o.nproc + local) + end)
              .c_str());
  ::setenv("DCOMM_TRACE_DIR", o.trace_dir.c_str(), 1);
  return true;
}

// --timeline: this node's ranks' old timelines removed (the merge reads
// this job's), and the path named to the ranks.
void prepare_timeline(const options& o) {
  if (o.timeline.empty()) return;
  std::string stem = o.timeline;
  if (stem.ends_with(".json")) stem.resize(stem.size() - 5);
  for (int local = 0; local < o.nproc; ++local)
    std::remove((stem + "-rank" + std::to_string(o.node_rank * o.nproc + local) + ".json").c_str());
  ::setenv("DCOMM_TRACE", o.timeline.c_str(), 1);
}

// --tee or --redirects without --log-dir: a fresh folder, named.
bool prepare_log_dir(options& o) {
  if (!o.tee && !o.redirects) return true;
  if (o.log_dir.empty()) {
    char name[] = "/tmp/dcomm-run-XXXXXX";
    if (!::mkdtemp(name)) {
      std::perror("dcomm-run: mkdtemp");
      return false;
    }
    o.log_dir = name;
  } else if (::mkdir(o.log_dir.c_str(), 0777) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "dcomm-run: cannot make --log-dir %s: %s\n", o.log_dir.c_str(),
                 std::strerror(errno));
    return false;
  }
  std::fprintf(stderr, "dcomm-run: the ranks' output goes to %s/<rank>/stdout.log and stderr.log\n",
               o.log_dir.c_str());
  return true;
}

}  // namespace dcomm_run
