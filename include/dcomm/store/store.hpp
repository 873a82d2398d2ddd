// The store contract: a small key-value service every rank of a job can reach,
// used for rendezvous and to exchange connection details (c10d's Store).
//
// Keys are strings; values are binary-safe std::strings. Every operation is
// an initiating function (see completion.hpp): co_await it, pass a callback,
// asio::use_future, or dcomm::blocking. Every wait has a deadline: the store's
// timeout unless the call gives one, and a timeout names the keys still missing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

class store : public std::enable_shared_from_this<store> {
 public:
  using executor_type = asio::any_io_executor;
  using duration = std::chrono::milliseconds;
  // The clock of the deadlines an implementation's get_impl and wait_impl
  // are given: the steady clock, on which every deadline in dcomm is
  // measured.
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;
  static_assert(std::is_same_v<clock, detail::clock>);

  static constexpr duration default_timeout = std::chrono::minutes(5);

  store(const store&) = delete;
  store& operator=(const store&) = delete;
  virtual ~store() = default;

  virtual executor_type get_executor() const = 0;
  // For messages: "tcp://host:port", "file:///path", "hash_store".
  virtual std::string address() const = 0;

  duration timeout() const noexcept { return timeout_; }
  void set_timeout(duration t) noexcept { timeout_ = t; }

  // Sets key to value, waking everyone waiting for it.
  template <completion_token_for Token = default_token_t>
  auto set(std::string key, std::string value, Token&& token = {}) {
    return run(set_impl(std::move(key), std::move(value)), std::forward<Token>(token), "set");
  }

  // The value of key, waiting until it exists (at most `timeout`).
  template <completion_token_for<std::string> Token = default_token_t>
  auto get(std::string key, Token&& token = {}) {
    return get(std::move(key), timeout_, std::forward<Token>(token));
  }
  template <completion_token_for<std::string> Token = default_token_t>
  auto get(std::string key, duration timeout, Token&& token = {}) {
    return run(get_impl(std::move(key), detail::clock::now() + timeout), std::forward<Token>(token),
               "get", timeout);
  }

  // Atomically adds delta to the integer stored at key (0 if missing) and
  // returns the new value. Values are decimal text, as in c10d.
  template <completion_token_for<std::int64_t> Token = default_token_t>
  auto add(std::string key, std::int64_t delta, Token&& token = {}) {
    return run(add_impl(std::move(key), delta), std::forward<Token>(token), "add");
  }

  // If key holds `expected` (or is missing and `expected` is empty), sets it
  // to `desired`. Returns the value the key holds afterwards.
  template <completion_token_for<std::string> Token = default_token_t>
  auto compare_set(std::string key, std::string expected, std::string desired, Token&& token = {}) {
    return run(compare_set_impl(std::move(key), std::move(expected), std::move(desired)),
               std::forward<Token>(token), "compare_set");
  }

  // Waits until every key exists.
  template <completion_token_for Token = default_token_t>
  auto wait(std::vector<std::string> keys, Token&& token = {}) {
    return wait(std::move(keys), timeout_, std::forward<Token>(token));
  }
  template <completion_token_for Token = default_token_t>
  auto wait(std::vector<std::string> keys, duration timeout, Token&& token = {}) {
    return run(wait_impl(std::move(keys), detail::clock::now() + timeout),
               std::forward<Token>(token), "wait", timeout);
  }

  // Whether every key exists, without waiting.
  template <completion_token_for<bool> Token = default_token_t>
  auto check(std::vector<std::string> keys, Token&& token = {}) {
    return run(check_impl(std::move(keys)), std::forward<Token>(token), "check");
  }

  // Removes key; returns whether it existed.
  template <completion_token_for<bool> Token = default_token_t>
  auto delete_key(std::string key, Token&& token = {}) {
    return run(delete_key_impl(std::move(key)), std::forward<Token>(token), "delete_key");
  }

  template <completion_token_for<std::int64_t> Token = default_token_t>
  auto num_keys(Token&& token = {}) {
    return run(num_keys_impl(), std::forward<Token>(token), "num_keys");
  }

  // The coroutines behind the operations. They run on the store's executor
  // (tcp_store's state lives on its strand), so only the initiating functions
  // above, and decorators running on the same executor, may call them.
  friend class prefix_store;

 protected:
  virtual asio::awaitable<void> set_impl(std::string key, std::string value) = 0;
  virtual asio::awaitable<std::string> get_impl(std::string key, time_point deadline) = 0;
  virtual asio::awaitable<std::int64_t> add_impl(std::string key, std::int64_t delta) = 0;
  virtual asio::awaitable<std::string> compare_set_impl(std::string key, std::string expected,
                                                        std::string desired) = 0;
  virtual asio::awaitable<void> wait_impl(std::vector<std::string> keys, time_point deadline) = 0;
  virtual asio::awaitable<bool> check_impl(std::vector<std::string> keys) = 0;
  virtual asio::awaitable<bool> delete_key_impl(std::string key) = 0;
  virtual asio::awaitable<std::int64_t> num_keys_impl() = 0;

