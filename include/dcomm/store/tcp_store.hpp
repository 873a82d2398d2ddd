// A store served over TCP (c10d's TCPStore): one server, hosted in rank 0's
// process or standalone, and a client per process.
//
// Frames are u32 length + body; requests carry an id so many operations can
// be in flight on one connection (a waiting get never holds up a set). The
// server enforces waits' deadlines and answers a timeout with the keys still
// missing. A frame over a limit (size, the server's budget for frames in
// flight, the deadline of a frame begun; see detail/frame_stream.hpp) or one
// that does not decode closes that connection only: the server and all other
// clients carry on.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/kv_table.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/wire.hpp"
#include "dcomm/store/detail/frame_stream.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

namespace detail {

enum class store_op : std::uint8_t {
  set = 1,
  get,
  add,
  compare_set,
  wait,
  check,
  delete_key,
  num_keys,
};

enum class store_status : std::uint8_t { ok = 0, timeout = 1, error = 2, notice = 3 };

// Request ids start at 1: a frame from the server with id 0 answers no
// request. It is a notice (status notice, then str peers, str detail): the
// process hosting the server is leaving because it failed, and says why, so
// that its clients blame the first cause rather than the lost connection.
inline constexpr std::uint64_t notice_id = 0;

inline constexpr std::string_view store_purpose = "store";

inline std::string job_token_from_environment() {
  const char* t = std::getenv("DCOMM_JOB_TOKEN");
  return t ? t : "";
}

}  // namespace detail

struct tcp_store_server_options {
  // Address to listen on; empty: every interface, IPv6 and IPv4 (as c10d).
  std::string bind_host = "";
  std::uint16_t port = 0;  // 0: the system picks; read it back with port()
  // An already-bound listening socket to adopt (a launcher that picked the
  // port); the server takes ownership. -1: bind bind_host:port.
  int listen_fd = -1;
  std::string job_token = detail::job_token_from_environment();
  std::size_t max_frame_bytes = detail::default_max_frame_bytes;
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
  // Bytes held for frames in flight (bodies being received, replies queued
  // to send) across all connections; a connection whose frame would take the
  // server over it is dropped.
  std::size_t max_buffered_bytes = detail::default_max_buffered_bytes;
  // Once a frame has begun, the rest must arrive within this, or its
  // connection is dropped. Idle time between frames is unlimited.
  std::chrono::milliseconds frame_timeout = detail::default_frame_timeout;
};

// The server half. Runs on a strand of the executor it is given; destroying
// the handle stops it (closing the listening socket and every connection).
class tcp_store_server {
 public:
  static std::unique_ptr<tcp_store_server> start(asio::any_io_executor executor,
                                                 tcp_store_server_options options = {}) {
    return std::unique_ptr<tcp_store_server>(
        new tcp_store_server(std::move(executor), std::move(options)));
  }
  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;
  ~tcp_store_server() { impl_->stop(); }

  std::uint16_t port() const noexcept { return impl_->port; }
  std::string address() const { return impl_->address; }

  // The hosting process is leaving because it failed: tells every client
  // why (a notice, see notice_id), and returns once that is written or the
  // deadline passed. `peers`: whom the host's failure blames.
  asio::awaitable<void> notify_leaving(std::string peers, std::string detail,
                                       detail::clock::time_point deadline) {
    co_await asio::co_spawn(impl_->strand,
                            impl::notify_op(impl_, std::move(peers), std::move(detail), deadline),
                            asio::use_awaitable);
  }

 private:
  struct impl;
  using connection = detail::frame_stream;

  tcp_store_server(asio::any_io_executor executor, tcp_store_server_options options)
      : impl_(std::make_shared<impl>(asio::make_strand(executor), std::move(options))) {
    detail::require_crypto_for(impl_->options.job_token, "tcp_store_server");
    impl_->open();
    asio::co_spawn(impl_->strand, impl::accept_loop(impl_), asio::detached);
  }

