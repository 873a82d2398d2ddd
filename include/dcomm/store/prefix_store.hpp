// A store decorator that puts every key under "prefix/", so several users
// (rendezvous rounds, process groups) share one store without collisions.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/store/store.hpp"

namespace dcomm {

class prefix_store final : public store {
 public:
  static std::shared_ptr<prefix_store> create(std::string prefix, std::shared_ptr<store> inner) {
    if (!inner)
      throw_error(errc::invalid_argument,
                  {.operation = "prefix_store", .detail = "the inner store is null"});
    return std::shared_ptr<prefix_store>(new prefix_store(std::move(prefix), std::move(inner)));
  }

  const std::string& prefix() const noexcept { return prefix_; }
  const std::shared_ptr<store>& inner() const noexcept { return inner_; }

  executor_type get_executor() const override { return inner_->get_executor(); }
  std::string address() const override { return inner_->address() + " (prefix " + prefix_ + ")"; }

  asio::awaitable<void> set_impl(std::string key, std::string value) override {
    return inner_->set_impl(full(key), std::move(value));
  }
  asio::awaitable<std::string> get_impl(std::string key, time_point deadline) override {
    return inner_->get_impl(full(key), deadline);
  }
  asio::awaitable<std::int64_t> add_impl(std::string key, std::int64_t delta) override {
    return inner_->add_impl(full(key), delta);
  }
  asio::awaitable<std::string> compare_set_impl(std::string key, std::string expected,
                                                std::string desired) override {
    return inner_->compare_set_impl(full(key), std::move(expected), std::move(desired));
  }
  asio::awaitable<void> wait_impl(std::vector<std::string> keys, time_point deadline) override {
    return inner_->wait_impl(full(std::move(keys)), deadline);
  }
  asio::awaitable<bool> check_impl(std::vector<std::string> keys) override {
    return inner_->check_impl(full(std::move(keys)));
  }
  asio::awaitable<bool> delete_key_impl(std::string key) override {
    return inner_->delete_key_impl(full(key));
  }
  // Counts the inner store's keys, as c10d's PrefixStore does.
  asio::awaitable<std::int64_t> num_keys_impl() override { return inner_->num_keys_impl(); }

 private:
  prefix_store(std::string prefix, std::shared_ptr<store> inner)
      : store(inner->timeout()), prefix_(std::move(prefix)), inner_(std::move(inner)) {}

  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full(std::vector<std::string> keys) const {
    for (auto& k : keys) k = full(k);
    return keys;
  }

  std::string prefix_;
  std::shared_ptr<store> inner_;
};

}  // namespace dcomm
