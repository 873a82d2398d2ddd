// A store served over TCP (c10d's TCPStore): one server, hosted in rank 0's
// process or standalone (tcp_store_server.hpp), and a client per process
// (this file).
//
// The client keeps one connection and many requests in flight on it (a
// waiting get never holds up a set); the protocol is in
// store/detail/tcp_store_protocol.hpp. The server enforces waits' deadlines
// and answers a timeout with the keys still missing; the client gives it a
// grace period beyond them before it calls the server unresponsive. Losing
// the connection fails every pending operation, blaming the server's host
// (or the cause the host gave as it left) where known.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/wire.hpp"
#include "dcomm/error.hpp"
#include "dcomm/store/detail/frame_stream.hpp"
#include "dcomm/store/detail/tcp_store_protocol.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/store/tcp_store_server.hpp"

namespace dcomm {

struct tcp_store_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;
  // Host the server in this process (rank 0), listening on port (0: pick
  // one; read it back with port()) or on listen_fd.
  bool is_server = false;
  std::string bind_host = "";  // for the hosted server; see tcp_store_server_options
  int listen_fd = -1;
  std::chrono::milliseconds timeout = store::default_timeout;
  std::string job_token = detail::job_token_from_environment();
  std::size_t max_frame_bytes = store_detail::default_max_frame_bytes;
  // For the hosted server; see tcp_store_server_options.
  std::size_t max_buffered_bytes = store_detail::default_max_buffered_bytes;
  // For both ends: once a frame (a request, a reply) has begun, the rest must
  // arrive within this. A server that stops in the middle of a reply fails
  // every pending operation with errc::timeout.
  std::chrono::milliseconds frame_timeout = store_detail::default_frame_timeout;
  int rank = -1;  // ours, for the server's and our own messages
  // The rank whose process hosts the server, where known (rendezvous: 0):
  // losing the server, or failing to reach it, is then blamed on that rank.
  int server_rank = -1;
};

class tcp_store final : public basic_store<tcp_store> {
 public:
  // A client on `executor` (and the server too when options.is_server). The
  // connection is made by connect() or by the first operation.
  static std::shared_ptr<tcp_store> create(asio::any_io_executor executor,
                                           tcp_store_options options) {
    return std::shared_ptr<tcp_store>(new tcp_store(std::move(executor), std::move(options), {}));
  }
  // The same, with an io thread of its own: for blocking use.
  static std::shared_ptr<tcp_store> create(tcp_store_options options) {
    auto thread = std::make_unique<detail::io_thread>();
    auto executor = thread->get_executor();
    return std::shared_ptr<tcp_store>(
        new tcp_store(std::move(executor), std::move(options), std::move(thread)));
  }

  ~tcp_store() override {
    // Closing fails the reader, which fails whatever is still pending.
    if (stream_) asio::post(strand_, [s = stream_] { s->close(); });
  }

  executor_type get_executor() const override { return strand_; }
  std::string address() const override { return detail::tcp_address(options_.host, port()); }
  std::uint16_t port() const noexcept { return server_ ? server_->port() : options_.port; }
  const tcp_store_server* server() const noexcept { return server_.get(); }

  // This process hosts the server and is leaving because it failed: its
  // clients are told why (`why`'s peers are whom to blame), at most for a
  // second, before the server goes. Nothing to do for a client.
  DCOMM_EMIT_ON_USE asio::awaitable<void> leave(const dcomm::error& why);

  // Connects (with retries until the store's timeout) and authenticates.
  template <completion_token_for Token = default_token_t>
  auto connect(Token&& token = {}) {
    return detail::initiate(strand_, connect_op(shared_self(), detail::clock::now() + timeout()),
                            std::forward<Token>(token), "tcp_store.connect",
                            timeout() + detail::blocking_grace);
  }

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
  // How long past a wait's own deadline the client waits for the server's
  // timeout answer before declaring the server unresponsive.
  static constexpr auto answer_grace = std::chrono::seconds(5);

