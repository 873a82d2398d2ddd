// Runs dcomm-run (the one meson names in DCOMM_RUN) as a test would: its
// arguments, its environment changed, its stdout and stderr collected, its
// exit status, how long it took. Shared by the launcher's test files.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace dcomm::test::launcher_run {

struct result {
  int status = -1;  // the exit code, or 128 + signal
  std::string out, err;
  double seconds = 0;
};

// This binary (a test program that is also the rank program it starts).
inline std::string self_path() {
  char path[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  REQUIRE(n > 0);
  return std::string(path, static_cast<std::size_t>(n));
}

inline std::string launcher() {
  const char* path = std::getenv("DCOMM_RUN");
  REQUIRE_MESSAGE(path, "DCOMM_RUN is not set (run the tests through meson)");
  return path;
}

struct launch {
  // The launcher's environment, changed: "NAME=value" sets, "NAME" removes.
  std::vector<std::string> env{};
  // Called with the launcher's pid and its stdout so far, after each read,
  // until it returns true: e.g. to send a signal once the ranks are ready.
  std::function<bool(pid_t, const std::string&)> on_output{};
  // Another launcher to run instead (e.g. torchrun).
  std::string program{};
};

// Runs dcomm-run (or how.program) with `args` until it exits and its output
// ends.
inline result run(std::vector<std::string> args, const launch& how = {}) {
  args.insert(args.begin(), how.program.empty() ? launcher() : how.program);
  int out[2], err[2];
  REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    for (const auto& e : how.env) {
      auto eq = e.find('=');
      if (eq == std::string::npos)
        ::unsetenv(e.c_str());
      else
        ::setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(126);
  }
  ::close(out[1]);
  ::close(err[1]);
  result r;
  bool watching = static_cast<bool>(how.on_output);
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open = 2;
  while (open > 0) {
    ::poll(fds, 2, 100);
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      } else {
        (i == 0 ? r.out : r.err).append(buffer, static_cast<std::size_t>(n));
      }
    }
    if (watching && how.on_output(pid, r.out)) watching = false;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

inline bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The values after `key=` on each line, in order.
inline std::vector<std::string> values_of(const std::string& text, const std::string& key) {
  std::vector<std::string> values;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (auto at = line.find(key + "="); at != std::string::npos)
      values.push_back(line.substr(at + key.size() + 1));
  return values;
}

}  // namespace dcomm::test::launcher_run
