// Reads the flight recorder's dumps (format "dcomm-flight-recorder/1",
// described in include/dcomm/trace/flight_recorder.hpp) for dcomm-trace.
// JSON is parsed by nlohmann/json; a file that is not a dump, or a dump of
// another format, is refused with the file's name and what is wrong.
#pragma once

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcomm_trace {

struct op_entry {
  std::uint64_t id = 0;
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  std::string name;
  bool collective = true;
  std::string dtype;
  std::uint64_t count = 0;
  int peer = -1;
  std::string algorithm;
  std::string state;  // queued, started, done, failed
  std::int64_t queued_ns = 0, ended_ns = 0;
  std::string error;
  // Who called it last, and how long after the first rank (-1: not known).
  int last_caller = -1;
  std::int64_t last_caller_after_ns = 0;

  bool pending() const { return state == "queued" || state == "started"; }
};

struct group_entry {
  std::uint64_t id = 0;
  std::string name;
  std::vector<int> ranks;  // world ranks, in group rank order
};

struct rank_dump {
  std::string path;
  int rank = 0;
  int world_size = 0;
  long pid = 0;
  std::string reason;
  std::int64_t dumped_ns = 0;
  std::vector<group_entry> groups;
  std::vector<op_entry> ops;  // oldest first
};

inline constexpr const char* dump_format = "dcomm-flight-recorder/1";

// Reads one dump; throws std::runtime_error("PATH: what is wrong").
inline rank_dump read_dump(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    const auto j = nlohmann::json::parse(text.str());
    if (!j.is_object() || j.value("format", std::string{}) != dump_format)
      throw std::runtime_error(std::string("not a flight recorder dump (no \"format\": \"") +
                               dump_format + "\")");
    rank_dump d;
    d.path = path;
    d.rank = j.at("rank").get<int>();
    d.world_size = j.at("world_size").get<int>();
    d.pid = j.value("pid", 0L);
    d.reason = j.value("reason", std::string{});
    d.dumped_ns = j.at("dumped_ns").get<std::int64_t>();
    if (d.world_size < 1 || d.rank < 0 || d.rank >= d.world_size)
      throw std::runtime_error("rank " + std::to_string(d.rank) + " is not in a world of " +
                               std::to_string(d.world_size));
    const auto group_id = [](const nlohmann::json& v) {
      return std::stoull(v.get<std::string>(), nullptr, 16);
    };
    for (const auto& g : j.at("groups"))
      d.groups.push_back({group_id(g.at("id")), g.value("name", std::string{}),
                          g.value("ranks", std::vector<int>{})});
    for (const auto& o : j.at("ops")) {
      op_entry e;
      e.id = o.at("id").get<std::uint64_t>();
      e.group = group_id(o.at("group"));
      e.seq = o.at("seq").get<std::uint64_t>();
      e.name = o.at("op").get<std::string>();
      e.collective = o.value("collective", true);
      e.dtype = o.value("dtype", std::string{});
      e.count = o.value("count", std::uint64_t{0});
      e.peer = o.value("peer", -1);
      e.algorithm = o.value("algorithm", std::string{});
      e.state = o.at("state").get<std::string>();
      e.queued_ns = o.value("queued_ns", std::int64_t{0});
      e.ended_ns = o.value("ended_ns", std::int64_t{0});
      e.error = o.value("error", std::string{});
      e.last_caller = o.value("last_caller", -1);
      e.last_caller_after_ns = o.value("last_caller_after_ns", std::int64_t{0});
      d.ops.push_back(std::move(e));
    }
    return d;
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  } catch (const std::exception& e) {  // nlohmann's errors, std::stoull's
    throw std::runtime_error(path + ": not a readable dump: " + e.what());
  }
}

// The dumps a directory holds: its dcomm-trace-rank<r>.json files (and
// dcomm-trace-rank<r>-later.json, a rank's dump after its failure's).
inline std::vector<std::string> dumps_in(const std::string& dir) {
  std::vector<std::string> paths;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.starts_with("dcomm-trace-rank") && name.ends_with(".json"))
        paths.push_back(dir + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

inline bool is_directory(const std::string& path) {
  struct stat s {};
  return ::stat(path.c_str(), &s) == 0 && S_ISDIR(s.st_mode);
}

}  // namespace dcomm_trace
