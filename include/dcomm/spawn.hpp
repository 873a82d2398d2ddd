// dcomm::spawn: the PyTorch tutorial's mp.spawn in C++. Forks n ranks on this
// host, each with the env:// variables of a private rendezvous
// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
// runs fn(rank, world_size) in each, and waits for all of them.
//
//   dcomm::spawn(4, [](int rank, int world_size) {
//     auto world = dcomm::rendezvous({.init_method = "env://"});
//     ...
//   });
//
// Rank 0 inherits a socket already listening on a free port
// (DCOMM_MASTER_LISTEN_FD), so concurrent jobs never race for a port. When a
// rank fails (exception, non-zero exit, signal), the others are stopped
// (SIGTERM, then SIGKILL after a grace period) and spawn throws
// errc::rank_failed naming the rank, how it ended and its exception message.
//
// The job is authenticated by default: the ranks share a fresh random
// DCOMM_JOB_TOKEN (unless one is set already, or this build has no OpenSSL),
// so nobody else who reaches rank 0's store or a rank's port gets in. The
// ranks die with the process that spawned them (PR_SET_PDEATHSIG), even when
// it is killed by SIGKILL.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/detail/hmac.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

struct spawn_options {
  // Address the ranks meet at; rank 0 listens there on a port picked for you.
  std::string master_addr = "127.0.0.1";
  // How long the whole job may run before every rank is killed.
  std::chrono::milliseconds timeout = std::chrono::hours(24);
  // Between SIGTERM and SIGKILL when the others are stopped.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // Authenticate the job: the ranks get a fresh random DCOMM_JOB_TOKEN,
  // or the one already set in this process's environment. Nothing is
  // generated where this build has no OpenSSL (a token would be refused).
  // false: the ranks get no token at all, and anyone may join the job.
  bool auth = true;
};

namespace detail {

// A socket listening on addr:0, for rank 0 to adopt.
inline std::pair<int, std::uint16_t> listen_on_free_port(const std::string& addr) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (::inet_pton(AF_INET, addr.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    length = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, addr.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    length = sizeof(sockaddr_in6);
  } else {
    throw_error(errc::invalid_argument, {.operation = "spawn",
                                         .key = "master_addr",
                                         .seen = "'" + addr + "'",
                                         .detail = "must be an IPv4 or IPv6 address"});
  }
  int fd = ::socket(storage.ss_family, SOCK_STREAM, 0);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&storage), length) != 0 ||
      ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0) {
    int err = errno;
    if (fd >= 0) ::close(fd);
    throw_error(errc::invalid_argument,
                {.operation = "spawn",
                 .address = addr,
                 .detail = std::string("cannot listen for the rendezvous: ") + std::strerror(err)});
  }
  auto port = storage.ss_family == AF_INET ? ntohs(v4->sin_port) : ntohs(v6->sin6_port);
  return {fd, port};
}

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
  if (!may_generate || !have_crypto()) return std::nullopt;
  return generate_job_token();
}

// Called in a child right after fork: it is killed when the thread that
// forked it exits (PR_SET_PDEATHSIG; for a launcher that thread lives as long
// as the launcher does), and at once if the parent died before the call (the
// child was then adopted by another process, so getppid() differs).
inline void die_with_parent(pid_t parent) noexcept {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::raise(SIGKILL);
}

struct spawned_rank {
  pid_t pid = -1;
  int message_fd = -1;  // the child's exception message, if any
  bool done = false;
  int status = 0;
};

inline std::string read_message(int fd) {
  std::string message;
  char buffer[512];
  for (ssize_t n; message.size() < 4096 && (n = ::read(fd, buffer, sizeof(buffer))) > 0;)
    message.append(buffer, static_cast<std::size_t>(n));
  while (!message.empty() && (message.back() == '\n' || message.back() == '\0')) message.pop_back();
  return message;
}

inline std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = ::strsignal(WTERMSIG(status));
    return "signal " + std::to_string(WTERMSIG(status)) +
           (name ? std::string(" (") + name + ")" : "");
  }
  return "status " + std::to_string(status);
}

template <typename F>
[[noreturn]] void run_spawned_rank(F& fn, int rank, int world_size, int message_fd) {
  int code = 1;
  try {
    // fn(rank, world_size) or fn(rank); an int result is the exit code.
    auto call = [&] {
      if constexpr (std::is_invocable_v<F&, int, int>)
        return fn(rank, world_size);
      else
        return fn(rank);
    };
    if constexpr (std::is_void_v<decltype(call())>) {
      call();
      code = 0;
    } else {
      code = static_cast<int>(call());
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    [[maybe_unused]] auto ignored = ::write(message_fd, what.data(), what.size());
  } catch (...) {
    std::string what = "unknown exception";
    [[maybe_unused]] auto ignored = ::write(message_fd, what.data(), what.size());
  }
  std::fflush(nullptr);
  // No atexit handlers or static destructors: they belong to the parent.
  std::_Exit(code);
}

}  // namespace detail