  struct impl : std::enable_shared_from_this<impl> {
    impl(asio::strand<asio::any_io_executor> s, tcp_store_server_options o)
        : strand(std::move(s)),
          acceptor(strand),
          options(std::move(o)),
          limits{.max_frame_bytes = options.max_frame_bytes,
                 .frame_timeout = options.frame_timeout,
                 .budget = std::make_shared<detail::frame_budget>(options.max_buffered_bytes)} {}

    asio::strand<asio::any_io_executor> strand;
    detail::ip_tcp::acceptor acceptor;
    tcp_store_server_options options;
    detail::frame_limits limits;
    std::uint16_t port = 0;
    std::string address;
    detail::kv_table table;
    std::vector<std::weak_ptr<connection>> connections;
    bool stopped = false;

    void open() {
      using detail::ip_tcp;
      asio::error_code ec;
      if (options.listen_fd >= 0) {
        auto ep = endpoint_of_fd(options.listen_fd);
        acceptor.assign(ep.protocol(), options.listen_fd, ec);
        if (ec)
          throw_error(errc::invalid_argument,
                      {.operation = "tcp_store_server",
                       .key = "listen_fd",
                       .detail = "cannot adopt listening socket " +
                                 std::to_string(options.listen_fd) + ": " + ec.message()});
      } else {
        ip_tcp::endpoint ep;
        if (options.bind_host.empty()) {
          ep = ip_tcp::endpoint(ip_tcp::v6(), options.port);
        } else {
          auto addr = asio::ip::make_address(options.bind_host, ec);
          if (ec)
            throw_error(errc::invalid_argument,
                        {.operation = "tcp_store_server",
                         .address = options.bind_host,
                         .detail = "bind_host must be an IP address: " + ec.message()});
          ep = ip_tcp::endpoint(addr, options.port);
        }
        acceptor.open(ep.protocol(), ec);
        if (ec && options.bind_host.empty()) {  // no IPv6 on this host
          ep = ip_tcp::endpoint(ip_tcp::v4(), options.port);
          ec.clear();
          acceptor.open(ep.protocol(), ec);
        }
        if (!ec && ep.protocol() == ip_tcp::v6() && options.bind_host.empty())
          acceptor.set_option(asio::ip::v6_only(false), ec);
        if (!ec) acceptor.set_option(ip_tcp::acceptor::reuse_address(true), ec);
        if (!ec) acceptor.bind(ep, ec);
        if (ec == asio::error::address_in_use)
          throw_error(errc::address_in_use,
                      {.operation = "tcp_store_server",
                       .address = detail::endpoint_address(ep),
                       .detail = "port " + std::to_string(options.port) +
                                 " is taken by another process; choose another port "
                                 "(MASTER_PORT, or the port of the tcp:// URL)"});
        if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
        if (ec)
          throw_error(errc::invalid_argument, {.operation = "tcp_store_server",
                                               .address = detail::endpoint_address(ep),
                                               .detail = "cannot listen: " + ec.message()});
      }
      auto local = acceptor.local_endpoint(ec);
      if (ec)
        throw_error(errc::invalid_argument, {.operation = "tcp_store_server",
                                             .detail = "no local address: " + ec.message()});
      port = local.port();
      address = detail::endpoint_address(local);
    }

