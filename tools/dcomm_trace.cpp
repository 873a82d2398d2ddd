// dcomm-trace: reads the ranks' flight recorder dumps and says where each
// rank stood and why the job stopped (tools/trace/verdict.hpp).
//
//   dcomm-trace DIR            the dcomm-trace-rank<r>.json files in DIR
//   dcomm-trace FILE...        those dumps
//
// Exit status: 0 when every file was read, 1 when one could not be (the
// others are still analysed) or none was found, 2 for a usage error.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "trace/dump_reader.hpp"
#include "trace/verdict.hpp"

int main(int argc, char** argv) {
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "usage: dcomm-trace DIR | FILE...\n"
          "Merges the flight recorder dumps of a job's ranks (DCOMM_TRACE_DIR's\n"
          "dcomm-trace-rank<r>.json files) and says where each rank stood: calls that\n"
          "differ between ranks, ranks gone, ranks that hold a group up.\n");
      return 0;
    }
    if (a.starts_with("-") && a.size() > 1) {
      std::fprintf(stderr, "dcomm-trace: unknown option %s (see --help)\n", a.c_str());
      return 2;
    }
    if (dcomm_trace::is_directory(a)) {
      auto in = dcomm_trace::dumps_in(a);
      if (in.empty())
        std::fprintf(stderr, "dcomm-trace: no dcomm-trace-rank*.json in %s\n", a.c_str());
      paths.insert(paths.end(), in.begin(), in.end());
    } else {
      paths.push_back(a);
    }
  }
  if (argc < 2) {
    std::fprintf(stderr, "usage: dcomm-trace DIR | FILE... (see --help)\n");
    return 2;
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