  struct pending {
    explicit pending(const asio::any_io_executor& ex) : timer(ex) {}
    asio::steady_timer timer;
    std::optional<std::string> reply;
    std::exception_ptr failure;
  };

  tcp_store(asio::any_io_executor executor, tcp_store_options options,
            std::unique_ptr<detail::io_thread> thread)
      : basic_store(options.timeout),
        thread_(std::move(thread)),
        strand_(asio::make_strand(executor)),
        options_(std::move(options)) {
    detail::require_crypto_for(options_.job_token, "tcp_store");
    if (options_.is_server)
      server_ =
          tcp_store_server::start(executor, {.bind_host = options_.bind_host,
                                             .port = options_.port,
                                             .listen_fd = options_.listen_fd,
                                             .job_token = options_.job_token,
                                             .max_frame_bytes = options_.max_frame_bytes,
                                             .max_buffered_bytes = options_.max_buffered_bytes,
                                             .frame_timeout = options_.frame_timeout});
  }

  std::shared_ptr<tcp_store> shared_self() {
    return std::static_pointer_cast<tcp_store>(shared_from_this());
  }

  static std::uint64_t remaining_ms(detail::clock::time_point deadline) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::clock::now());
    return static_cast<std::uint64_t>(std::max<std::int64_t>(left.count(), 0));
  }

  error_context context(std::string operation, std::string key = {}) const {
    return {.operation = std::move(operation),
            .rank = options_.rank >= 0 ? std::optional<int>(options_.rank) : std::nullopt,
            .key = std::move(key),
            .address = address()};
  }

  std::string host() const {
    return options_.server_rank >= 0
               ? "rank " + std::to_string(options_.server_rank) + ", which hosts the store,"
               : std::string("the store server");
  }
  // A lost or unreachable server: its host is to blame, where known.
  void blame_host(error_context& ctx) const {
    if (options_.server_rank < 0 || !ctx.peers.empty()) return;
    ctx.peers = "rank " + std::to_string(options_.server_rank);
    ctx.detail = "the store's host, rank " + std::to_string(options_.server_rank) +
                 (ctx.detail.empty() ? std::string() : ": " + ctx.detail);
  }

  DCOMM_EMIT_ON_USE static asio::awaitable<void> connect_op(std::shared_ptr<tcp_store> self,
                                                            detail::clock::time_point deadline);

  DCOMM_EMIT_ON_USE asio::awaitable<void> ensure_connected(detail::clock::time_point deadline);

  // Connects and authenticates; on success the stream and its reader run.
  DCOMM_EMIT_ON_USE asio::awaitable<void> connect_stream(detail::clock::time_point deadline);

  // Holds the store weakly: a store nobody uses any more must be able to die
  // (its destructor closes the stream, which ends this loop).
  DCOMM_EMIT_ON_USE static asio::awaitable<void> read_loop(
      std::weak_ptr<tcp_store> weak, std::shared_ptr<store_detail::frame_stream> stream);

  // Sends one request and waits for its reply (status byte stripped).
  DCOMM_EMIT_ON_USE asio::awaitable<std::string> request(store_detail::store_op op,
                                                         detail::wire_writer args,
                                                         std::string operation, std::string key,
                                                         detail::clock::time_point deadline);

  // Reads the fields of a reply; one that does not decode is reported with
  // this store's context.
  template <typename Parse>
  auto decode(const std::string& reply, const std::string& operation, const std::string& key,
              Parse parse, bool whole = true) const
      -> std::invoke_result_t<Parse&, detail::wire_reader&> {
    try {
      detail::wire_reader r(reply);
      auto value = parse(r);
      if (whole) r.expect_end();
      return value;
    } catch (const dcomm::error& e) {
      auto ctx = context(operation, key);
      ctx.detail = "bad reply from the store server: " + e.context().detail;
      throw error(errc::protocol_error, ctx);
    }
  }

  std::unique_ptr<detail::io_thread> thread_;  // first: destroyed last
  asio::strand<asio::any_io_executor> strand_;
  tcp_store_options options_;
  std::unique_ptr<tcp_store_server> server_;
  std::shared_ptr<store_detail::frame_stream> stream_;
  std::exception_ptr lost_;
  // The server's notice, if its host left after failing (see notice_id).
  std::string notice_peers_, notice_;
  bool connecting_ = false;
  std::vector<std::shared_ptr<asio::steady_timer>> connect_waiters_;
  std::map<std::uint64_t, std::shared_ptr<pending>> pending_;
  std::uint64_t next_id_ = 1;
};

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::leave(const dcomm::error& why)
    -> asio::awaitable<void> {
  if (!server_) co_return;
  co_await server_->notify_leaving(why.context().peers, why.what(),
                                   detail::clock::now() + std::chrono::seconds(1));
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_set(std::string key, std::string value)
    -> asio::awaitable<void> {
  detail::wire_writer w;
  w.str(key).str(value);
  co_await request(store_detail::store_op::set, std::move(w), "tcp_store.set", key,
                   detail::clock::now() + timeout());
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_get(std::string key, time_point deadline)
    -> asio::awaitable<std::string> {
  std::vector<std::string> keys(1, key);
  detail::wire_writer w;
  w.strs(keys).u64(remaining_ms(deadline));
  auto reply =
      co_await request(store_detail::store_op::get, std::move(w), "tcp_store.get", key, deadline);
  co_return decode(reply, "tcp_store.get", key, [](detail::wire_reader& r) { return r.str(); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_add(std::string key, std::int64_t delta)
    -> asio::awaitable<std::int64_t> {
  detail::wire_writer w;
  w.str(key).i64(delta);
  auto reply = co_await request(store_detail::store_op::add, std::move(w), "tcp_store.add", key,
                                detail::clock::now() + timeout());
  co_return decode(reply, "tcp_store.add", key, [](detail::wire_reader& r) { return r.i64(); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_compare_set(std::string key, std::string expected,
                                                            std::string desired)
    -> asio::awaitable<std::string> {
  detail::wire_writer w;
  w.str(key).str(expected).str(desired);
  auto reply = co_await request(store_detail::store_op::compare_set, std::move(w),
                                "tcp_store.compare_set", key, detail::clock::now() + timeout());
  co_return decode(reply, "tcp_store.compare_set", key,
                   [](detail::wire_reader& r) { return r.str(); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_wait(std::vector<std::string> keys,
                                                     time_point deadline) -> asio::awaitable<void> {
  detail::wire_writer w;
  w.strs(keys).u64(remaining_ms(deadline));
  co_await request(store_detail::store_op::wait, std::move(w), "tcp_store.wait",
                   store_detail::join_keys(keys), deadline);
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_check(std::vector<std::string> keys)
    -> asio::awaitable<bool> {
  detail::wire_writer w;
  w.strs(keys);
  auto joined = store_detail::join_keys(keys);
  auto reply = co_await request(store_detail::store_op::check, std::move(w), "tcp_store.check",
                                joined, detail::clock::now() + timeout());
  co_return decode(reply, "tcp_store.check", joined,
                   [](detail::wire_reader& r) { return r.u8() != 0; });
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_delete_key(std::string key)
    -> asio::awaitable<bool> {
  detail::wire_writer w;
  w.str(key);
  auto reply = co_await request(store_detail::store_op::delete_key, std::move(w),
                                "tcp_store.delete_key", key, detail::clock::now() + timeout());
  co_return decode(reply, "tcp_store.delete_key", key,
                   [](detail::wire_reader& r) { return r.u8() != 0; });
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::do_num_keys() -> asio::awaitable<std::int64_t> {
  auto reply = co_await request(store_detail::store_op::num_keys, detail::wire_writer{},
                                "tcp_store.num_keys", "", detail::clock::now() + timeout());
  co_return decode(reply, "tcp_store.num_keys", "", [](detail::wire_reader& r) { return r.i64(); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::connect_op(std::shared_ptr<tcp_store> self,
                                                        detail::clock::time_point deadline)
    -> asio::awaitable<void> {
  co_await self->ensure_connected(deadline);
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::ensure_connected(detail::clock::time_point deadline)
    -> asio::awaitable<void> {
  if (stream_) co_return;
  if (lost_) std::rethrow_exception(lost_);
  if (connecting_) {
    // Someone else is connecting: wait for them (woken by cancel).
    auto waiter = std::make_shared<asio::steady_timer>(strand_, deadline);
    connect_waiters_.push_back(waiter);
    asio::error_code ec;
    co_await waiter->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (stream_) co_return;
    if (lost_) std::rethrow_exception(lost_);
    throw error(errc::connect_failed, context("tcp_store.connect"));
  }
  connecting_ = true;
  std::exception_ptr failure;
  try {
    co_await connect_stream(deadline);
  } catch (...) {
    failure = std::current_exception();
  }
  connecting_ = false;
  for (auto& w : connect_waiters_) w->cancel();
  connect_waiters_.clear();
  if (!failure) co_return;
  try {
    std::rethrow_exception(failure);
  } catch (const dcomm::error& e) {
    // An unreachable server: its host is to blame (a refusal is ours).
    if (e.code() == errc::auth_failed || e.code() == errc::invalid_argument) throw;
    auto ctx = e.context();
    blame_host(ctx);
    throw error(e.code(), ctx);
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::connect_stream(detail::clock::time_point deadline)
    -> asio::awaitable<void> {
  auto socket =
      co_await detail::connect_with_retry(options_.host, port(), deadline, "tcp_store.connect");
  detail::handshake_config config{.purpose = std::string(store_detail::store_purpose),
                                  .token = options_.job_token,
                                  .rank = options_.rank};
  try {
    co_await detail::client_handshake(socket, config, address(), deadline);
  } catch (const dcomm::error&) {
    throw;
  } catch (const std::system_error& e) {  // the server closed the connection
    auto ctx = context("tcp_store.connect");
    ctx.detail =
        "the store server dropped the connection during the handshake: " + e.code().message();
    throw error(errc::peer_lost, ctx);
  }
  stream_ = std::make_shared<store_detail::frame_stream>(
      std::move(socket), store_detail::frame_limits{.max_frame_bytes = options_.max_frame_bytes,
                                                    .frame_timeout = options_.frame_timeout});
  asio::co_spawn(strand_, read_loop(std::weak_ptr<tcp_store>(shared_self()), stream_),
                 asio::detached);
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::read_loop(
    std::weak_ptr<tcp_store> weak, std::shared_ptr<store_detail::frame_stream> stream)
    -> asio::awaitable<void> {
  errc code = errc::peer_lost;
  error_context why;
  try {
    for (;;) {
      std::string body = co_await stream->read_frame();
      auto self = weak.lock();
      if (!self) co_return;
      detail::wire_reader r(body);
      std::uint64_t id = r.u64();
      if (id == store_detail::notice_id) {
        if (static_cast<store_detail::store_status>(r.u8()) == store_detail::store_status::notice) {
          self->notice_peers_ = r.str();
          self->notice_ = r.str();
        }
        continue;
      }
      auto it = self->pending_.find(id);
      if (it == self->pending_.end()) continue;  // its caller already gave up
      body.erase(0, 8);
      it->second->reply = std::move(body);
      it->second->timer.cancel();
    }
  } catch (const dcomm::error& e) {
    code = static_cast<errc>(e.code().value());
    why = e.context();
    why.detail = (code == errc::protocol_error ? "bad reply from the store server: "
                  : code == errc::timeout
                      ? "the store server stopped in the middle of a reply; connection closed: "
                      : "connection to the store server lost: ") +
                 why.detail;
  } catch (const std::exception& e) {
    why.detail = std::string("connection to the store server dropped: ") + e.what();
  }
  stream->close();
  auto self = weak.lock();
  if (!self) co_return;
  if (self->stream_ == stream) self->stream_.reset();
  // With this store's rank and address for the message, and whom to
  // blame: the cause the host gave as it left, else the host itself.
  auto ctx = self->context("tcp_store");
  ctx.expected = why.expected;
  ctx.seen = why.seen;
  ctx.detail = why.detail;
  if (!self->notice_.empty()) {
    code = errc::peer_lost;
    ctx.peers = self->notice_peers_;
    ctx.detail = self->host() + " left after it failed: " + self->notice_;
  } else {
    self->blame_host(ctx);
  }
  auto failure = std::make_exception_ptr(error(code, ctx));
  self->lost_ = failure;
  // A request whose reply came before the end keeps it: it was answered.
  for (auto& [id, p] : self->pending_)
    if (!p->reply) {
      p->failure = failure;
      p->timer.cancel();
    }
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store::request(store_detail::store_op op,
                                                     detail::wire_writer args,
                                                     std::string operation, std::string key,
                                                     detail::clock::time_point deadline)
    -> asio::awaitable<std::string> {
  // The server would drop the connection, failing every pending operation.
  if (args.bytes().size() + store_detail::request_prefix_bytes > options_.max_frame_bytes) {
    auto ctx = context(operation, key);
    ctx.expected = "a request of at most " + std::to_string(options_.max_frame_bytes) +
                   " bytes (max_frame_bytes)";
    ctx.seen = std::to_string(args.bytes().size() + store_detail::request_prefix_bytes) + " bytes";
    throw error(errc::invalid_argument, ctx);
  }
  co_await ensure_connected(deadline);
  if (!stream_) std::rethrow_exception(lost_);
  std::uint64_t id = next_id_++;
  auto p = std::make_shared<pending>(strand_);
  p->timer.expires_at(deadline + answer_grace);
  pending_.emplace(id, p);
  detail::wire_writer body;
  body.u64(id).u8(static_cast<std::uint8_t>(op)).raw(args.bytes());
  stream_->send_frame(std::move(body.bytes()));
  asio::error_code ec;
  co_await p->timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  pending_.erase(id);
  if (p->failure) std::rethrow_exception(p->failure);
  if (!p->reply) {
    auto ctx = context(operation, key);
    ctx.detail = "the store server did not answer by the deadline";
    throw error(errc::timeout, ctx);
  }
  std::string rest = std::move(*p->reply);
  auto status = static_cast<store_detail::store_status>(decode(
      rest, operation, key, [](detail::wire_reader& r) { return r.u8(); }, false));
  rest.erase(0, 1);
  if (status == store_detail::store_status::ok) co_return rest;
  if (status == store_detail::store_status::timeout) {
    auto missing = decode(rest, operation, key, [](detail::wire_reader& r) { return r.strs(); });
    auto ctx = context(operation, store_detail::join_keys(missing));
    ctx.detail = "keys still missing at the deadline";
    throw error(errc::timeout, ctx);
  }
  // A request the server refused: its error, in this store's context.
  auto ctx = context(operation, key);
  auto code = decode(rest, operation, key, [&ctx](detail::wire_reader& r) {
    auto c = static_cast<errc>(r.u8());
    ctx.expected = r.str();
    ctx.seen = r.str();
    ctx.detail = r.str();
    return c;
  });
  throw error(code, ctx);
}

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::tcp_store::leave<void>(const dcomm::error& why) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_set<void>(std::string key, std::string value) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_get<void>(std::string key, time_point deadline) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_add<void>(std::string key, std::int64_t delta) -> asio::awaitable<std::int64_t>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_compare_set<void>(std::string key, std::string expected, std::string desired) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_wait<void>(std::vector<std::string> keys, time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_check<void>(std::vector<std::string> keys) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_delete_key<void>(std::string key) -> asio::awaitable<bool>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::do_num_keys<void>() -> asio::awaitable<std::int64_t>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::connect_op<void>(std::shared_ptr<tcp_store> self, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::ensure_connected<void>(detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::connect_stream<void>(detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::read_loop<void>(std::weak_ptr<tcp_store> weak, std::shared_ptr<store_detail::frame_stream> stream) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store::request<void>(store_detail::store_op op, detail::wire_writer args, std::string operation, std::string key, detail::clock::time_point deadline) -> asio::awaitable<std::string>)
// clang-format on
// End of the separate-compilation block.