  explicit store(duration timeout = default_timeout) : timeout_(timeout) {}

 private:
  template <typename T, typename Token>
  auto run(asio::awaitable<T> op, Token&& token, const char* operation,
           duration timeout = duration::zero()) {
    if constexpr (std::is_same_v<std::decay_t<Token>, default_token_t>)
      return awaited(std::move(op), operation, timeout);
    else
      return initiate(std::move(op), std::forward<Token>(token), operation, timeout);
  }
  template <typename T, typename Token>
  auto initiate(asio::awaitable<T> op, Token&& token, const char* operation, duration timeout) {
    // Keep the store alive until the operation completes, whoever drops it.
    auto self = shared_from_this();
    return detail::initiate(get_executor(), keep_alive(std::move(self), std::move(op)),
                            std::forward<Token>(token), operation,
                            std::max(timeout, timeout_) + detail::blocking_grace);
  }
  // The co_awaited form, the one dcomm's own coroutines use: a return type
  // of its own, so that the separate-compilation mode compiles it once.
  template <typename T>
  asio::awaitable<T> awaited(asio::awaitable<T> op, const char* operation, duration timeout);

  template <typename T>
  static asio::awaitable<T> keep_alive(std::shared_ptr<store> self, asio::awaitable<T> op);

  duration timeout_;
};

// Out of the class, so that separate compilation's declarations below keep
// it out of a user's translation unit (detail/asio.hpp).
template <typename T>
asio::awaitable<T> store::keep_alive(std::shared_ptr<store> self, asio::awaitable<T> op) {
  (void)self;
  co_return co_await std::move(op);
}
template <typename T>
asio::awaitable<T> store::awaited(asio::awaitable<T> op, const char* operation, duration timeout) {
  return initiate(std::move(op), asio::use_awaitable, operation, timeout);
}
// clang-format off
DCOMM_INSTANTIATE(asio::awaitable<void> store::awaited<void>(asio::awaitable<void>, const char*, duration))
DCOMM_INSTANTIATE(asio::awaitable<std::string> store::awaited<std::string>(asio::awaitable<std::string>, const char*, duration))
DCOMM_INSTANTIATE(asio::awaitable<std::int64_t> store::awaited<std::int64_t>(asio::awaitable<std::int64_t>, const char*, duration))
DCOMM_INSTANTIATE(asio::awaitable<bool> store::awaited<bool>(asio::awaitable<bool>, const char*, duration))
DCOMM_INSTANTIATE(asio::awaitable<void> store::keep_alive<void>(std::shared_ptr<store>, asio::awaitable<void>))
DCOMM_INSTANTIATE(asio::awaitable<std::string> store::keep_alive<std::string>(std::shared_ptr<store>, asio::awaitable<std::string>))
DCOMM_INSTANTIATE(asio::awaitable<std::int64_t> store::keep_alive<std::int64_t>(std::shared_ptr<store>, asio::awaitable<std::int64_t>))
DCOMM_INSTANTIATE(asio::awaitable<bool> store::keep_alive<bool>(std::shared_ptr<store>, asio::awaitable<bool>))
// clang-format on

// A store whose operations are Derived's coroutines do_set, do_get, do_add,
// do_compare_set, do_wait, do_check, do_delete_key and do_num_keys (the
// *_impl contract above), each declared DCOMM_EMIT_ON_USE: g++ 12 emits
// an inline coroutine that is not a template into every translation unit
// that sees it, used or not, a virtual one too (detail/asio.hpp). These
// overrides are plain calls of Derived's templates, so a store's
// coroutines are compiled only where the store is made. dcomm's stores
// derive from it; a user's store may (docs/stores.md).
template <class Derived>
class basic_store : public store {
 protected:
  using store::store;

  asio::awaitable<void> set_impl(std::string key, std::string value) override {
    return self().do_set(std::move(key), std::move(value));
  }
  asio::awaitable<std::string> get_impl(std::string key, time_point deadline) override {
    return self().do_get(std::move(key), deadline);
  }
  asio::awaitable<std::int64_t> add_impl(std::string key, std::int64_t delta) override {
    return self().do_add(std::move(key), delta);
  }
  asio::awaitable<std::string> compare_set_impl(std::string key, std::string expected,
                                                std::string desired) override {
    return self().do_compare_set(std::move(key), std::move(expected), std::move(desired));
  }
  asio::awaitable<void> wait_impl(std::vector<std::string> keys, time_point deadline) override {
    return self().do_wait(std::move(keys), deadline);
  }
  asio::awaitable<bool> check_impl(std::vector<std::string> keys) override {
    return self().do_check(std::move(keys));
  }
  asio::awaitable<bool> delete_key_impl(std::string key) override {
    return self().do_delete_key(std::move(key));
  }
  asio::awaitable<std::int64_t> num_keys_impl() override { return self().do_num_keys(); }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

namespace store_detail {
// Comma-separated key list for messages.
inline std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    if (!out.empty()) out += ", ";
    out += k;
  }
  return out;
}
}  // namespace store_detail

}  // namespace dcomm
