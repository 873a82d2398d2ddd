// A client of c10d's TCPStore (torch.distributed.TCPStore): the store that
// torch already runs where dcomm is started by torch's tooling. Under
// torchrun (without --standalone), the TorchElastic agent and Kubeflow's
// PyTorchJob, the agent serves a TCPStore on MASTER_ADDR:MASTER_PORT and
// tells the workers so (TORCHELASTIC_USE_AGENT_STORE=True): rendezvous
// (rendezvous.hpp) then joins it with this client instead of starting a
// server of its own. It also lets a C++ program share keys with a Python
// one that created a TCPStore.
//
// The protocol (store/detail/c10d_protocol.hpp) carries one request at a
// time per connection and has no deadlines of its own, so the client keeps
// a few connections: a waiting get or wait has one to itself (a set is never
// held up behind it), and a wait that reaches its deadline gives its
// connection up (the server would still answer it later). It speaks both
// torch 1.x's and torch 2.x's dialect, found on the first connection.
//
// Differences from tcp_store: no job token (c10d has none: the agent's store
// is open to anyone who reaches the port), num_keys counts every key in the
// server (the agent's and other prefixes' too), and compare_set on a
// missing key with a non-empty `expected` returns `expected` (c10d's rule;
// tcp_store keeps it too).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/store/detail/c10d_protocol.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

struct c10d_store_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;
  // Put before every key, as c10d's PrefixStore does ("/worker/attempt_0/"
  // for torchrun's workers: rendezvous.hpp). Keys travel as torch's own
  // client sends them, after a "/": a key "k" here is "k" to a Python
  // TCPStore on the same server (with prefix "p/": PrefixStore("p", store)).
  std::string prefix = "";
  std::chrono::milliseconds timeout = store::default_timeout;
  // The largest value a reply may announce: a server that announces more
  // is taken for a broken one, not an allocation to attempt.
  std::uint64_t max_value_bytes = std::uint64_t{1} << 30;
  int rank = -1;  // ours, for messages
  // Who serves the store, for messages.
  std::string server_name = "the TCPStore";
};

class c10d_store final : public basic_store<c10d_store> {
  using dialect = store_detail::c10d::dialect;
  using query = store_detail::c10d::query;
  using socket_ptr = std::shared_ptr<detail::ip_tcp::socket>;

  // with_deadline's cancel: a raw pointer, not a copy of the shared_ptr
  // (the caller holds it throughout). Arguments of a co_await expression
  // must be trivially destructible or named: g++ 12 destroys temporaries
  // there twice.
  struct canceller {
    explicit canceller(const socket_ptr& s) : socket(s.get()) {}
    void operator()() const {
      asio::error_code ignored;
      socket->cancel(ignored);
    }
    detail::ip_tcp::socket* socket;
  };

 public:
  static std::shared_ptr<c10d_store> create(asio::any_io_executor executor,
                                            c10d_store_options options) {
    return std::shared_ptr<c10d_store>(
        new c10d_store(std::move(executor), std::move(options), nullptr));
  }
  // The same, with an io thread of its own: for blocking use.
  static std::shared_ptr<c10d_store> create(c10d_store_options options) {
    auto thread = std::make_unique<detail::io_thread>();
    auto executor = thread->get_executor();
    return std::shared_ptr<c10d_store>(
        new c10d_store(std::move(executor), std::move(options), std::move(thread)));
  }

  executor_type get_executor() const override { return strand_; }
  std::string address() const override { return detail::tcp_address(options_.host, options_.port); }
  const c10d_store_options& options() const noexcept { return options_; }

  // The dialect the server speaks, "torch 1" or "torch 2"; empty before the
  // first operation has connected. Read it on the store's executor (or
  // after a blocking operation).
  std::string protocol() const {
    if (!dialect_) return {};
    return *dialect_ == dialect::torch1 ? "torch 1" : "torch 2";
  }

 protected:
  friend class basic_store<c10d_store>;

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
  // Connections kept for reuse; more are closed when returned.
  static constexpr std::size_t max_idle = 8;
  // How long the server has to answer the probe (store/detail/c10d_protocol.hpp).
  static constexpr auto probe_timeout = std::chrono::seconds(10);

  c10d_store(asio::any_io_executor executor, c10d_store_options options,
             std::unique_ptr<detail::io_thread> thread)
      : basic_store(options.timeout),
        thread_(std::move(thread)),
        strand_(asio::make_strand(executor)),
        options_(std::move(options)) {}

