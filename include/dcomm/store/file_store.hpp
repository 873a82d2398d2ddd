// A store in one file on a (possibly shared) filesystem, for file:///path
// rendezvous (c10d's FileStore).
//
// The file is an append-only log: a 16-byte header (magic "dcommFS1" and a
// random 64-bit id that changes whenever the file is created anew), then
// records
//   u8 type ('S' set, 'D' delete) | u32 key length | u32 value length |
//   key | value | u32 CRC-32 of everything before it in the record
// (integers little-endian). Each instance caches the table and the offset it
// has replayed up to, and reads only what was appended since; it starts over
// when the file's id changes (removed and created again) or it shrank.
//
// The log ends at the first record that is incomplete or fails its checksum:
// a writer killed mid-append leaves such a torn tail, which readers ignore and
// the next writer cuts off (under the exclusive lock) before appending.
//
// Writers hold an exclusive, readers a shared open-file-description lock
// (F_OFD_SETLK) on the whole file, so two instances exclude each other also
// within one process. Locks are taken with the non-blocking form and retried
// with short sleeps on the caller's executor until the operation's deadline
// (the store's timeout() for operations that do not wait for keys).
//
// With num_workers > 0, every instance registers in the file when created and
// signs off when destroyed; the last of them, once num_workers have signed
// off, removes the file. Internal keys live under "\x01dcomm/", which user
// keys may not use; num_keys() does not count them.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "dcomm/detail/log.hpp"
#include "dcomm/store/store.hpp"

#if !defined(F_OFD_SETLK)
#error "dcomm::file_store needs open-file-description locks (F_OFD_SETLK, Linux 3.15 or later)"
#endif

