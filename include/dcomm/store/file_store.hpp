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
//
// The format is in store/detail/file_log.hpp, the file's I/O and locks in
// store/detail/store_file.hpp; this file is the store over them: the cached
// table, replaying and appending, and the instances' bookkeeping.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
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
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/error.hpp"
#include "dcomm/store/detail/file_log.hpp"
#include "dcomm/store/detail/store_file.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

class file_store final : public basic_store<file_store> {
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
    s->file_.probe();
    if (num_workers > 0) s->register_instance();
    return s;
  }

  ~file_store() override {
    if (!registered_) return;
    try {
      sign_off();
    } catch (const std::exception& e) {
      detail::log(detail::log_level::warning, std::string("file_store: could not sign off from ") +
                                                  file_.path() + ": " + e.what());
    }
  }

  executor_type get_executor() const override { return executor_; }
  std::string address() const override { return file_.address(); }
  const std::string& path() const noexcept { return file_.path(); }
  int num_workers() const noexcept { return num_workers_; }

  DCOMM_EMIT_ON_USE asio::awaitable<void> do_set(std::string key, std::string value);

  DCOMM_EMIT_ON_USE asio::awaitable<std::string> do_get(std::string key, time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<std::int64_t> do_add(std::string key, std::int64_t delta);

  DCOMM_EMIT_ON_USE asio::awaitable<std::string> do_compare_set(std::string key,
                                                                std::string expected,
                                                                std::string desired);

  DCOMM_EMIT_ON_USE asio::awaitable<void> do_wait(std::vector<std::string> keys,
                                                  time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<bool> do_check(std::vector<std::string> keys);

  DCOMM_EMIT_ON_USE asio::awaitable<bool> do_delete_key(std::string key);

  DCOMM_EMIT_ON_USE asio::awaitable<std::int64_t> do_num_keys();

 private:
  using lock_kind = store_detail::lock_kind;

  // Polling for keys that are not there yet.
  static constexpr detail::clock::duration poll_backoff_start = std::chrono::milliseconds(1);
  static constexpr detail::clock::duration poll_backoff_cap = std::chrono::milliseconds(50);

  file_store(executor_type executor, std::string path, int num_workers, duration timeout)
      : basic_store(timeout),
        executor_(std::move(executor)),
        file_(std::move(path)),
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
    if (key.size() > store_detail::file_log::max_field)
      throw_error(errc::invalid_argument,
                  {.operation = op, .address = address(), .detail = "the key is 4 GiB or longer"});
  }
  void check_value(const std::string& key, const std::string& value, const char* op) const {
    if (value.size() > store_detail::file_log::max_field)
      throw_error(errc::invalid_argument, {.operation = op,
                                           .key = key,
                                           .address = address(),
                                           .detail = "the value is 4 GiB or longer"});
  }

  void reset_cache(std::uint64_t id) {
    data_.clear();
    file_id_ = id;
    offset_ = store_detail::file_log::header_size;
  }

  void apply(const store_detail::file_log::record& r) {
    if (r.type == store_detail::file_log::record_type::set)
      data_.insert_or_assign(std::string(r.key), std::string(r.value));
    else
      data_.erase(std::string(r.key));
  }

  // Brings the cached table up to date with the file; the caller holds the
  // file lock and mutex_. A writer also gives a new file its header and cuts
  // off a torn tail, so that what it appends follows the last good record.
  void replay_locked(int fd, bool writer, const char* op) {
    using namespace store_detail::file_log;
    struct stat st {};
    if (::fstat(fd, &st) != 0) file_.io_error(op, "fstat", errno);
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < header_size) {
      // New, or its creator died before the header was complete.
      if (!magic.starts_with(file_.read_at(fd, 0, std::min<std::uint64_t>(size, magic.size()), op)))
        file_.not_a_store_file(op);
      reset_cache(0);
      if (writer) {
        if (size > 0 && ::ftruncate(fd, 0) != 0) file_.io_error(op, "ftruncate", errno);
        const std::uint64_t id = new_file_id();
        file_.write_at(fd, 0, encode_header(id), op);
        file_id_ = id;
      }
      return;
    }
    const std::string head = file_.read_at(fd, 0, header_size, op);
    if (head.size() < header_size || !head.starts_with(magic)) file_.not_a_store_file(op);
    const std::uint64_t id = get_u64(head.data() + magic.size());
    if (id != file_id_ || size < offset_) reset_cache(id);
    if (size > offset_) {
      const std::string tail = file_.read_at(fd, offset_, size - offset_, op);
      std::string_view rest = tail;
      record r;
      while (const std::size_t n = decode(rest, r)) {
        apply(r);
        rest.remove_prefix(n);
      }
      offset_ += tail.size() - rest.size();
    }
    if (writer && size > offset_ && ::ftruncate(fd, static_cast<off_t>(offset_)) != 0)
      file_.io_error(op, "ftruncate", errno);
  }

  // Appends records after the last good one; the caller holds the exclusive
  // lock and mutex_ and has just replayed.
  void append_locked(int fd, const std::string& records, const char* op) {
    file_.write_at(fd, offset_, records, op);
    std::string_view rest = records;
    store_detail::file_log::record r;
    while (const std::size_t n = store_detail::file_log::decode(rest, r)) {
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
    append_locked(fd, store_detail::file_log::encode_set(key, std::to_string(value)), op);
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
    auto file = file_.acquire_blocking(lock_kind::exclusive, detail::clock::now() + timeout(), op);
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    add_locked(file.fd(), reserved("instances"), 1, op);
    registered_ = true;
  }

  void sign_off() {
    constexpr const char* op = "file_store.~file_store";
    auto file = file_.acquire_blocking(lock_kind::exclusive, detail::clock::now() + timeout(), op);
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    const auto finished = add_locked(file.fd(), reserved("finished"), 1, op);
    const auto instances = add_locked(file.fd(), reserved("instances"), -1, op);
    // Still under the lock: whoever opens the path next gets a new file.
    if (instances <= 0 && finished >= num_workers_ && ::unlink(file_.path().c_str()) != 0 &&
        errno != ENOENT)
      file_.io_error(op, "unlink", errno);
  }

  executor_type executor_;
  store_detail::store_file file_;
  int num_workers_;
  bool registered_ = false;

  // The table as of offset_ in the file with id file_id_ (0: no header yet).
  // Guarded by mutex_, taken (never across a suspension) after the file
  // lock: operations on one instance may run on several threads.
  std::mutex mutex_;
  std::map<std::string, std::string> data_;
  std::uint64_t file_id_ = 0;
  std::uint64_t offset_ = store_detail::file_log::header_size;
};

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_set(std::string key, std::string value)
    -> asio::awaitable<void> {
  constexpr const char* op = "file_store.set";
  check_key(key, op);
  check_value(key, value, op);
  auto file =
      co_await file_.acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
  {
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    append_locked(file.fd(), store_detail::file_log::encode_set(key, value), op);
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_get(std::string key, time_point deadline)
    -> asio::awaitable<std::string> {
  constexpr const char* op = "file_store.get";
  check_key(key, op);
  auto backoff = poll_backoff_start;
  std::optional<asio::steady_timer> timer;
  for (;;) {
    std::optional<std::string> value;
    {
      auto file = co_await file_.acquire(lock_kind::shared, deadline, op, key);
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
    co_await store_detail::wait_backoff(*timer, backoff, deadline);
    backoff = std::min<detail::clock::duration>(backoff * 2, poll_backoff_cap);
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_add(std::string key, std::int64_t delta)
    -> asio::awaitable<std::int64_t> {
  constexpr const char* op = "file_store.add";
  check_key(key, op);
  auto file =
      co_await file_.acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
  std::int64_t value = 0;
  {
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    value = add_locked(file.fd(), key, delta, op);
  }
  co_return value;
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_compare_set(std::string key, std::string expected,
                                                             std::string desired)
    -> asio::awaitable<std::string> {
  constexpr const char* op = "file_store.compare_set";
  check_key(key, op);
  check_value(key, desired, op);
  auto file =
      co_await file_.acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
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
        append_locked(file.fd(), store_detail::file_log::encode_set(key, desired), op);
        result = std::move(desired);
      }
    } else if (it->second == expected && desired != expected) {
      append_locked(file.fd(), store_detail::file_log::encode_set(key, desired), op);
      result = std::move(desired);
    } else {
      result = it->second;
    }
  }
  co_return result;
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_wait(std::vector<std::string> keys,
                                                      time_point deadline)
    -> asio::awaitable<void> {
  constexpr const char* op = "file_store.wait";
  for (const auto& k : keys) check_key(k, op);
  auto backoff = poll_backoff_start;
  std::optional<asio::steady_timer> timer;
  for (;;) {
    std::vector<std::string> missing;
    {
      auto file =
          co_await file_.acquire(lock_kind::shared, deadline, op, store_detail::join_keys(keys));
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
    co_await store_detail::wait_backoff(*timer, backoff, deadline);
    backoff = std::min<detail::clock::duration>(backoff * 2, poll_backoff_cap);
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_check(std::vector<std::string> keys)
    -> asio::awaitable<bool> {
  constexpr const char* op = "file_store.check";
  for (const auto& k : keys) check_key(k, op);
  auto file = co_await file_.acquire(lock_kind::shared, detail::clock::now() + timeout(), op,
                                     store_detail::join_keys(keys));
  bool all = true;
  {
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), false, op);
    for (const auto& k : keys) all = all && data_.contains(k);
  }
  co_return all;
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_delete_key(std::string key)
    -> asio::awaitable<bool> {
  constexpr const char* op = "file_store.delete_key";
  check_key(key, op);
  auto file =
      co_await file_.acquire(lock_kind::exclusive, detail::clock::now() + timeout(), op, key);
  bool existed = false;
  {
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), true, op);
    existed = data_.contains(key);
    if (existed) append_locked(file.fd(), store_detail::file_log::encode_erase(key), op);
  }
  co_return existed;
}

DCOMM_EMIT_ON_USE_DEFINITION auto file_store::do_num_keys() -> asio::awaitable<std::int64_t> {
  constexpr const char* op = "file_store.num_keys";
  auto file = co_await file_.acquire(lock_kind::shared, detail::clock::now() + timeout(), op, {});
  std::int64_t n = 0;
  {
    std::lock_guard lock(mutex_);
    replay_locked(file.fd(), false, op);
    for (const auto& [k, v] : data_)
      if (!is_reserved(k)) ++n;
  }
  co_return n;
}

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::file_store::do_set<void>(std::string key, std::string value) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_get<void>(std::string key, time_point deadline) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_add<void>(std::string key, std::int64_t delta) -> asio::awaitable<std::int64_t>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_compare_set<void>(std::string key, std::string expected, std::string desired) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_wait<void>(std::vector<std::string> keys, time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_check<void>(std::vector<std::string> keys) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_delete_key<void>(std::string key) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::file_store::do_num_keys<void>() -> asio::awaitable<std::int64_t>)
// clang-format on
// End of the separate-compilation block.