  // The key on the wire: "/", as torch's TCPStore client puts before every
  // key (its keyPrefix_), then the prefix, so that Python code sees the
  // same keys through its own TCPStore (and PrefixStore).
  std::string wire_key(const std::string& key) const { return "/" + options_.prefix + key; }

  // The query's code in the server's dialect (known once connected).
  std::uint8_t code(query q) const { return store_detail::c10d::code(*dialect_, q); }
  store_detail::c10d::encoder encode(query q) const { return store_detail::c10d::encoder(code(q)); }

  error_context context(std::string operation, std::string key = {}) const {
    return {.operation = "c10d_store." + std::move(operation),
            .rank = options_.rank >= 0 ? std::optional<int>(options_.rank) : std::nullopt,
            .key = std::move(key),
            .address = address()};
  }

  // Runs body on a connection of its own (the dialect known by then) and
  // keeps the connection for later only if body completed: a connection
  // left in the middle of a request can't be used again. Socket errors
  // leave as dcomm::errors of this store.
  template <typename Body>
  auto transact(std::string operation, std::string key, Body body)
      -> decltype(body(socket_ptr{}, time_point{})) {
    const auto deadline = detail::clock::now() + timeout();
    std::exception_ptr failure;
    socket_ptr s;
    try {
      s = co_await acquire(deadline);
      if constexpr (std::is_void_v<typename decltype(body(s, deadline))::value_type>) {
        co_await body(s, deadline);
        release(std::move(s));
        co_return;
      } else {
        auto result = co_await body(s, deadline);
        release(std::move(s));
        co_return result;
      }
    } catch (...) {
      failure = std::current_exception();
    }
    if (s) {
      asio::error_code ignored;
      s->close(ignored);
    }
    rethrow(failure, std::move(operation), std::move(key));
  }

  [[noreturn]] void rethrow(std::exception_ptr failure, std::string operation, std::string key) {
    try {
      std::rethrow_exception(failure);
    } catch (const dcomm::error& e) {
      if (!e.context().operation.empty()) throw;
      auto ctx = context(std::move(operation), std::move(key));
      ctx.expected = e.context().expected;
      ctx.seen = e.context().seen;
      ctx.detail = e.context().detail;
      throw error(e.code(), ctx);
    } catch (const std::system_error& e) {
      auto ctx = context(std::move(operation), std::move(key));
      const auto code = detail::socket_error_code(e.code());
      ctx.detail =
          code == make_error_code(errc::peer_lost)
              ? options_.server_name + " closed the connection (" + e.code().message() + ")"
              : e.code().message();
      throw error(code, ctx);
    }
  }