// Runs fn(rank, world_size) — or fn(rank) — in n forked processes and waits
// for all of them; see the top of this header.
template <typename F>
requires std::invocable<F&, int, int> || std::invocable<F&, int>
void spawn(int n, F&& fn, const spawn_options& options = {}) {
  if (n < 1)
    throw_error(errc::invalid_argument,
                {.operation = "spawn", .expected = "at least 1 rank", .seen = std::to_string(n)});
  // One token for the whole job, chosen before anything needs cleaning up.
  const std::optional<std::string> token = detail::job_token_for_ranks(options.auth, true);
  // Plain variables, not a structured binding: clang 14 cannot capture one.
  const auto listening = detail::listen_on_free_port(options.master_addr);
  const int listen_fd = listening.first;
  const std::uint16_t port = listening.second;
  std::fflush(nullptr);  // or buffered output would be written by every child too
  std::vector<detail::spawned_rank> ranks(static_cast<std::size_t>(n));

  auto stop_all = [&](int signal) {
    for (auto& r : ranks)
      if (r.pid > 0 && !r.done) ::kill(r.pid, signal);
  };
  auto reap = [&](detail::spawned_rank& r, bool block) {
    if (r.done || r.pid <= 0) return false;
    int status = 0;
    if (::waitpid(r.pid, &status, block ? 0 : WNOHANG) <= 0) return false;
    r.done = true;
    r.status = status;
    return true;
  };
  // Stops and reaps everyone still running: SIGTERM, then SIGKILL.
  auto stop_and_reap = [&] {
    stop_all(SIGTERM);
    auto kill_at = std::chrono::steady_clock::now() + options.grace;
    for (;;) {
      bool all_done = true;
      for (auto& r : ranks) {
        reap(r, false);
        all_done = all_done && (r.done || r.pid <= 0);
      }
      if (all_done) break;
      if (std::chrono::steady_clock::now() >= kill_at) {
        stop_all(SIGKILL);
        for (auto& r : ranks) reap(r, true);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  auto close_all = [&] {
    ::close(listen_fd);
    for (auto& r : ranks)
      if (r.message_fd >= 0) ::close(r.message_fd);
  };

  // The ranks' parent-death signal is tied to this thread, which waits here
  // until every rank is reaped: it only fires if the thread or the process dies.
  const pid_t parent = ::getpid();
  for (int rank = 0; rank < n; ++rank) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
      int err = errno;
      stop_and_reap();
      close_all();
      throw_error(errc::invalid_argument,
                  {.operation = "spawn", .detail = std::string("pipe: ") + std::strerror(err)});
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      detail::die_with_parent(parent);
      // The stop request must stop the rank, whatever the parent's handlers.
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGINT, SIG_DFL);
      ::close(pipe_fds[0]);
      for (auto& r : ranks)
        if (r.message_fd >= 0) ::close(r.message_fd);
      ::setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      if (token)
        ::setenv("DCOMM_JOB_TOKEN", token->c_str(), 1);
      else
        ::unsetenv("DCOMM_JOB_TOKEN");
      if (rank == 0) {
        ::setenv("DCOMM_MASTER_LISTEN_FD", std::to_string(listen_fd).c_str(), 1);
      } else {
        ::unsetenv("DCOMM_MASTER_LISTEN_FD");
        ::close(listen_fd);
      }
      detail::run_spawned_rank(fn, rank, n, pipe_fds[1]);
    }
    ::close(pipe_fds[1]);
    if (pid < 0) {
      int err = errno;
      ::close(pipe_fds[0]);
      stop_and_reap();
      close_all();
      throw_error(errc::invalid_argument,
                  {.operation = "spawn", .detail = std::string("fork: ") + std::strerror(err)});
    }
    ranks[static_cast<std::size_t>(rank)].pid = pid;
    ranks[static_cast<std::size_t>(rank)].message_fd = pipe_fds[0];
  }

  // Wait for all; the first failure stops the rest.
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  int failed = -1;
  for (;;) {
    bool all_done = true;
    for (int rank = 0; rank < n; ++rank) {
      auto& r = ranks[static_cast<std::size_t>(rank)];
      if (reap(r, false) && r.status != 0 && failed < 0) failed = rank;
      all_done = all_done && r.done;
    }
    if (all_done || failed >= 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> running;
      for (int rank = 0; rank < n; ++rank)
        if (!ranks[static_cast<std::size_t>(rank)].done) running.push_back(rank);
      stop_and_reap();
      close_all();
      throw_error(errc::timeout, {.operation = "spawn",
                                  .peers = "ranks " + detail::format_ranks(running),
                                  .detail = "still running when the spawn timeout passed; "
                                            "all ranks were killed"});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (failed < 0) {
    close_all();
    return;
  }
  stop_and_reap();
  auto& r = ranks[static_cast<std::size_t>(failed)];
  std::string message = detail::read_message(r.message_fd);
  close_all();
  throw_error(errc::rank_failed,
              {.operation = "spawn",
               .rank = failed,
               .detail = detail::describe_status(r.status) +
                         (message.empty() ? std::string() : "; its error: " + message) +
                         "; the other " + std::to_string(n - 1) + " rank(s) were stopped"});
}

}  // namespace dcomm
