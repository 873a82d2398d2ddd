// Makers of store handles that share one store, so the same contract test
// body runs against every store implementation (Gloo's base_test idea).
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/store/file_store.hpp"
#include "dcomm/store/hash_store.hpp"
#include "dcomm/store/prefix_store.hpp"
#include "dcomm/store/tcp_store.hpp"

namespace dcomm::test {

// One shared store; handle(ex) gives a new client bound to ex.
struct store_world {
  virtual ~store_world() = default;
  virtual std::shared_ptr<store> handle(asio::any_io_executor ex) = 0;
};

struct hash_world final : store_world {
  std::shared_ptr<hash_store::table> table = std::make_shared<hash_store::table>();
  std::shared_ptr<store> handle(asio::any_io_executor ex) override {
    return hash_store::create(std::move(ex), table);
  }
};

struct tcp_world final : store_world {
  explicit tcp_world(std::string host = "127.0.0.1", std::string token = "")
      : host_(std::move(host)),
        token_(std::move(token)),
        server_(tcp_store_server::start(server_thread_.get_executor(),
                                        {.bind_host = host_, .job_token = token_})) {}
  std::shared_ptr<store> handle(asio::any_io_executor ex) override {
    return tcp_store::create(std::move(ex),
                             {.host = host_, .port = server_->port(), .job_token = token_});
  }
  std::uint16_t port() const { return server_->port(); }

 private:
  std::string host_;
  std::string token_;
  detail::io_thread server_thread_;
  std::unique_ptr<tcp_store_server> server_;
};

// A fresh temporary directory, removed with everything in it.
struct temp_dir {
  temp_dir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "dcomm-test-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  std::string path;
};

struct file_world final : store_world {
  temp_dir dir;
  std::string path = dir.path + "/store";
  std::shared_ptr<store> handle(asio::any_io_executor ex) override {
    return file_store::create(std::move(ex), path);
  }
};

// Puts every handle of another world under one prefix.
struct prefix_world final : store_world {
  hash_world inner;
  std::shared_ptr<store> handle(asio::any_io_executor ex) override {
    return prefix_store::create("job", inner.handle(std::move(ex)));
  }
};

}  // namespace dcomm::test