  DCOMM_EMIT_ON_USE asio::awaitable<socket_ptr> acquire(time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<socket_ptr> connect(time_point deadline);

  // Sends the probe on a fresh connection: true (torch 2) when s is now
  // validated and ready; false (torch 1) when the server dropped s.
  DCOMM_EMIT_ON_USE asio::awaitable<bool> probe(const socket_ptr& s, time_point deadline);

  error_context probe_timed_out() const {
    auto ctx = context("connect");
    ctx.expected = "c10d's TCPStore protocol (torch 1.x or 2.x)";
    ctx.seen = "no answer";
    ctx.detail =
        "the server at this address did not answer dcomm's probe: no TCPStore, or one "
        "whose protocol dcomm does not know";
    return ctx;
  }

  [[noreturn]] void not_a_tcp_store(std::string what) const {
    auto ctx = context("connect");
    ctx.expected = "c10d's TCPStore protocol (torch 1.x or 2.x)";
    ctx.detail = "the server at this address did not answer as a TCPStore: " + what;
    throw error(errc::protocol_error, ctx);
  }

  void release(socket_ptr s) {
    if (idle_.size() < max_idle) idle_.push_back(std::move(s));
  }

  // Waits until every key exists. At the deadline the connection is given
  // up (the caller closes it) and the keys still missing are named, found
  // on another connection.
  DCOMM_EMIT_ON_USE asio::awaitable<void> wait_on(const socket_ptr& s,
                                                  const std::vector<std::string>& keys,
                                                  time_point deadline, const char* operation);

  DCOMM_EMIT_ON_USE asio::awaitable<std::vector<std::string>> missing_keys(
      std::vector<std::string> keys);

  DCOMM_EMIT_ON_USE asio::awaitable<bool> check_on(const socket_ptr& s,
                                                   const std::vector<std::string>& keys,
                                                   time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<void> write(const socket_ptr& s, const std::string& bytes,
                                                time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<std::string> read_exact(const socket_ptr& s, std::size_t n,
                                                            time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<std::uint64_t> read_u64(const socket_ptr& s,
                                                            time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<std::string> read_value(const socket_ptr& s,
                                                            time_point deadline);

  error_context answer_timeout() const {
    return {.detail = options_.server_name + " did not answer by the deadline"};
  }

  std::unique_ptr<detail::io_thread> thread_;  // first: destroyed last
  asio::strand<asio::any_io_executor> strand_;
  c10d_store_options options_;
  std::optional<dialect> dialect_;
  std::vector<socket_ptr> idle_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_set(std::string key, std::string value)
    -> asio::awaitable<void> {
  co_await transact("set", key, [&](const socket_ptr& s, time_point d) -> asio::awaitable<void> {
    auto q = encode(query::set);
    q.str(wire_key(key)).str(value);
    // set has no reply: num_keys after it on the same connection returns
    // once the server has applied it, so what this process does next (on
    // any connection) sees it.
    q.bytes() += static_cast<char>(code(query::num_keys));
    co_await write(s, q.bytes(), d);
    co_await read_exact(s, 8, d);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_get(std::string key, time_point deadline)
    -> asio::awaitable<std::string> {
  co_return co_await transact(
      "get", key, [&](const socket_ptr& s, time_point d) -> asio::awaitable<std::string> {
        const std::vector<std::string> keys(1, key);
        co_await wait_on(s, keys, deadline, "get");
        auto q = encode(query::get);
        q.str(wire_key(key));
        co_await write(s, q.bytes(), d);
        co_return co_await read_value(s, d);
      });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_add(std::string key, std::int64_t delta)
    -> asio::awaitable<std::int64_t> {
  try {
    co_return co_await transact(
        "add", key, [&](const socket_ptr& s, time_point d) -> asio::awaitable<std::int64_t> {
          auto q = encode(query::add);
          q.str(wire_key(key)).i64(delta);
          co_await write(s, q.bytes(), d);
          co_return static_cast<std::int64_t>(co_await read_u64(s, d));
        });
  } catch (const dcomm::error& e) {
    if (e.code() != errc::peer_lost) throw;
  }
  // The server drops a connection whose add it cannot carry out: if it
  // still serves, the value at key is no integer.
  co_await do_num_keys();
  auto ctx = context("add", key);
  ctx.expected = "an integer at the key";
  ctx.detail = options_.server_name +
               " refused the add (it closes the connection when the value is no integer)";
  throw error(errc::invalid_argument, ctx);
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_compare_set(std::string key, std::string expected,
                                                             std::string desired)
    -> asio::awaitable<std::string> {
  co_return co_await transact(
      "compare_set", key, [&](const socket_ptr& s, time_point d) -> asio::awaitable<std::string> {
        auto q = encode(query::compare_set);
        q.str(wire_key(key)).str(expected).str(desired);
        co_await write(s, q.bytes(), d);
        co_return co_await read_value(s, d);
      });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_wait(std::vector<std::string> keys,
                                                      time_point deadline)
    -> asio::awaitable<void> {
  co_await transact("wait", store_detail::join_keys(keys),
                    [&](const socket_ptr& s, time_point) -> asio::awaitable<void> {
                      co_await wait_on(s, keys, deadline, "wait");
                    });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_check(std::vector<std::string> keys)
    -> asio::awaitable<bool> {
  co_return co_await transact("check", store_detail::join_keys(keys),
                              [&](const socket_ptr& s, time_point d) -> asio::awaitable<bool> {
                                co_return co_await check_on(s, keys, d);
                              });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_delete_key(std::string key)
    -> asio::awaitable<bool> {
  co_return co_await transact("delete_key", key,
                              [&](const socket_ptr& s, time_point d) -> asio::awaitable<bool> {
                                auto q = encode(query::delete_key);
                                q.str(wire_key(key));
                                co_await write(s, q.bytes(), d);
                                const auto deleted = co_await read_u64(s, d);
                                co_return deleted != 0;
                              });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::do_num_keys() -> asio::awaitable<std::int64_t> {
  co_return co_await transact(
      "num_keys", "", [&](const socket_ptr& s, time_point d) -> asio::awaitable<std::int64_t> {
        auto q = encode(query::num_keys);
        co_await write(s, q.bytes(), d);
        co_return static_cast<std::int64_t>(co_await read_u64(s, d));
      });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::acquire(time_point deadline)
    -> asio::awaitable<socket_ptr> {
  if (!idle_.empty()) {
    auto s = std::move(idle_.back());
    idle_.pop_back();
    co_return s;
  }
  auto s = co_await connect(deadline);
  if (!dialect_) {
    // Not in the if's condition: g++ 12 destroys a co_await's operands
    // there twice.
    const bool validated = co_await probe(s, deadline);
    if (validated) co_return s;
    // torch 1: the probe cost that connection. A server that drops this
    // one's num_keys as well is no TCPStore.
    s = co_await connect(deadline);
    auto q =
        store_detail::c10d::encoder(store_detail::c10d::code(dialect::torch1, query::num_keys));
    try {
      co_await write(s, q.bytes(), deadline);
      co_await read_exact(s, 8, deadline);
    } catch (const std::system_error& e) {
      not_a_tcp_store("it dropped a torch 1 num_keys as well (" + e.code().message() + ")");
    }
    dialect_ = dialect::torch1;
    detail::log(detail::log_level::debug,
                "c10d_store: " + address() + " speaks torch 1's TCPStore protocol");
    co_return s;
  }
  if (*dialect_ == dialect::torch2) {
    const auto validate = store_detail::c10d::validate_bytes();
    co_await write(s, validate, deadline);
  }
  co_return s;
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::connect(time_point deadline)
    -> asio::awaitable<socket_ptr> {
  auto socket = co_await detail::connect_with_retry(options_.host, options_.port, deadline,
                                                    "c10d_store.connect");
  co_return std::make_shared<detail::ip_tcp::socket>(std::move(socket));
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::probe(const socket_ptr& s, time_point deadline)
    -> asio::awaitable<bool> {
  const auto probe_message = store_detail::c10d::probe_bytes();
  co_await write(s, probe_message, deadline);
  std::string reply(store_detail::c10d::probe_reply_bytes, '\0');
  asio::error_code ec;
  std::size_t got = 0;
  const auto probe_deadline = std::min(deadline, detail::clock::now() + probe_timeout);
  const auto on_timeout = probe_timed_out();
  got = co_await detail::with_deadline(
      asio::async_read(*s, asio::buffer(reply), asio::redirect_error(asio::use_awaitable, ec)),
      probe_deadline, on_timeout, canceller(s));
  if (!ec && got == reply.size()) {
    dialect_ = dialect::torch2;
    detail::log(detail::log_level::debug,
                "c10d_store: " + address() + " speaks torch 2's TCPStore protocol");
    co_return true;
  }
  if (got == 0 && ec == asio::error::eof) co_return false;
  not_a_tcp_store(got == 0 ? ec.message()
                           : "it sent " + std::to_string(got) + " bytes, then " + ec.message());
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::wait_on(const socket_ptr& s,
                                                      const std::vector<std::string>& keys,
                                                      time_point deadline, const char* operation)
    -> asio::awaitable<void> {
  auto q = encode(query::wait);
  std::vector<std::string> full;
  for (const auto& k : keys) full.push_back(wire_key(k));
  q.strs(full);
  co_await write(s, q.bytes(), detail::clock::now() + timeout());
  std::string reply(1, '\0');
  std::exception_ptr timed_out;
  try {
    const auto on_timeout = context(operation);
    co_await detail::with_deadline(asio::async_read(*s, asio::buffer(reply), asio::use_awaitable),
                                   deadline, on_timeout, canceller(s));
  } catch (const dcomm::error& e) {
    if (e.code() != errc::timeout) throw;
    timed_out = std::current_exception();
  }
  if (timed_out) {
    asio::error_code ignored;
    s->close(ignored);
    std::vector<std::string> missing;
    try {
      missing = co_await missing_keys(keys);
    } catch (const std::exception&) {
      missing = keys;  // the store failed meanwhile: name them all
    }
    auto ctx = context(operation, store_detail::join_keys(missing.empty() ? keys : missing));
    ctx.detail = "keys still missing at the deadline";
    throw error(errc::timeout, ctx);
  }
  if (static_cast<std::uint8_t>(reply[0]) != store_detail::c10d::stop_waiting)
    throw_error(errc::protocol_error,
                {.detail = "bad reply to wait: " + std::to_string(static_cast<int>(reply[0]))});
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::missing_keys(std::vector<std::string> keys)
    -> asio::awaitable<std::vector<std::string>> {
  co_return co_await transact(
      "check", store_detail::join_keys(keys),
      [&](const socket_ptr& s, time_point d) -> asio::awaitable<std::vector<std::string>> {
        std::vector<std::string> missing;
        for (const auto& k : keys) {
          const std::vector<std::string> one(1, k);
          const bool present = co_await check_on(s, one, d);
          if (!present) missing.push_back(k);
        }
        co_return missing;
      });
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::check_on(const socket_ptr& s,
                                                       const std::vector<std::string>& keys,
                                                       time_point deadline)
    -> asio::awaitable<bool> {
  auto q = encode(query::check);
  std::vector<std::string> full;
  for (const auto& k : keys) full.push_back(wire_key(k));
  q.strs(full);
  co_await write(s, q.bytes(), deadline);
  auto reply = co_await read_exact(s, 1, deadline);
  co_return static_cast<std::uint8_t>(reply[0]) == store_detail::c10d::ready;
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::write(const socket_ptr& s, const std::string& bytes,
                                                    time_point deadline) -> asio::awaitable<void> {
  const auto on_timeout = answer_timeout();
  co_await detail::with_deadline(asio::async_write(*s, asio::buffer(bytes), asio::use_awaitable),
                                 deadline, on_timeout, canceller(s));
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::read_exact(const socket_ptr& s, std::size_t n,
                                                         time_point deadline)
    -> asio::awaitable<std::string> {
  std::string bytes(n, '\0');
  const auto on_timeout = answer_timeout();
  co_await detail::with_deadline(asio::async_read(*s, asio::buffer(bytes), asio::use_awaitable),
                                 deadline, on_timeout, canceller(s));
  co_return bytes;
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::read_u64(const socket_ptr& s, time_point deadline)
    -> asio::awaitable<std::uint64_t> {
  co_return store_detail::c10d::read_u64(co_await read_exact(s, 8, deadline));
}

DCOMM_EMIT_ON_USE_DEFINITION auto c10d_store::read_value(const socket_ptr& s, time_point deadline)
    -> asio::awaitable<std::string> {
  auto size = co_await read_u64(s, deadline);
  if (size > options_.max_value_bytes)
    throw_error(errc::protocol_error,
                {.expected = "a value of at most " + std::to_string(options_.max_value_bytes) +
                             " bytes (max_value_bytes)",
                 .seen = std::to_string(size) + " bytes announced",
                 .detail = "bad reply from " + options_.server_name});
  co_return co_await read_exact(s, static_cast<std::size_t>(size), deadline);
}

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_set<void>(std::string key, std::string value) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_get<void>(std::string key, time_point deadline) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_add<void>(std::string key, std::int64_t delta) -> asio::awaitable<std::int64_t>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_compare_set<void>(std::string key, std::string expected, std::string desired) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_wait<void>(std::vector<std::string> keys, time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_check<void>(std::vector<std::string> keys) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_delete_key<void>(std::string key) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::do_num_keys<void>() -> asio::awaitable<std::int64_t>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::acquire<void>(time_point deadline) -> asio::awaitable<socket_ptr>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::connect<void>(time_point deadline) -> asio::awaitable<socket_ptr>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::probe<void>(const socket_ptr& s, time_point deadline) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::wait_on<void>(const socket_ptr& s, const std::vector<std::string>& keys, time_point deadline, const char* operation) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::missing_keys<void>(std::vector<std::string> keys) -> asio::awaitable<std::vector<std::string>>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::check_on<void>(const socket_ptr& s, const std::vector<std::string>& keys, time_point deadline) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::write<void>(const socket_ptr& s, const std::string& bytes, time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::read_exact<void>(const socket_ptr& s, std::size_t n, time_point deadline) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::read_u64<void>(const socket_ptr& s, time_point deadline) -> asio::awaitable<std::uint64_t>)
DCOMM_INSTANTIATE(auto dcomm::c10d_store::read_value<void>(const socket_ptr& s, time_point deadline) -> asio::awaitable<std::string>)
// clang-format on
// End of the separate-compilation block.