namespace dcomm {

namespace detail::file_log {

inline constexpr std::string_view magic = "dcommFS1";
inline constexpr std::size_t header_size = 16;  // magic + u64 file id
// type + key length + value length, before the key.
inline constexpr std::size_t record_prefix = 1 + 4 + 4;
inline constexpr std::size_t record_overhead = record_prefix + 4;  // + CRC-32
inline constexpr std::uint64_t max_field = 0xffffffffu;

enum class record_type : unsigned char { set = 'S', erase = 'D' };

inline constexpr std::array<std::uint32_t, 256> crc32_table = [] {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}();

// CRC-32 (IEEE 802.3, as zlib's crc32).
inline std::uint32_t crc32(std::string_view data) noexcept {
  std::uint32_t c = 0xffffffffu;
  for (char ch : data) c = crc32_table[(c ^ static_cast<unsigned char>(ch)) & 0xffu] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

inline void put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xffu);
}
inline void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xffu);
}
inline std::uint32_t get_u32(const char* p) noexcept {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
inline std::uint64_t get_u64(const char* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

inline std::string encode_header(std::uint64_t id) {
  std::string out(magic);
  put_u64(out, id);
  return out;
}

// One record; key and value must each be shorter than 4 GiB.
inline std::string encode(record_type type, std::string_view key, std::string_view value) {
  std::string out;
  out.reserve(record_overhead + key.size() + value.size());
  out += static_cast<char>(type);
  put_u32(out, static_cast<std::uint32_t>(key.size()));
  put_u32(out, static_cast<std::uint32_t>(value.size()));
  out += key;
  out += value;
  put_u32(out, crc32(out));
  return out;
}
inline std::string encode_set(std::string_view key, std::string_view value) {
  return encode(record_type::set, key, value);
}
inline std::string encode_erase(std::string_view key) {
  return encode(record_type::erase, key, {});
}

struct record {
  record_type type = record_type::set;
  std::string_view key;
  std::string_view value;
};

// Decodes the record at the start of `data`. Returns its size, or 0 when it
// is incomplete or corrupt: the log ends there.
inline std::size_t decode(std::string_view data, record& out) noexcept {
  if (data.size() < record_overhead) return 0;
  const auto type = static_cast<unsigned char>(data[0]);
  if (type != static_cast<unsigned char>(record_type::set) &&
      type != static_cast<unsigned char>(record_type::erase))
    return 0;
  const std::uint64_t key_size = get_u32(data.data() + 1);
  const std::uint64_t value_size = get_u32(data.data() + 5);
  const std::uint64_t body = record_prefix + key_size + value_size;
  if (data.size() - 4 < body) return 0;
  if (crc32(data.substr(0, body)) != get_u32(data.data() + body)) return 0;
  if (type == static_cast<unsigned char>(record_type::erase) && value_size != 0) return 0;
  out.type = static_cast<record_type>(type);
  out.key = data.substr(record_prefix, key_size);
  out.value = data.substr(record_prefix + key_size, value_size);
  return body + 4;
}

}  // namespace detail::file_log

class file_store final : public store {
 public:
  // Keys under this prefix belong to file_store itself.
  static constexpr std::string_view reserved_prefix =
      "\x01"
      "dcomm/";

  // Opens (creating it if needed) the store file at `path`. With
  // num_workers > 0, the file is removed when num_workers instances have
  // been destroyed and no instance is left; otherwise it is never removed.
  // Throws errc::invalid_argument if the file cannot be opened or created,
  // or is not a file_store file. With num_workers > 0, registering may wait
  // for the file lock (at most `timeout`) on the calling thread.
  static std::shared_ptr<file_store> create(executor_type executor, std::string path,
                                            int num_workers = -1,
                                            duration timeout = default_timeout) {
    if (path.empty())
      throw_error(errc::invalid_argument,
                  {.operation = "file_store.create", .detail = "the file path is empty"});
    std::shared_ptr<file_store> s(
        new file_store(std::move(executor), std::move(path), num_workers, timeout));
    s->probe();
    if (num_workers > 0) s->register_instance();
    return s;
  }

  ~file_store() override {
    if (!registered_) return;
    try {
      sign_off();
    } catch (const std::exception& e) {
      detail::log(detail::log_level::warning,
                  std::string("file_store: could not sign off from ") + path_ + ": " + e.what());
    }
  }

  executor_type get_executor() const override { return executor_; }
  std::string address() const override { return "file://" + path_; }
  const std::string& path() const noexcept { return path_; }
  int num_workers() const noexcept { return num_workers_; }

  asio::awaitable<void> set_impl(std::string key, std::string value) override {
    constexpr const char* op = "file_store.set";
    check_key(key, op);
    check_value(key, value, op);
    auto file = co_await acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
    {
      std::lock_guard lock(mutex_);
      replay_locked(file.fd(), true, op);
      append_locked(file.fd(), detail::file_log::encode_set(key, value), op);
    }
  }

  asio::awaitable<std::string> get_impl(std::string key, detail::clock::time_point deadline) override {
    constexpr const char* op = "file_store.get";
    check_key(key, op);
    auto backoff = poll_backoff_start;
    std::optional<asio::steady_timer> timer;
    for (;;) {
      std::optional<std::string> value;
      {
        auto file = co_await acquire(lock_kind::shared, deadline, op, key);
        std::lock_guard lock(mutex_);
        replay_locked(file.fd(), false, op);
        if (auto it = data_.find(key); it != data_.end()) value = it->second;
      }
      if (value) co_return std::move(*value);
      const auto now = detail::clock::now();
      if (now >= deadline)
        throw_error(errc::timeout, {.operation = op,
                                    .key = key,
                                    .address = address(),
                                    .detail = "key still missing at the deadline"});
      if (!timer) timer.emplace(co_await asio::this_coro::executor);
      co_await sleep(*timer, backoff, deadline);
      backoff = std::min<detail::clock::duration>(backoff * 2, poll_backoff_cap);
    }
  }

  asio::awaitable<std::int64_t> add_impl(std::string key, std::int64_t delta) override {
    constexpr const char* op = "file_store.add";
    check_key(key, op);
    auto file = co_await acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
    std::int64_t value = 0;
    {
      std::lock_guard lock(mutex_);
      replay_locked(file.fd(), true, op);
      value = add_locked(file.fd(), key, delta, op);
    }
    co_return value;
  }

  asio::awaitable<std::string> compare_set_impl(std::string key, std::string expected,
                                                std::string desired) override {
    constexpr const char* op = "file_store.compare_set";
    check_key(key, op);
    check_value(key, desired, op);
    auto file = co_await acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
    std::string result;
    {
      std::lock_guard lock(mutex_);
      replay_locked(file.fd(), true, op);
      auto it = data_.find(key);
      if (it == data_.end()) {
        // As c10d: a missing key has nothing to compare with unless the
        // caller expects it to be missing.
        if (!expected.empty()) {
          result = std::move(expected);
        } else {
          append_locked(file.fd(), detail::file_log::encode_set(key, desired), op);
          result = std::move(desired);
        }
      } else if (it->second == expected && desired != expected) {
        append_locked(file.fd(), detail::file_log::encode_set(key, desired), op);
        result = std::move(desired);
      } else {
        result = it->second;
      }
    }
    co_return result;
  }

  asio::awaitable<void> wait_impl(std::vector<std::string> keys,
                                  detail::clock::time_point deadline) override {
    constexpr const char* op = "file_store.wait";
    for (const auto& k : keys) check_key(k, op);
    auto backoff = poll_backoff_start;
    std::optional<asio::steady_timer> timer;
    for (;;) {
      std::vector<std::string> missing;
      {
        auto file = co_await acquire(lock_kind::shared, deadline, op, store_detail::join_keys(keys));
        std::lock_guard lock(mutex_);
        replay_locked(file.fd(), false, op);
        for (const auto& k : keys)
          if (!data_.contains(k)) missing.push_back(k);
      }
      if (missing.empty()) co_return;
      const auto now = detail::clock::now();
      if (now >= deadline)
        throw_error(errc::timeout, {.operation = op,
                                    .key = store_detail::join_keys(missing),
                                    .address = address(),
                                    .detail = "keys still missing at the deadline"});
      if (!timer) timer.emplace(co_await asio::this_coro::executor);
      co_await sleep(*timer, backoff, deadline);
      backoff = std::min<detail::clock::duration>(backoff * 2, poll_backoff_cap);
    }
  }

  asio::awaitable<bool> check_impl(std::vector<std::string> keys) override {
    constexpr const char* op = "file_store.check";
    for (const auto& k : keys) check_key(k, op);
    auto file =
        co_await acquire(lock_kind::shared, detail::clock::now() + timeout(), op, store_detail::join_keys(keys));
    bool all = true;
    {
      std::lock_guard lock(mutex_);
      replay_locked(file.fd(), false, op);
      for (const auto& k : keys) all = all && data_.contains(k);
    }
    co_return all;
  }

  asio::awaitable<bool> delete_key_impl(std::string key) override {
    constexpr const char* op = "file_store.delete_key";
    check_key(key, op);
    auto file = co_await acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
    bool existed = false;
    {
      std::lock_guard lock(mutex_);
      replay_locked(file.fd(), true, op);
      existed = data_.contains(key);
      if (existed) append_locked(file.fd(), detail::file_log::encode_erase(key), op);
    }
    co_return existed;
  }

  asio::awaitable<std::int64_t> num_keys_impl() override {
    constexpr const char* op = "file_store.num_keys";
    auto file = co_await acquire(lock_kind::shared, detail::clock::now() + timeout(), op, {});
    std::int64_t n = 0;
    {
      std::lock_guard lock(mutex_);
      replay_locked(file.fd(), false, op);
      for (const auto& [k, v] : data_)
        if (!is_reserved(k)) ++n;
    }
    co_return n;
  }

 private:
  enum class lock_kind { shared, exclusive };

  // Polling for keys that are not there yet.
  static constexpr detail::clock::duration poll_backoff_start = std::chrono::milliseconds(1);
  static constexpr detail::clock::duration poll_backoff_cap = std::chrono::milliseconds(50);
  // Retrying a lock someone else holds (held for microseconds, normally).
  static constexpr detail::clock::duration lock_backoff_start = std::chrono::microseconds(50);
  static constexpr detail::clock::duration lock_backoff_cap = std::chrono::milliseconds(5);

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

  file_store(executor_type executor, std::string path, int num_workers, duration timeout)
      : store(timeout),
        executor_(std::move(executor)),
        path_(std::move(path)),
        num_workers_(num_workers) {}

  static std::string reserved(std::string_view name) {
    return std::string(reserved_prefix) + std::string(name);
  }
  static bool is_reserved(std::string_view key) noexcept {
    return key.starts_with(reserved_prefix);
  }

  void check_key(const std::string& key, const char* op) const {
    if (is_reserved(key))
      throw_error(errc::invalid_argument,
                  {.operation = op,
                   .key = key,
                   .address = address(),
                   .detail = "keys starting with \\x01dcomm/ are reserved for file_store"});
    if (key.size() > detail::file_log::max_field)
      throw_error(errc::invalid_argument,
                  {.operation = op, .address = address(), .detail = "the key is 4 GiB or longer"});
  }
  void check_value(const std::string& key, const std::string& value, const char* op) const {
    if (value.size() > detail::file_log::max_field)
      throw_error(errc::invalid_argument, {.operation = op,
                                           .key = key,
                                           .address = address(),
                                           .detail = "the value is 4 GiB or longer"});
  }

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

  int open_file(const char* op) const {
    for (;;) {
      int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
      if (fd >= 0) return fd;
      if (errno != EINTR) io_error(op, "open", errno);
    }
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
      head = read_at(fd, 0, detail::file_log::magic.size(), op);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    if (!detail::file_log::magic.starts_with(head)) not_a_store_file(op);
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

  asio::awaitable<locked_file> acquire(lock_kind kind, detail::clock::time_point deadline, const char* op,
                                       std::string keys) const {
    auto backoff = lock_backoff_start;
    std::optional<asio::steady_timer> timer;
    for (;;) {
      if (auto file = try_lock(kind, op)) co_return std::move(*file);
      const auto now = detail::clock::now();
      if (now >= deadline) lock_timeout(kind, op, std::move(keys));
      if (!timer) timer.emplace(co_await asio::this_coro::executor);
      co_await sleep(*timer, backoff, deadline);
      backoff = std::min<detail::clock::duration>(backoff * 2, lock_backoff_cap);
    }
  }

  // For the constructor and the destructor, which cannot suspend.
  locked_file acquire_blocking(lock_kind kind, detail::clock::time_point deadline, const char* op) const {
    auto backoff = lock_backoff_start;
    for (;;) {
      if (auto file = try_lock(kind, op)) return std::move(*file);
      const auto now = detail::clock::now();
      if (now >= deadline) lock_timeout(kind, op, {});
      std::this_thread::sleep_for(std::min<detail::clock::duration>(backoff, deadline - now));
      backoff = std::min<detail::clock::duration>(backoff * 2, lock_backoff_cap);
    }
  }

  static asio::awaitable<void> sleep(asio::steady_timer& timer, detail::clock::duration d,
                                     detail::clock::time_point deadline) {
    timer.expires_at(std::min(detail::clock::now() + d, deadline));
    co_await timer.async_wait(asio::use_awaitable);
  }

  void reset_cache(std::uint64_t id) {
    data_.clear();
    file_id_ = id;
    offset_ = detail::file_log::header_size;
  }

  void apply(const detail::file_log::record& r) {
    if (r.type == detail::file_log::record_type::set)
      data_.insert_or_assign(std::string(r.key), std::string(r.value));
    else
      data_.erase(std::string(r.key));
  }

  // Brings the cached table up to date with the file; the caller holds the
  // file lock and mutex_. A writer also gives a new file its header and cuts
  // off a torn tail, so that what it appends follows the last good record.
  void replay_locked(int fd, bool writer, const char* op) {
    using namespace detail::file_log;
    struct stat st {};
    if (::fstat(fd, &st) != 0) io_error(op, "fstat", errno);
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < header_size) {
      // New, or its creator died before the header was complete.
      if (!magic.starts_with(read_at(fd, 0, std::min<std::uint64_t>(size, magic.size()), op)))
        not_a_store_file(op);
      reset_cache(0);
      if (writer) {
        if (size > 0 && ::ftruncate(fd, 0) != 0) io_error(op, "ftruncate", errno);
        const std::uint64_t id = new_file_id();
        write_at(fd, 0, encode_header(id), op);
        file_id_ = id;
      }
      return;
    }
    const std::string head = read_at(fd, 0, header_size, op);
    if (head.size() < header_size || !head.starts_with(magic)) not_a_store_file(op);
    const std::uint64_t id = get_u64(head.data() + magic.size());
    if (id != file_id_ || size < offset_) reset_cache(id);
    if (size > offset_) {
      const std::string tail = read_at(fd, offset_, size - offset_, op);
      std::string_view rest = tail;
      record r;
      while (const std::size_t n = decode(rest, r)) {
        apply(r);
        rest.remove_prefix(n);
      }
      offset_ += tail.size() - rest.size();
    }
    if (writer && size > offset_ && ::ftruncate(fd, static_cast<off_t>(offset_)) != 0)
      io_error(op, "ftruncate", errno);
  }

  // Appends records after the last good one; the caller holds the exclusive
  // lock and mutex_ and has just replayed.
  void append_locked(int fd, const std::string& records, const char* op) {
    write_at(fd, offset_, records, op);
    std::string_view rest = records;
    detail::file_log::record r;
    while (const std::size_t n = detail::file_log::decode(rest, r)) {
      apply(r);
      rest.remove_prefix(n);
    }
    offset_ += records.size();
  }

  std::int64_t counter_locked(const std::string& key, const char* op) const {
    auto it = data_.find(key);
    if (it == data_.end()) return 0;
    std::int64_t n = 0;
    const auto& v = it->second;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    if (ec != std::errc{} || end != v.data() + v.size())
      throw_error(errc::invalid_argument, {.operation = op,
                                           .key = key,
                                           .address = address(),
                                           .expected = "a decimal integer",
                                           .seen = "'" + v.substr(0, 32) + "'"});
    return n;
  }

  std::int64_t add_locked(int fd, const std::string& key, std::int64_t delta, const char* op) {
    // Wraps like the unsigned arithmetic of every other store implementation.
    const auto value = static_cast<std::int64_t>(
        static_cast<std::uint64_t>(counter_locked(key, op)) + static_cast<std::uint64_t>(delta));
    append_locked(fd, detail::file_log::encode_set(key, std::to_string(value)), op);
    return value;
  }

  static std::uint64_t new_file_id() {
    std::random_device rd;
    std::uint64_t id = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
                       static_cast<std::uint64_t>(detail::clock::now().time_since_epoch().count()) ^
                       (static_cast<std::uint64_t>(::getpid()) << 20);
    return id == 0 ? 1 : id;
  }

  void register_instance() {
    constexpr const char* op = "file_store.create";
    auto file = acquire_blocking(lock_kind::exclusive, detail::clock::now() + timeout(), op);
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    add_locked(file.fd(), reserved("instances"), 1, op);
    registered_ = true;
  }

  void sign_off() {
    constexpr const char* op = "file_store.~file_store";
    auto file = acquire_blocking(lock_kind::exclusive, detail::clock::now() + timeout(), op);
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    const auto finished = add_locked(file.fd(), reserved("finished"), 1, op);
    const auto instances = add_locked(file.fd(), reserved("instances"), -1, op);
    // Still under the lock: whoever opens the path next gets a new file.
    if (instances <= 0 && finished >= num_workers_ && ::unlink(path_.c_str()) != 0 &&
        errno != ENOENT)
      io_error(op, "unlink", errno);
  }

  executor_type executor_;
  std::string path_;
  int num_workers_;
  bool registered_ = false;

  // The table as of offset_ in the file with id file_id_ (0: no header yet).
  // Guarded by mutex_, taken (never across a suspension) after the file
  // lock: operations on one instance may run on several threads.
  std::mutex mutex_;
  std::map<std::string, std::string> data_;
  std::uint64_t file_id_ = 0;
  std::uint64_t offset_ = detail::file_log::header_size;
};

}  // namespace dcomm
