// The ranks' output as dcomm-run forwards it: each stream (stdout or
// stderr) cut into lines, each line prefixed "[rank] " on the terminal and
// written as it is to the rank's log (--tee, --redirects).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <string>

namespace dcomm_run {

// A stream of one rank (stdout or stderr), cut into lines.
struct stream {
  int fd = -1;
  int out = 1;    // where its lines go, with their prefix (-1: nowhere: --redirects)
  int file = -1;  // and as they are (--tee, --redirects; -1: no file)
  std::string partial;

  bool open() const noexcept { return fd >= 0; }
  void close() noexcept {
    if (fd >= 0) ::close(fd);
    if (file >= 0) ::close(file);
    fd = file = -1;
  }
};

// What dcomm-run keeps of a rank's process besides the process: the rank
// for the prefix, and its stdout and stderr (fd -1: not piped, or closed).
struct rank_output {
  int rank = 0;
  stream streams[2];

  bool open() const noexcept { return streams[0].open() || streams[1].open(); }
};

inline void write_all(int fd, const std::string& s) {
  std::size_t at = 0;
  while (at < s.size()) {
    ssize_t n = ::write(fd, s.data() + at, s.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    at += static_cast<std::size_t>(n);
  }
}

// Reads what is there; writes out complete lines, each with its prefix, and
// as they are to the stream's file. Returns false at end of file.
inline bool pump(stream& s, const std::string& prefix) {
  char buffer[65536];
  ssize_t n = ::read(s.fd, buffer, sizeof buffer);
  if (n < 0) return errno == EINTR || errno == EAGAIN;
  if (n == 0) {
    if (!s.partial.empty()) {
      if (s.out >= 0) write_all(s.out, prefix + s.partial + "\n");
      if (s.file >= 0) write_all(s.file, s.partial + "\n");
    }
    s.partial.clear();
    return false;
  }
  s.partial.append(buffer, static_cast<std::size_t>(n));
  std::string lines;
  std::size_t start = 0;
  for (std::size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
    lines += prefix + s.partial.substr(start, nl + 1 - start);
  if (s.file >= 0 && start > 0) write_all(s.file, s.partial.substr(0, start));
  s.partial.erase(0, start);
  if (!lines.empty() && s.out >= 0) write_all(s.out, lines);
  return true;
}

}  // namespace dcomm_run