    static detail::ip_tcp::endpoint endpoint_of_fd(int fd) {
      sockaddr_storage storage{};
      socklen_t length = sizeof(storage);
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0)
        throw_error(errc::invalid_argument,
                    {.operation = "tcp_store_server",
                     .key = "listen_fd",
                     .detail = "fd " + std::to_string(fd) + " is not a socket"});
      // Anything else would fail every accept, for ever.
      int listening = 0;
      socklen_t option_length = sizeof(listening);
      if ((storage.ss_family != AF_INET && storage.ss_family != AF_INET6) ||
          ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &option_length) != 0 ||
          !listening)
        throw_error(errc::invalid_argument,
                    {.operation = "tcp_store_server",
                     .key = "listen_fd",
                     .detail = "fd " + std::to_string(fd) + " is not a listening TCP socket"});
      detail::ip_tcp::endpoint ep;
      std::memcpy(ep.data(), &storage, std::min<std::size_t>(length, ep.capacity()));
      ep.resize(length);
      return ep;
    }

    void stop() {
      asio::post(strand, [self = shared_from_this()] {
        self->stopped = true;
        asio::error_code ignored;
        self->acceptor.close(ignored);
        for (auto& weak : self->connections)
          if (auto c = weak.lock()) c->close();
        self->connections.clear();
      });
    }

    static asio::awaitable<void> notify_op(std::shared_ptr<impl> self, std::string peers,
                                           std::string detail, detail::clock::time_point deadline) {
      detail::wire_writer notice;
      notice.u64(detail::notice_id)
          .u8(static_cast<std::uint8_t>(detail::store_status::notice))
          .str(peers)
          .str(detail);
      std::vector<std::shared_ptr<connection>> told;
      for (auto& weak : self->connections)
        if (auto c = weak.lock()) {
          try {
            c->send_frame(notice.bytes());
            told.push_back(std::move(c));
          } catch (const dcomm::error&) {  // over the budget: that one is not told
          }
        }
      asio::steady_timer pause(self->strand);
      while (detail::clock::now() < deadline &&
             std::any_of(told.begin(), told.end(), [](auto& c) { return !c->flushed(); })) {
        pause.expires_after(std::chrono::milliseconds(5));
        co_await pause.async_wait(asio::use_awaitable);
      }
    }

    static asio::awaitable<void> accept_loop(std::shared_ptr<impl> self) {
      while (!self->stopped) {
        asio::error_code ec;
        auto socket =
            co_await self->acceptor.async_accept(asio::redirect_error(asio::use_awaitable, ec));
        if (ec == asio::error::operation_aborted || !self->acceptor.is_open()) break;
        if (ec) {
          // Out of file descriptors and the like: keep serving the others.
          detail::log(detail::log_level::warning, "tcp_store server accept: " + ec.message());
          asio::steady_timer pause(self->strand, std::chrono::milliseconds(50));
          co_await pause.async_wait(asio::use_awaitable);
          continue;
        }
        auto conn = std::make_shared<connection>(std::move(socket), self->limits);
        std::erase_if(self->connections, [](auto& w) { return w.expired(); });
        self->connections.push_back(conn);
        asio::co_spawn(self->strand, serve(self, conn), asio::detached);
      }
    }

    static asio::awaitable<void> serve(std::shared_ptr<impl> self,
                                       std::shared_ptr<connection> conn) {
      asio::error_code ec;
      auto endpoint = conn->socket().remote_endpoint(ec);
      std::string peer = ec ? "an unknown peer" : detail::endpoint_address(endpoint);
      try {
        conn->socket().set_option(detail::ip_tcp::no_delay(true), ec);
        detail::handshake_config config{.purpose = std::string(detail::store_purpose),
                                        .token = self->options.job_token};
        auto who = co_await detail::server_handshake(
            conn->socket(), config, peer, detail::clock::now() + self->options.handshake_timeout);
        if (who.rank >= 0) peer += " (rank " + std::to_string(who.rank) + ")";
        for (;;) {
          std::string body = co_await conn->read_frame();
          handle(self, conn, peer, std::move(body));
        }
      } catch (const dcomm::error& e) {
        // peer_lost: the client went away; its pending waits end at their deadlines.
        if (e.code() != errc::peer_lost) drop(self, *conn, peer, e.what());
      } catch (const std::system_error&) {
        // The client went away during the handshake.
      } catch (const std::exception& e) {
        drop(self, *conn, peer, e.what());
      }
      conn->close();
    }

    static void drop(const std::shared_ptr<impl>& self, connection& conn, const std::string& peer,
                     const std::string& why) {
      if (!self->stopped)
        detail::log(detail::log_level::warning,
                    "tcp_store server dropped connection from " + peer + ": " + why);
      conn.close();
    }

    // Decodes one request; a malformed one throws protocol_error, which
    // drops this connection only.
    static void handle(const std::shared_ptr<impl>& self, const std::shared_ptr<connection>& conn,
                       const std::string& peer, std::string body) {
      using detail::store_op;
      detail::wire_reader in(body);
      std::uint64_t id = in.u64();
      auto op = static_cast<store_op>(in.u8());
      detail::wire_writer out;
      out.u64(id);
      auto& table = self->table;
      try {
        switch (op) {
          case store_op::set: {
            auto key = in.str();
            auto value = in.str();
            in.expect_end();
            table.set(key, std::move(value));
            out.u8(0);
            break;
          }
          case store_op::get:
          case store_op::wait: {
            auto keys = in.strs();
            auto timeout = std::chrono::milliseconds(in.u64());
            in.expect_end();
            asio::co_spawn(self->strand,
                           answer_wait(self, conn, peer, id, op, std::move(keys), timeout),
                           asio::detached);
            return;
          }
          case store_op::add: {
            auto key = in.str();
            auto delta = in.i64();
            in.expect_end();
            auto value = table.add(key, delta);
            out.u8(0).i64(value);
            break;
          }
          case store_op::compare_set: {
            auto key = in.str();
            auto expected = in.str();
            auto desired = in.str();
            in.expect_end();
            out.u8(0).str(table.compare_set(key, expected, std::move(desired)));
            break;
          }
          case store_op::check: {
            auto keys = in.strs();
            in.expect_end();
            out.u8(0).u8(table.missing(keys).empty() ? 1 : 0);
            break;
          }
          case store_op::delete_key: {
            auto key = in.str();
            in.expect_end();
            out.u8(0).u8(table.erase(key) ? 1 : 0);
            break;
          }
          case store_op::num_keys:
            in.expect_end();
            out.u8(0).i64(table.size());
            break;
          default:
            throw_error(errc::protocol_error,
                        {.operation = "tcp_store request",
                         .detail = "unknown operation " + std::to_string(static_cast<int>(op))});
        }
      } catch (const dcomm::error& e) {
        if (e.code() == errc::protocol_error) throw;
        // A request the store refuses (add on a non-integer): the client
        // gets the error's fields, the connection stays.
        detail::wire_writer refusal;
        refusal.u64(id).u8(static_cast<std::uint8_t>(detail::store_status::error));
        refusal.u8(static_cast<std::uint8_t>(e.code().value()))
            .str(e.context().expected)
            .str(e.context().seen)
            .str(e.context().detail);
        conn->send_frame(std::move(refusal.bytes()));
        return;
      }
      conn->send_frame(std::move(out.bytes()));
    }

    static asio::awaitable<void> answer_wait(std::shared_ptr<impl> self,
                                             std::shared_ptr<connection> conn, std::string peer,
                                             std::uint64_t id, detail::store_op op,
                                             std::vector<std::string> keys,
                                             std::chrono::milliseconds timeout) {
      auto deadline = detail::clock::now() + timeout;
      detail::wire_writer out;
      out.u64(id);
      for (;;) {
        auto missing = co_await self->table.wait_for(keys, deadline);
        if (!missing.empty()) {
          out.u8(static_cast<std::uint8_t>(detail::store_status::timeout)).strs(missing);
          break;
        }
        if (op == detail::store_op::wait) {
          out.u8(0);
          break;
        }
        if (auto value = self->table.get(keys.front())) {  // deleted again in between?
          out.u8(0).str(*value);
          break;
        }
      }
      try {
        conn->send_frame(std::move(out.bytes()));  // nothing once the connection is closed
      } catch (const dcomm::error& e) {
        drop(self, *conn, peer, e.what());  // over the budget
      }
    }
  };

  std::shared_ptr<impl> impl_;
};

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
  std::size_t max_frame_bytes = detail::default_max_frame_bytes;
  // For the hosted server; see tcp_store_server_options.
  std::size_t max_buffered_bytes = detail::default_max_buffered_bytes;
  // For both ends: once a frame (a request, a reply) has begun, the rest must
  // arrive within this. A server that stops in the middle of a reply fails
  // every pending operation with errc::timeout.
  std::chrono::milliseconds frame_timeout = detail::default_frame_timeout;
  int rank = -1;  // ours, for the server's and our own messages
  // The rank whose process hosts the server, where known (rendezvous: 0):
  // losing the server, or failing to reach it, is then blamed on that rank.
  int server_rank = -1;
};

