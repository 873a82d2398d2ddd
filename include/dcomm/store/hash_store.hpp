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

class hash_store final : public store {
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

  asio::awaitable<void> set_impl(std::string key, std::string value) override {
    data().set(key, std::move(value));
    co_return;
  }
  asio::awaitable<std::string> get_impl(std::string key, time_point deadline) override {
    // Named, not a braced temporary: g++ 12 miscompiles initializer lists
    // inside co_await expressions ("array used as initializer").
    std::vector<std::string> keys(1, key);
    for (;;) {
      co_await wait_impl(keys, deadline);
      if (auto value = data().get(key)) co_return std::move(*value);
    }
  }
  asio::awaitable<std::int64_t> add_impl(std::string key, std::int64_t delta) override {
    co_return data().add(key, delta);
  }
  asio::awaitable<std::string> compare_set_impl(std::string key, std::string expected,
                                                std::string desired) override {
    co_return data().compare_set(key, expected, std::move(desired));
  }
  asio::awaitable<void> wait_impl(std::vector<std::string> keys, time_point deadline) override {
    auto missing = co_await data().wait_for(keys, deadline);
    if (!missing.empty())
      throw_error(errc::timeout, {.operation = "hash_store.wait",
                                  .key = store_detail::join_keys(missing),
                                  .detail = "keys still missing at the deadline"});
  }
  asio::awaitable<bool> check_impl(std::vector<std::string> keys) override {
    co_return data().missing(keys).empty();
  }
  asio::awaitable<bool> delete_key_impl(std::string key) override { co_return data().erase(key); }
  asio::awaitable<std::int64_t> num_keys_impl() override { co_return data().size(); }

 private:
  hash_store(executor_type executor, std::shared_ptr<table> shared, duration timeout)
      : store(timeout), executor_(std::move(executor)), table_(std::move(shared)) {}

  detail::kv_table& data() const { return table_->data_; }

  executor_type executor_;
  std::shared_ptr<table> table_;
};

}  // namespace dcomm
