// The ranks of a dcomm::spawn (spawn.hpp says what it promises): forked from
// the calling thread, not exec'd, each running a function; waited for, and
// stopped all together when one fails or the job's time is up.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "dcomm/error.hpp"
#include "dcomm/launch/child_group.hpp"
#include "dcomm/launch/child_process.hpp"
#include "dcomm/launch/master_socket.hpp"
#include "dcomm/launch/rank_environment.hpp"

namespace dcomm::launch {

// In a forked rank: runs fn(rank, world_size) or fn(rank), then exits with
// its int result (0 for void). An exception's message goes to message_fd for
// the launcher to report, and the exit status is 1.
template <typename F>
[[noreturn]] void run_forked_rank(F& fn, int rank, int world_size, int message_fd) {
  int code = 1;
  try {
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

// What a rank wrote to its message pipe (at most about 4 KiB), without
// trailing newlines. Read once the rank has exited.
inline std::string read_message(int fd) {
  std::string message;
  char buffer[512];
  for (ssize_t n; message.size() < 4096 && (n = ::read(fd, buffer, sizeof(buffer))) > 0;)
    message.append(buffer, static_cast<std::size_t>(n));
  while (!message.empty() && (message.back() == '\n' || message.back() == '\0')) message.pop_back();
  return message;
}

// One spawn's ranks. The destructor stops and reaps whoever still runs, so
// the forking thread never leaves while a rank it forked is alive (their
// parent-death signal is tied to it), whichever way spawn exits.
class forked_ranks {
 public:
  // Opens the rendezvous socket on master_addr (errc::invalid_argument if it
  // cannot); nothing is forked yet.
  forked_ranks(int world_size, const std::string& master_addr, std::chrono::milliseconds grace)
      : world_size_(world_size),
        master_addr_(master_addr),
        socket_(listen_on_free_port(master_addr)),
        children_(static_cast<std::size_t>(world_size), grace),
        message_fds_(static_cast<std::size_t>(world_size), -1) {}

  forked_ranks(const forked_ranks&) = delete;
  forked_ranks& operator=(const forked_ranks&) = delete;

  ~forked_ranks() {
    children_.stop_and_reap();
    ::close(socket_.fd);
    for (int fd : message_fds_)
      if (fd >= 0) ::close(fd);
  }

  // Forks every rank, each running fn with the job's environment. When
  // pipe() or fork() fails, stops the ranks already started and throws
  // errc::system_error naming the call and errno's text.
  template <typename F>
  void start(F& fn, const std::optional<std::string>& job_token) {
    std::fflush(nullptr);  // or buffered output would be written by every child too
    // The ranks' parent-death signal is tied to this thread, which stays in
    // spawn until every rank is reaped: it only fires if the thread or the
    // process dies.
    const pid_t parent = ::getpid();
    for (int rank = 0; rank < world_size_; ++rank) start_rank(fn, rank, job_token, parent);
  }

  // Waits until every rank has exited, for at most `timeout`. The first
  // failure stops the others and throws errc::rank_failed naming the rank,
  // how it ended and its exception's message; at the timeout every rank is
  // stopped and errc::timeout names those still running.
  void wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      std::optional<int> failed;
      children_.reap_ended([&](std::size_t rank, const child_process& c) {
        if (c.status != 0 && !failed) failed = static_cast<int>(rank);
      });
      if (failed) fail_rank(*failed);
      if (children_.running() == 0) return;
      if (std::chrono::steady_clock::now() >= deadline) fail_timeout();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

 private:
  template <typename F>
  void start_rank(F& fn, int rank, const std::optional<std::string>& job_token, pid_t parent) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) fail_start("pipe", errno, rank);
    const rank_environment environment{.master_addr = master_addr_,
                                       .master_port = socket_.port,
                                       .rank = rank,
                                       .world_size = world_size_,
                                       .local_rank = rank,
                                       .local_world_size = world_size_,
                                       .job_token = job_token,
                                       .listen_fd = socket_.fd};
    const pid_t pid = fork_child(parent, {SIGTERM, SIGINT}, [&] {
      ::close(pipe_fds[0]);
      for (int fd : message_fds_)
        if (fd >= 0) ::close(fd);
      environment.apply();
      run_forked_rank(fn, rank, world_size_, pipe_fds[1]);
    });
    const int err = errno;
    ::close(pipe_fds[1]);
    if (pid < 0) {
      ::close(pipe_fds[0]);
      fail_start("fork", err, rank);
    }
    children_[static_cast<std::size_t>(rank)].pid = pid;
    message_fds_[static_cast<std::size_t>(rank)] = pipe_fds[0];
  }

  [[noreturn]] void fail_start(const char* call, int err, int rank) {
    children_.stop_and_reap();
    std::string detail = std::string(call) + ": " + std::strerror(err) + " (starting rank " +
                         std::to_string(rank) + " of " + std::to_string(world_size_);
    if (rank > 0)
      detail += "; the " + std::to_string(rank) + " rank(s) already started were stopped";
    throw_error(errc::system_error, {.operation = "spawn", .detail = detail + ")"});
  }

  [[noreturn]] void fail_rank(int rank) {
    children_.stop_and_reap();
    const int status = children_[static_cast<std::size_t>(rank)].status;
    std::string message = read_message(message_fds_[static_cast<std::size_t>(rank)]);
    throw_error(
        errc::rank_failed,
        {.operation = "spawn",
         .rank = rank,
         .detail = describe_status(status) +
                   (message.empty() ? std::string() : "; its error: " + message) + "; the other " +
                   std::to_string(world_size_ - 1) + " rank(s) were stopped"});
  }

  [[noreturn]] void fail_timeout() {
    std::vector<int> running;
    for (int rank = 0; rank < world_size_; ++rank)
      if (children_[static_cast<std::size_t>(rank)].running()) running.push_back(rank);
    children_.stop_and_reap();
    throw_error(errc::timeout, {.operation = "spawn",
                                .peers = "ranks " + detail::format_ranks(running),
                                .detail = "still running when the spawn timeout passed; "
                                          "all ranks were killed"});
  }

  int world_size_;
  std::string master_addr_;
  master_socket socket_;
  child_group children_;
  std::vector<int> message_fds_;  // read ends of the ranks' message pipes
};

}  // namespace dcomm::launch
