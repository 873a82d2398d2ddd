// The server of a tcp_store (c10d's TCPStore's server): hosted in rank 0's
// process by a tcp_store with is_server set, or started on its own.
//
// It runs on a strand, holds the table (dcomm/detail/kv_table.hpp) and
// answers requests as the protocol says (store/detail/tcp_store_protocol.hpp).
// Many requests may be in flight on one connection: a get or wait is
// answered when its keys exist or at its deadline, which the server enforces,
// and the requests behind it do not wait for it. A frame over a limit (size,
// the server's budget for frames in flight, the deadline of a frame begun;
// see store/detail/frame_stream.hpp) or one that does not decode closes that
// connection only: the server and all other clients carry on.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/handshake.hpp"
#include "dcomm/detail/kv_table.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/wire.hpp"
#include "dcomm/error.hpp"
#include "dcomm/store/detail/frame_stream.hpp"
#include "dcomm/store/detail/tcp_store_protocol.hpp"

namespace dcomm {

struct tcp_store_server_options {
  // Address to listen on; empty: every interface, IPv6 and IPv4 (as c10d).
  std::string bind_host = "";
  std::uint16_t port = 0;  // 0: the system picks; read it back with port()
  // An already-bound listening socket to adopt (a launcher that picked the
  // port); the server takes ownership. -1: bind bind_host:port.
  int listen_fd = -1;
  std::string job_token = detail::job_token_from_environment();
  std::size_t max_frame_bytes = store_detail::default_max_frame_bytes;
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
  // Bytes held for frames in flight (bodies being received, replies queued
  // to send) across all connections; a connection whose frame would take the
  // server over it is dropped.
  std::size_t max_buffered_bytes = store_detail::default_max_buffered_bytes;
  // Once a frame has begun, the rest must arrive within this, or its
  // connection is dropped. Idle time between frames is unlimited.
  std::chrono::milliseconds frame_timeout = store_detail::default_frame_timeout;
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
  DCOMM_EMIT_ON_USE asio::awaitable<void> notify_leaving(std::string peers, std::string detail,
                                                         detail::clock::time_point deadline);

 private:
  struct impl;
  using connection = store_detail::frame_stream;

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
          limits{
              .max_frame_bytes = options.max_frame_bytes,
              .frame_timeout = options.frame_timeout,
              .budget = std::make_shared<store_detail::frame_budget>(options.max_buffered_bytes)} {}

    asio::strand<asio::any_io_executor> strand;
    detail::ip_tcp::acceptor acceptor;
    tcp_store_server_options options;
    store_detail::frame_limits limits;
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

    DCOMM_EMIT_ON_USE static asio::awaitable<void> notify_op(std::shared_ptr<impl> self,
                                                             std::string peers, std::string detail,
                                                             detail::clock::time_point deadline);

    DCOMM_EMIT_ON_USE static asio::awaitable<void> accept_loop(std::shared_ptr<impl> self);

    DCOMM_EMIT_ON_USE static asio::awaitable<void> serve(std::shared_ptr<impl> self,
                                                         std::shared_ptr<connection> conn);

    static void drop(const std::shared_ptr<impl>& self, connection& conn, const std::string& peer,
                     const std::string& why) {
      if (!self->stopped)
        detail::log(detail::log_level::warning,
                    "tcp_store server dropped connection from " + peer + ": " + why);
      conn.close();
    }

    // Decodes one request and answers it; a malformed one throws
    // protocol_error, which drops this connection only.
    static void handle(const std::shared_ptr<impl>& self, const std::shared_ptr<connection>& conn,
                       const std::string& peer, std::string body) {
      detail::wire_reader in(body);
      std::uint64_t id = in.u64();
      auto op = static_cast<store_detail::store_op>(in.u8());
      detail::wire_writer out;
      out.u64(id);
      try {
        if (!execute(self, conn, peer, id, op, in, out)) return;  // answered later
      } catch (const dcomm::error& e) {
        if (e.code() == errc::protocol_error) throw;
        // A request the store refuses (add on a non-integer): the client
        // gets the error's fields, the connection stays.
        conn->send_frame(refusal(id, e));
        return;
      }
      conn->send_frame(std::move(out.bytes()));
    }

