// dcomm-trace, run by dcomm-run from its own folder (installed, or built,
// beside it) over the ranks' dumps and timelines.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

namespace dcomm_run {

// A program installed (or built) in dcomm-run's own folder.
inline std::string beside_this_program(const std::string& name) {
  char path[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  std::string self(path, n > 0 ? static_cast<std::size_t>(n) : 0);
  const auto slash = self.rfind('/');
  return slash == std::string::npos ? name : self.substr(0, slash + 1) + name;
}

inline bool have_trace_tool() {
  return ::access(beside_this_program("dcomm-trace").c_str(), X_OK) == 0;
}

// Runs dcomm-trace with `args`, its output to stderr, and waits for it.
inline void run_trace_tool(std::vector<std::string> args) {
  const std::string tool = beside_this_program("dcomm-trace");
  args.insert(args.begin(), tool);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(2, 1);
    ::execv(tool.c_str(), argv.data());
    ::_exit(127);
  }
  if (pid > 0) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

}  // namespace dcomm_run
