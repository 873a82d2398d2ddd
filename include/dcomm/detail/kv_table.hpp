// The in-memory key-value table behind hash_store and the tcp_store server:
// the store semantics in one place, plus waiting for keys with a deadline.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/error.hpp"

namespace dcomm::detail {

// Parses the decimal counter `add` keeps at a key.
inline std::int64_t parse_counter(const std::string& key, const std::string& value) {
  std::int64_t n = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  if (ec != std::errc{} || end != value.data() + value.size())
    throw_error(errc::invalid_argument, {.operation = "add",
                                         .key = key,
                                         .expected = "a decimal integer",
                                         .seen = "'" + value.substr(0, 32) + "'"});
  return n;
}

// Thread-safe: hash_store shares one table between the threads of a world.
class kv_table {
 public:
  void set(const std::string& key, std::string value) {
    std::lock_guard lock(mutex_);
    data_[key] = std::move(value);
    wake_satisfied();
  }

  std::optional<std::string> get(const std::string& key) const {
    std::lock_guard lock(mutex_);
    auto it = data_.find(key);
    if (it == data_.end()) return std::nullopt;
    return it->second;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) {
    std::lock_guard lock(mutex_);
    auto it = data_.find(key);
    std::int64_t value = it == data_.end() ? 0 : parse_counter(key, it->second);
    // Wrap like the unsigned arithmetic of every other store implementation.
    value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) +
                                      static_cast<std::uint64_t>(delta));
    data_[key] = std::to_string(value);
    wake_satisfied();
    return value;
  }

  std::string compare_set(const std::string& key, const std::string& expected,
                          std::string desired) {
    std::lock_guard lock(mutex_);
    auto it = data_.find(key);
    if (it == data_.end()) {
      if (!expected.empty()) return expected;  // c10d: missing key, nothing to compare
      it = data_.emplace(key, std::move(desired)).first;
      wake_satisfied();
      return it->second;
    }
    if (it->second == expected) it->second = std::move(desired);
    return it->second;
  }

  bool erase(const std::string& key) {
    std::lock_guard lock(mutex_);
    return data_.erase(key) > 0;
  }

  std::int64_t size() const {
    std::lock_guard lock(mutex_);
    return static_cast<std::int64_t>(data_.size());
  }

  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::lock_guard lock(mutex_);
    return missing_locked(keys);
  }

  // Waits until every key exists; returns the keys still missing at the
  // deadline (empty on success). `wake` must run on the calling coroutine's
  // executor, which must not run handlers concurrently (an io_context run by
  // one thread, or a strand).
  DCOMM_EMIT_ON_USE asio::awaitable<std::vector<std::string>> wait_for(
      std::vector<std::string> keys, detail::clock::time_point deadline);

 private:
  struct waiter {
    std::vector<std::string> keys;
    std::function<void()> wake;
  };

  class waiter_registration {
   public:
    waiter_registration(kv_table& table, std::vector<std::string> keys, std::function<void()> wake)
        : table_(table) {
      std::lock_guard lock(table_.mutex_);
      it_ = table_.waiters_.insert(table_.waiters_.end(), waiter{std::move(keys), std::move(wake)});
      // A set may have landed between the caller's check and now.
      if (table_.missing_locked(it_->keys).empty()) it_->wake();
    }
    waiter_registration(const waiter_registration&) = delete;
    waiter_registration& operator=(const waiter_registration&) = delete;
    ~waiter_registration() {
      std::lock_guard lock(table_.mutex_);
      table_.waiters_.erase(it_);
    }

   private:
    kv_table& table_;
    std::list<waiter>::iterator it_;
  };

  std::vector<std::string> missing_locked(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys)
      if (!data_.contains(k)) out.push_back(k);
    return out;
  }

  void wake_satisfied() {
    for (auto& w : waiters_)
      if (missing_locked(w.keys).empty()) w.wake();
  }

  mutable std::mutex mutex_;
  std::map<std::string, std::string> data_;
  std::list<waiter> waiters_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto kv_table::wait_for(std::vector<std::string> keys,
                                                     detail::clock::time_point deadline)
    -> asio::awaitable<std::vector<std::string>> {
  auto executor = co_await asio::this_coro::executor;
  auto timer = std::make_shared<asio::steady_timer>(executor, deadline);
  {
    std::lock_guard lock(mutex_);
    if (missing_locked(keys).empty()) co_return std::vector<std::string>{};
  }
  // Registered for as long as this coroutine exists, also when its
  // executor is torn down while it waits.
  waiter_registration registration(
      *this, keys, [executor, timer] { asio::post(executor, [timer] { timer->cancel(); }); });
  for (;;) {
    asio::error_code ec;
    co_await timer->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    auto still_missing = missing(keys);
    // Woken by a set (ec == aborted) or at the deadline; a key may have
    // been deleted again in between, so decide on what the table holds now.
    if (still_missing.empty() || detail::clock::now() >= deadline) co_return still_missing;
    timer->expires_at(deadline);
  }
}

}  // namespace dcomm::detail

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::detail::kv_table::wait_for<void>(std::vector<std::string> keys, detail::clock::time_point deadline) -> asio::awaitable<std::vector<std::string>>)
// clang-format on
// End of the separate-compilation block.