class tcp_store final : public store {
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
  asio::awaitable<void> leave(const dcomm::error& why) {
    if (!server_) co_return;
    co_await server_->notify_leaving(why.context().peers, why.what(),
                                     detail::clock::now() + std::chrono::seconds(1));
  }

  // Connects (with retries until the store's timeout) and authenticates.
  template <completion_token_for Token = default_token_t>
  auto connect(Token&& token = {}) {
    return detail::initiate(strand_, connect_op(shared_self(), detail::clock::now() + timeout()),
                            std::forward<Token>(token), "tcp_store.connect",
                            timeout() + detail::blocking_grace);
  }

  asio::awaitable<void> set_impl(std::string key, std::string value) override {
    detail::wire_writer w;
    w.str(key).str(value);
    co_await request(detail::store_op::set, std::move(w), "tcp_store.set", key,
                     detail::clock::now() + timeout());
  }
  asio::awaitable<std::string> get_impl(std::string key, detail::clock::time_point deadline) override {
    std::vector<std::string> keys(1, key);
    detail::wire_writer w;
    w.strs(keys).u64(remaining_ms(deadline));
    auto reply =
        co_await request(detail::store_op::get, std::move(w), "tcp_store.get", key, deadline);
    co_return decode(reply, "tcp_store.get", key, [](detail::wire_reader& r) { return r.str(); });
  }
  asio::awaitable<std::int64_t> add_impl(std::string key, std::int64_t delta) override {
    detail::wire_writer w;
    w.str(key).i64(delta);
    auto reply = co_await request(detail::store_op::add, std::move(w), "tcp_store.add", key,
                                  detail::clock::now() + timeout());
    co_return decode(reply, "tcp_store.add", key, [](detail::wire_reader& r) { return r.i64(); });
  }
  asio::awaitable<std::string> compare_set_impl(std::string key, std::string expected,
                                                std::string desired) override {
    detail::wire_writer w;
    w.str(key).str(expected).str(desired);
    auto reply = co_await request(detail::store_op::compare_set, std::move(w),
                                  "tcp_store.compare_set", key, detail::clock::now() + timeout());
    co_return decode(reply, "tcp_store.compare_set", key,
                     [](detail::wire_reader& r) { return r.str(); });
  }
  asio::awaitable<void> wait_impl(std::vector<std::string> keys,
                                  detail::clock::time_point deadline) override {
    detail::wire_writer w;
    w.strs(keys).u64(remaining_ms(deadline));
    co_await request(detail::store_op::wait, std::move(w), "tcp_store.wait",
                     detail::join_keys(keys), deadline);
  }
  asio::awaitable<bool> check_impl(std::vector<std::string> keys) override {
    detail::wire_writer w;
    w.strs(keys);
    auto joined = detail::join_keys(keys);
    auto reply = co_await request(detail::store_op::check, std::move(w), "tcp_store.check", joined,
                                  detail::clock::now() + timeout());
    co_return decode(reply, "tcp_store.check", joined,
                     [](detail::wire_reader& r) { return r.u8() != 0; });
  }
  asio::awaitable<bool> delete_key_impl(std::string key) override {
    detail::wire_writer w;
    w.str(key);
    auto reply = co_await request(detail::store_op::delete_key, std::move(w),
                                  "tcp_store.delete_key", key, detail::clock::now() + timeout());
    co_return decode(reply, "tcp_store.delete_key", key,
                     [](detail::wire_reader& r) { return r.u8() != 0; });
  }
  asio::awaitable<std::int64_t> num_keys_impl() override {
    auto reply = co_await request(detail::store_op::num_keys, detail::wire_writer{},
                                  "tcp_store.num_keys", "", detail::clock::now() + timeout());
    co_return decode(reply, "tcp_store.num_keys", "",
                     [](detail::wire_reader& r) { return r.i64(); });
  }

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
      : store(options.timeout),
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
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::clock::now());
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

  static asio::awaitable<void> connect_op(std::shared_ptr<tcp_store> self,
                                          detail::clock::time_point deadline) {
    co_await self->ensure_connected(deadline);
  }

  asio::awaitable<void> ensure_connected(detail::clock::time_point deadline) {
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

  // Connects and authenticates; on success the stream and its reader run.
  asio::awaitable<void> connect_stream(detail::clock::time_point deadline) {
    auto socket =
        co_await detail::connect_with_retry(options_.host, port(), deadline, "tcp_store.connect");
    detail::handshake_config config{.purpose = std::string(detail::store_purpose),
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
    stream_ = std::make_shared<detail::frame_stream>(
        std::move(socket), detail::frame_limits{.max_frame_bytes = options_.max_frame_bytes,
                                                .frame_timeout = options_.frame_timeout});
    asio::co_spawn(strand_, read_loop(std::weak_ptr<tcp_store>(shared_self()), stream_),
                   asio::detached);
  }

  // Holds the store weakly: a store nobody uses any more must be able to die
  // (its destructor closes the stream, which ends this loop).
  static asio::awaitable<void> read_loop(std::weak_ptr<tcp_store> weak,
                                         std::shared_ptr<detail::frame_stream> stream) {
    errc code = errc::peer_lost;
    error_context why;
    try {
      for (;;) {
        std::string body = co_await stream->read_frame();
        auto self = weak.lock();
        if (!self) co_return;
        detail::wire_reader r(body);
        std::uint64_t id = r.u64();
        if (id == detail::notice_id) {
          if (static_cast<detail::store_status>(r.u8()) == detail::store_status::notice) {
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

  // Sends one request and waits for its reply (status byte stripped).
  asio::awaitable<std::string> request(detail::store_op op, detail::wire_writer args,
                                       std::string operation, std::string key,
                                       detail::clock::time_point deadline) {
    // The server would drop the connection, failing every pending operation.
    if (args.bytes().size() + 9 > options_.max_frame_bytes) {
      auto ctx = context(operation, key);
      ctx.expected = "a request of at most " + std::to_string(options_.max_frame_bytes) +
                     " bytes (max_frame_bytes)";
      ctx.seen = std::to_string(args.bytes().size() + 9) + " bytes";
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
    auto status = static_cast<detail::store_status>(decode(
        rest, operation, key, [](detail::wire_reader& r) { return r.u8(); }, false));
    rest.erase(0, 1);
    if (status == detail::store_status::ok) co_return rest;
    if (status == detail::store_status::timeout) {
      auto missing = decode(rest, operation, key, [](detail::wire_reader& r) { return r.strs(); });
      auto ctx = context(operation, detail::join_keys(missing));
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
  std::shared_ptr<detail::frame_stream> stream_;
  std::exception_ptr lost_;
  // The server's notice, if its host left after failing (see notice_id).
  std::string notice_peers_, notice_;
  bool connecting_ = false;
  std::vector<std::shared_ptr<asio::steady_timer>> connect_waiters_;
  std::map<std::uint64_t, std::shared_ptr<pending>> pending_;
  std::uint64_t next_id_ = 1;
};

}  // namespace dcomm
