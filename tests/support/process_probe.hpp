// Helpers for tests of launchers: is a token freshly made, and is a process
// still the one it was (pids are reused).
#pragma once

#include <sys/types.h>

#include <fstream>
#include <sstream>
#include <string>

namespace dcomm::test {

// 32 random bytes, hex-encoded: what dcomm-run and spawn make up.
inline bool is_fresh_token(const std::string& t) {
  return t.size() == 64 && t.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// A process's start time (field 22 of /proc/PID/stat); "" when it is gone or
// a zombie. A pid with the start time seen earlier is the same process.
inline std::string start_time_if_running(pid_t pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(file, stat)) return "";
  auto close_paren = stat.rfind(')');  // the command name may hold anything
  if (close_paren == std::string::npos) return "";
  std::istringstream fields(stat.substr(close_paren + 1));
  std::string state, field;
  fields >> state;  // field 3
  if (state == "Z" || state == "X") return "";
  for (int i = 4; i <= 22; ++i) fields >> field;  // fields 4 to 22, the start time
  return fields ? field : "";
}

}  // namespace dcomm::test
