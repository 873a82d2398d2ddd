// An in-process store: the ranks of a thread world share one table
// (c10d's HashStore). Each rank gets its own handle bound to its executor.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/detail/kv_table.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

class hash_store final : public basic_store<hash_store> {
 public:
  // The memory that the handles of one thread world share: make one, and
  // give it to every rank's create(). Thread-safe; what it holds is reached
  // through the handles. (dcomm/thread_world.hpp does this for you.)
  //   auto shared = std::make_shared<dcomm::hash_store::table>();
  //   auto mine = dcomm::hash_store::create(my_executor, shared);
  class table {
   public:
    table() = default;
    table(const table&) = delete;
    table& operator=(const table&) = delete;

   private:
    friend class hash_store;
    detail::kv_table data_;
  };

  // A store with a table of its own. `executor` must not run handlers
  // concurrently (an io_context run by one thread, or a strand).
  static std::shared_ptr<hash_store> create(executor_type executor,
                                            duration timeout = default_timeout) {
    return create(std::move(executor), std::make_shared<table>(), timeout);
  }
  // A handle on a table shared with other handles (one per rank thread).
  static std::shared_ptr<hash_store> create(executor_type executor, std::shared_ptr<table> shared,
                                            duration timeout = default_timeout) {
    return std::shared_ptr<hash_store>(
        new hash_store(std::move(executor), std::move(shared), timeout));
  }

  // Another handle on the same table, bound to another executor.
  std::shared_ptr<hash_store> share(executor_type executor) const {
    return create(std::move(executor), table_, timeout());
  }

  executor_type get_executor() const override { return executor_; }
  std::string address() const override { return "hash_store"; }

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
  hash_store(executor_type executor, std::shared_ptr<table> shared, duration timeout)
      : basic_store(timeout), executor_(std::move(executor)), table_(std::move(shared)) {}

  detail::kv_table& data() const { return table_->data_; }

  executor_type executor_;
  std::shared_ptr<table> table_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_set(std::string key, std::string value)
    -> asio::awaitable<void> {
  data().set(key, std::move(value));
  co_return;
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_get(std::string key, time_point deadline)
    -> asio::awaitable<std::string> {
  // Named, not a braced temporary: g++ 12 miscompiles initializer lists
  // inside co_await expressions ("array used as initializer").
  std::vector<std::string> keys(1, key);
  for (;;) {
    co_await do_wait(keys, deadline);
    if (auto value = data().get(key)) co_return std::move(*value);
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_add(std::string key, std::int64_t delta)
    -> asio::awaitable<std::int64_t> {
  co_return data().add(key, delta);
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_compare_set(std::string key, std::string expected,
                                                             std::string desired)
    -> asio::awaitable<std::string> {
  co_return data().compare_set(key, expected, std::move(desired));
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_wait(std::vector<std::string> keys,
                                                      time_point deadline)
    -> asio::awaitable<void> {
  auto missing = co_await data().wait_for(keys, deadline);
  if (!missing.empty())
    throw_error(errc::timeout, {.operation = "hash_store.wait",
                                .key = store_detail::join_keys(missing),
                                .detail = "keys still missing at the deadline"});
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_check(std::vector<std::string> keys)
    -> asio::awaitable<bool> {
  co_return data().missing(keys).empty();
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_delete_key(std::string key)
    -> asio::awaitable<bool> {
  co_return data().erase(key);
}

DCOMM_EMIT_ON_USE_DEFINITION auto hash_store::do_num_keys() -> asio::awaitable<std::int64_t> {
  co_return data().size();
}

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_set<void>(std::string key, std::string value) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_get<void>(std::string key, time_point deadline) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_add<void>(std::string key, std::int64_t delta) -> asio::awaitable<std::int64_t>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_compare_set<void>(std::string key, std::string expected, std::string desired) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_wait<void>(std::vector<std::string> keys, time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_check<void>(std::vector<std::string> keys) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_delete_key<void>(std::string key) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::hash_store::do_num_keys<void>() -> asio::awaitable<std::int64_t>)
// clang-format on
// End of the separate-compilation block.
