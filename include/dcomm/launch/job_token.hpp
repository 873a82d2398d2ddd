// The job token a launcher (dcomm::spawn, dcomm-run) gives its ranks in
// DCOMM_JOB_TOKEN: the one already set, or a fresh random one.
#pragma once

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "dcomm/detail/hmac.hpp"
#include "dcomm/error.hpp"

namespace dcomm::launch {

// 32 bytes from the kernel's random generator, hex-encoded (64 characters):
// getrandom(2), or /dev/urandom where that system call fails (a kernel
// without it, a seccomp filter that refuses it).
inline std::string generate_job_token() {
  unsigned char bytes[32];
  std::size_t have = 0;
  int err = 0;
  // Fills bytes[have..] from `read_some`, retrying interrupted calls.
  auto fill = [&](auto read_some) {
    while (have < sizeof(bytes)) {
      ssize_t n = read_some(bytes + have, sizeof(bytes) - have);
      if (n > 0) {
        have += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        err = n < 0 ? errno : EIO;
        return;
      }
    }
  };
  fill([](unsigned char* at, std::size_t size) { return ::getrandom(at, size, 0); });
  if (have < sizeof(bytes)) {
    have = 0;
    int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      err = errno;
    } else {
      fill([fd](unsigned char* at, std::size_t size) { return ::read(fd, at, size); });
      ::close(fd);
    }
  }
  // Never a weaker token, nor silently none: the caller asked for one.
  if (have < sizeof(bytes))
    throw_error(errc::unsupported,
                {.operation = "generate job token",
                 .key = "DCOMM_JOB_TOKEN",
                 .detail = std::string("no random bytes from the system: ") + std::strerror(err)});
  static constexpr char hex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token += hex[b >> 4];
    token += hex[b & 15];
  }
  return token;
}

// The DCOMM_JOB_TOKEN a launcher gives its ranks; std::nullopt: none (the
// variable is removed from their environment). A non-empty token already in
// the environment is passed on as it is (another launcher's, or one shared by
// every node of a multi-node job). Otherwise a fresh one when `may_generate`,
// and only where this build has OpenSSL: without it the ranks would refuse
// the token at start-up, so the job stays unauthenticated as before.
inline std::optional<std::string> job_token_for_ranks(bool auth, bool may_generate) {
  if (!auth) return std::nullopt;
  if (const char* set = std::getenv("DCOMM_JOB_TOKEN"); set && *set) return std::string(set);
  if (!may_generate || !detail::have_crypto()) return std::nullopt;
  return generate_job_token();
}

}  // namespace dcomm::launch
