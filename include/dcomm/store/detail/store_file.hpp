// The file under a file_store: opening it, reading and writing at offsets,
// and its locks, with errors that name the path. Writers hold an exclusive,
// readers a shared open-file-description lock (F_OFD_SETLK) on the whole
// file, so two instances exclude each other also within one process. Locks
// are taken with the non-blocking form and retried with short sleeps until
// the caller's deadline.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/error.hpp"
#include "dcomm/store/detail/file_log.hpp"

#if !defined(F_OFD_SETLK)
#error "dcomm::file_store needs open-file-description locks (F_OFD_SETLK, Linux 3.15 or later)"
#endif

namespace dcomm::store_detail {

enum class lock_kind { shared, exclusive };

// An open descriptor of the store file, locked while it lives. The lock
// belongs to the open file description, so it also excludes other
// instances in this process; it is released explicitly, in case a fork
// shares the description with a child.
class locked_file {
 public:
  explicit locked_file(int fd) noexcept : fd_(fd) {}
  locked_file(locked_file&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  locked_file& operator=(locked_file&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  locked_file(const locked_file&) = delete;
  locked_file& operator=(const locked_file&) = delete;
  ~locked_file() { reset(); }

  int fd() const noexcept { return fd_; }

  void reset() noexcept {
    if (fd_ < 0) return;
    struct flock fl {};
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    ::fcntl(fd_, F_OFD_SETLK, &fl);
    ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Sleeps for d, but not past the deadline: the backoff of a retry or a poll.
DCOMM_EMIT_ON_USE asio::awaitable<void> wait_backoff(asio::steady_timer& timer,
                                                     detail::clock::duration d,
                                                     detail::clock::time_point deadline) {
  timer.expires_at(std::min(detail::clock::now() + d, deadline));
  co_await timer.async_wait(asio::use_awaitable);
}

// The store file at one path. Holds no descriptor itself: every operation
// opens the file afresh (try_lock), so that a file removed and created again
// is the one used.
class store_file {
 public:
  explicit store_file(std::string path) : path_(std::move(path)) {}

  const std::string& path() const noexcept { return path_; }
  // As the store names itself in messages.
  std::string address() const { return "file://" + path_; }

  [[noreturn]] void io_error(const char* op, const char* call, int err) const {
    throw error(std::error_code(err, std::generic_category()),
                {.operation = op,
                 .address = address(),
                 .detail = std::string(call) + " failed on " + path_});
  }

  [[noreturn]] void not_a_store_file(const char* op) const {
    throw_error(errc::invalid_argument,
                {.operation = op,
                 .address = address(),
                 .detail = path_ + " exists but is not a dcomm file_store file (its first bytes "
                                   "are not \"dcommFS1\"); pass a new path or remove the file"});
  }

  std::string read_at(int fd, std::uint64_t offset, std::uint64_t size, const char* op) const {
    std::string buf(static_cast<std::size_t>(size), '\0');
    std::size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n =
          ::pread(fd, buf.data() + got, buf.size() - got, static_cast<off_t>(offset + got));
      if (n < 0) {
        if (errno == EINTR) continue;
        io_error(op, "pread", errno);
      }
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    buf.resize(got);
    return buf;
  }

  void write_at(int fd, std::uint64_t offset, std::string_view bytes, const char* op) const {
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n =
          ::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        // Leave no torn record of our own behind if we can help it.
        [[maybe_unused]] int ignored = ::ftruncate(fd, static_cast<off_t>(offset));
        io_error(op, "pwrite", err);
      }
      done += static_cast<std::size_t>(n);
    }
  }

  // Checks once, without the lock, that the path can be opened and does
  // not hold something else.
  void probe() const {
    constexpr const char* op = "file_store.create";
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
      const int err = errno;
      throw_error(errc::invalid_argument, {.operation = op,
                                           .address = address(),
                                           .detail = "cannot open or create " + path_ + ": " +
                                                     std::generic_category().message(err)});
    }
    std::string head;
    try {
      head = read_at(fd, 0, file_log::magic.size(), op);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    if (!file_log::magic.starts_with(head)) not_a_store_file(op);
  }

  // The file, locked: retried with backoff until the deadline, then
  // errc::timeout naming `keys` (the operation's).
  DCOMM_EMIT_ON_USE asio::awaitable<locked_file> acquire(lock_kind kind,
                                                         detail::clock::time_point deadline,
                                                         const char* op, std::string keys) const;

  // For the constructor and the destructor, which cannot suspend.
  locked_file acquire_blocking(lock_kind kind, detail::clock::time_point deadline,
                               const char* op) const {
    auto backoff = lock_backoff_start;
    for (;;) {
      if (auto file = try_lock(kind, op)) return std::move(*file);
      const auto now = detail::clock::now();
      if (now >= deadline) lock_timeout(kind, op, {});
      std::this_thread::sleep_for(std::min<detail::clock::duration>(backoff, deadline - now));
      backoff = std::min<detail::clock::duration>(backoff * 2, lock_backoff_cap);
    }
  }

 private:
  int open_file(const char* op) const {
    for (;;) {
      int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
      if (fd >= 0) return fd;
      if (errno != EINTR) io_error(op, "open", errno);
    }
  }

  // One attempt: opens the file and tries to lock it. nullopt when someone
  // else holds a conflicting lock.
  std::optional<locked_file> try_lock(lock_kind kind, const char* op) const {
    // The last instance of a job removes the file: if the path no longer
    // names the file we locked, start over on the one it names now.
    for (int attempt = 0; attempt < 16; ++attempt) {
      locked_file file(open_file(op));
      struct flock fl {};
      fl.l_type = kind == lock_kind::exclusive ? F_WRLCK : F_RDLCK;
      fl.l_whence = SEEK_SET;
      fl.l_start = 0;
      fl.l_len = 0;  // the whole file, however long it grows
      fl.l_pid = 0;
      if (::fcntl(file.fd(), F_OFD_SETLK, &fl) != 0) {
        if (errno == EAGAIN || errno == EACCES || errno == EINTR) return std::nullopt;
        io_error(op, "fcntl(F_OFD_SETLK)", errno);
      }
      struct stat locked {};
      struct stat named {};
      if (::fstat(file.fd(), &locked) != 0) io_error(op, "fstat", errno);
      if (::stat(path_.c_str(), &named) == 0) {
        if (named.st_dev == locked.st_dev && named.st_ino == locked.st_ino) return file;
      } else if (errno != ENOENT) {
        io_error(op, "stat", errno);
      }
    }
    return std::nullopt;
  }

  [[noreturn]] void lock_timeout(lock_kind kind, const char* op, std::string keys) const {
    throw_error(
        errc::timeout,
        {.operation = op,
         .key = std::move(keys),
         .address = address(),
         .detail = std::string("could not take the ") +
                   (kind == lock_kind::exclusive ? "exclusive" : "shared") + " lock on " + path_ +
                   " before the deadline; another process holds it (stopped or hung?)"});
  }

  // Retrying a lock someone else holds (held for microseconds, normally).
  static constexpr detail::clock::duration lock_backoff_start = std::chrono::microseconds(50);
  static constexpr detail::clock::duration lock_backoff_cap = std::chrono::milliseconds(5);

  std::string path_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto store_file::acquire(lock_kind kind,
                                                      detail::clock::time_point deadline,
                                                      const char* op, std::string keys) const
    -> asio::awaitable<locked_file> {
  auto backoff = lock_backoff_start;
  std::optional<asio::steady_timer> timer;
  for (;;) {
    if (auto file = try_lock(kind, op)) co_return std::move(*file);
    const auto now = detail::clock::now();
    if (now >= deadline) lock_timeout(kind, op, std::move(keys));
    if (!timer) timer.emplace(co_await asio::this_coro::executor);
    co_await wait_backoff(*timer, backoff, deadline);
    backoff = std::min<detail::clock::duration>(backoff * 2, lock_backoff_cap);
  }
}

}  // namespace dcomm::store_detail

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::store_detail::wait_backoff<void>(asio::steady_timer& timer, detail::clock::duration d, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::store_detail::store_file::acquire<void>(lock_kind kind, detail::clock::time_point deadline, const char* op, std::string keys) const -> asio::awaitable<locked_file>)
// clang-format on
// End of the separate-compilation block.