    // Carries out request `id`, writing its status and results to `out`
    // (after the id). False for a get or a wait, which answer_wait answers
    // once the keys exist or at the deadline.
    static bool execute(const std::shared_ptr<impl>& self, const std::shared_ptr<connection>& conn,
                        const std::string& peer, std::uint64_t id, store_detail::store_op op,
                        detail::wire_reader& in, detail::wire_writer& out) {
      using store_detail::store_op;
      auto& table = self->table;
      switch (op) {
        case store_op::set: {
          auto key = in.str();
          auto value = in.str();
          in.expect_end();
          table.set(key, std::move(value));
          out.u8(0);
          return true;
        }
        case store_op::get:
        case store_op::wait: {
          auto keys = in.strs();
          auto timeout = std::chrono::milliseconds(in.u64());
          in.expect_end();
          asio::co_spawn(self->strand,
                         answer_wait(self, conn, peer, id, op, std::move(keys), timeout),
                         asio::detached);
          return false;
        }
        case store_op::add: {
          auto key = in.str();
          auto delta = in.i64();
          in.expect_end();
          auto value = table.add(key, delta);
          out.u8(0).i64(value);
          return true;
        }
        case store_op::compare_set: {
          auto key = in.str();
          auto expected = in.str();
          auto desired = in.str();
          in.expect_end();
          out.u8(0).str(table.compare_set(key, expected, std::move(desired)));
          return true;
        }
        case store_op::check: {
          auto keys = in.strs();
          in.expect_end();
          out.u8(0).u8(table.missing(keys).empty() ? 1 : 0);
          return true;
        }
        case store_op::delete_key: {
          auto key = in.str();
          in.expect_end();
          out.u8(0).u8(table.erase(key) ? 1 : 0);
          return true;
        }
        case store_op::num_keys:
          in.expect_end();
          out.u8(0).i64(table.size());
          return true;
        default:
          throw_error(errc::protocol_error,
                      {.operation = "tcp_store request",
                       .detail = "unknown operation " + std::to_string(static_cast<int>(op))});
      }
    }

    // The reply to a request the store refused: the error's fields.
    static std::string refusal(std::uint64_t id, const dcomm::error& e) {
      detail::wire_writer w;
      w.u64(id).u8(static_cast<std::uint8_t>(store_detail::store_status::error));
      w.u8(static_cast<std::uint8_t>(e.code().value()))
          .str(e.context().expected)
          .str(e.context().seen)
          .str(e.context().detail);
      return std::move(w.bytes());
    }

    DCOMM_EMIT_ON_USE static asio::awaitable<void> answer_wait(std::shared_ptr<impl> self,
                                                               std::shared_ptr<connection> conn,
                                                               std::string peer, std::uint64_t id,
                                                               store_detail::store_op op,
                                                               std::vector<std::string> keys,
                                                               std::chrono::milliseconds timeout);
  };

  std::shared_ptr<impl> impl_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store_server::notify_leaving(
    std::string peers, std::string detail, detail::clock::time_point deadline)
    -> asio::awaitable<void> {
  co_await asio::co_spawn(impl_->strand,
                          impl::notify_op(impl_, std::move(peers), std::move(detail), deadline),
                          asio::use_awaitable);
}

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store_server::impl::notify_op(
    std::shared_ptr<impl> self, std::string peers, std::string detail,
    detail::clock::time_point deadline) -> asio::awaitable<void> {
  detail::wire_writer notice;
  notice.u64(store_detail::notice_id)
      .u8(static_cast<std::uint8_t>(store_detail::store_status::notice))
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

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store_server::impl::accept_loop(std::shared_ptr<impl> self)
    -> asio::awaitable<void> {
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

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store_server::impl::serve(std::shared_ptr<impl> self,
                                                                std::shared_ptr<connection> conn)
    -> asio::awaitable<void> {
  asio::error_code ec;
  auto endpoint = conn->socket().remote_endpoint(ec);
  std::string peer = ec ? "an unknown peer" : detail::endpoint_address(endpoint);
  try {
    conn->socket().set_option(detail::ip_tcp::no_delay(true), ec);
    detail::handshake_config config{.purpose = std::string(store_detail::store_purpose),
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

DCOMM_EMIT_ON_USE_DEFINITION auto tcp_store_server::impl::answer_wait(
    std::shared_ptr<impl> self, std::shared_ptr<connection> conn, std::string peer,
    std::uint64_t id, store_detail::store_op op, std::vector<std::string> keys,
    std::chrono::milliseconds timeout) -> asio::awaitable<void> {
  auto deadline = detail::clock::now() + timeout;
  detail::wire_writer out;
  out.u64(id);
  for (;;) {
    auto missing = co_await self->table.wait_for(keys, deadline);
    if (!missing.empty()) {
      out.u8(static_cast<std::uint8_t>(store_detail::store_status::timeout)).strs(missing);
      break;
    }
    if (op == store_detail::store_op::wait) {
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

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::tcp_store_server::notify_leaving<void>(std::string peers, std::string detail, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store_server::impl::notify_op<void>(std::shared_ptr<impl> self, std::string peers, std::string detail, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store_server::impl::accept_loop<void>(std::shared_ptr<impl> self) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store_server::impl::serve<void>(std::shared_ptr<impl> self, std::shared_ptr<connection> conn) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::tcp_store_server::impl::answer_wait<void>(std::shared_ptr<impl> self, std::shared_ptr<connection> conn, std::string peer, std::uint64_t id, store_detail::store_op op, std::vector<std::string> keys, std::chrono::milliseconds timeout) -> asio::awaitable<void>)
// clang-format on
// End of the separate-compilation block.
