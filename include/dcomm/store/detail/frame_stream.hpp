// The framed connection under tcp_store, on both of its ends: u32 length +
// body, an ordered outgoing queue, and the limits that keep a hostile or
// stalled peer from holding memory or a connection for ever (a size limit
// per frame, a deadline per frame once it has begun, and a server-wide
// budget for the bytes of frames in flight).
//
// Every header in store/detail/ uses namespace dcomm::store_detail: the
// store component's internals, apart from dcomm::detail (the ground floor,
// dcomm/detail/). Not dcomm::store::detail: dcomm::store is the class.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "dcomm/completion.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"

namespace dcomm::store_detail {

inline constexpr std::size_t default_max_frame_bytes = std::size_t{64} << 20;
inline constexpr std::size_t default_max_buffered_bytes = std::size_t{256} << 20;
inline constexpr std::chrono::milliseconds default_frame_timeout = std::chrono::seconds(30);

// Bytes a tcp_store server holds for frames in flight, across all its
// connections: the bodies it is receiving and the replies queued to send.
// Bounded, so that peers announcing huge frames, or asking for big values
// without reading the replies, cannot take the process's memory. Used on the
// server's strand only.
class frame_budget {
 public:
  explicit frame_budget(std::size_t limit) noexcept : limit_(limit) {}
  bool try_take(std::size_t n) noexcept {
    if (n > limit_ - used_) return false;
    used_ += n;
    return true;
  }
  void give_back(std::size_t n) noexcept { used_ -= n; }
  std::size_t used() const noexcept { return used_; }
  std::size_t limit() const noexcept { return limit_; }

 private:
  std::size_t limit_;
  std::size_t used_ = 0;
};

struct frame_limits {
  std::size_t max_frame_bytes = default_max_frame_bytes;
  // Once a frame's first byte is in, the rest must arrive within this (zero:
  // no limit). Between frames a connection may idle for ever.
  detail::clock::duration frame_timeout = default_frame_timeout;
  std::shared_ptr<frame_budget> budget{};  // null: unbounded (a client's own connection)
};

// One framed TCP connection with an ordered outgoing queue, used by both
// ends of the store protocol. Lives on one strand.
//
// Failures are dcomm::errors: peer_lost (the socket broke), protocol_error
// (a frame over a limit), timeout (a frame cut short, then silence).
class frame_stream : public std::enable_shared_from_this<frame_stream> {
 public:
  frame_stream(detail::ip_tcp::socket socket, frame_limits limits)
      : socket_(std::move(socket)), limits_(std::move(limits)) {}
  frame_stream(const frame_stream&) = delete;
  frame_stream& operator=(const frame_stream&) = delete;
  ~frame_stream() {
    if (watch_timer_) watch_timer_->cancel();
    give_back(held_);
  }

  detail::ip_tcp::socket& socket() noexcept { return socket_; }
  // Nothing queued or being written (or closed).
  bool flushed() const noexcept { return closed_ || (!writing_ && outbox_.empty()); }

  // Reads one frame body. Its memory grows with the bytes that arrive, not
  // with the length the peer announces.
  DCOMM_EMIT_ON_USE asio::awaitable<std::string> read_frame();

  // Queues a frame; frames go out in the order they were queued. Throws if
  // the frame would take the server over its budget; does nothing once the
  // stream is closed.
  void send_frame(std::string body) {
    if (closed_) return;
    take(4 + body.size(), "a reply of " + std::to_string(body.size()) + " bytes");
    outgoing frame{{}, std::move(body)};
    for (std::size_t i = 0; i < 4; ++i)
      frame.header[i] = static_cast<unsigned char>((frame.body.size() >> (8 * i)) & 0xff);
    outbox_.push_back(std::move(frame));
    if (!writing_) {
      writing_ = true;
      asio::co_spawn(socket_.get_executor(), write_loop(shared_from_this()), asio::detached);
    }
  }

  // Safe at any time, also under a read or a write in flight: those end
  // with an error, and they own the bytes they are moving.
  void close() {
    if (closed_) return;
    closed_ = true;
    asio::error_code ignored;
    socket_.shutdown(detail::ip_tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    if (watch_timer_) watch_timer_->cancel();
    for (auto& frame : outbox_) give_back(4 + frame.body.size());
    outbox_.clear();
    give_back(inbound_);  // the reader frees the body as it fails
    inbound_ = 0;
  }

 private:
  struct outgoing {
    std::array<unsigned char, 4> header;
    std::string body;
  };
  static constexpr std::size_t first_piece = std::size_t{64} << 10;

  // Closes, recording why: the reader reports it.
  void fail(error why) {
    if (closed_) return;
    failure_ = std::make_exception_ptr(std::move(why));
    close();
  }

  void take(std::size_t n, const std::string& what) {
    if (limits_.budget && !limits_.budget->try_take(n))
      throw_error(
          errc::protocol_error,
          {.operation = "tcp_store frame",
           .detail = what + " needs " + std::to_string(n) +
                     " more bytes, but the server already holds " +
                     std::to_string(limits_.budget->used()) + " of max_buffered_bytes (" +
                     std::to_string(limits_.budget->limit()) + ") for frames in flight; refused"});
    held_ += n;
  }
  void give_back(std::size_t n) noexcept {
    if (limits_.budget) limits_.budget->give_back(n);
    held_ -= n;
  }

  void end_failed_read() {
    in_frame_ = false;
    give_back(inbound_);
    inbound_ = 0;
  }

  void begin_frame() {
    in_frame_ = true;
    frame_length_ = 0;
    if (limits_.frame_timeout <= detail::clock::duration::zero()) return;
    frame_deadline_ = detail::clock::now() + limits_.frame_timeout;
    extended_ = false;
    if (!watch_timer_) {
      watch_timer_ = std::make_shared<asio::steady_timer>(socket_.get_executor(), frame_deadline_);
      asio::co_spawn(socket_.get_executor(), watch(weak_from_this(), watch_timer_), asio::detached);
    }
  }

  // One timer per connection, not one per frame: it wakes at the deadline
  // of the frame in progress, or polls every frame_timeout while idle.
  DCOMM_EMIT_ON_USE static asio::awaitable<void> watch(std::weak_ptr<frame_stream> weak,
                                                       std::shared_ptr<asio::steady_timer> timer);

  std::string stalled_frame() const {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(limits_.frame_timeout);
    return (frame_length_ ? "a frame of " + std::to_string(frame_length_) + " bytes"
                          : std::string("a frame header")) +
           " began but did not complete within frame_timeout (" + std::to_string(ms.count()) +
           " ms)";
  }

  DCOMM_EMIT_ON_USE static asio::awaitable<void> write_loop(std::shared_ptr<frame_stream> self);

  detail::ip_tcp::socket socket_;
  frame_limits limits_;
  std::deque<outgoing> outbox_;
  bool writing_ = false;
  bool closed_ = false;
  std::exception_ptr failure_;  // why this side closed, for the reader
  std::size_t held_ = 0;        // taken from the budget: inbound_ + queued + in flight
  std::size_t inbound_ = 0;     // the body being read, or the last one returned
  // The frame being read, for its deadline.
  bool in_frame_ = false;
  bool extended_ = false;
  std::size_t frame_length_ = 0;
  detail::clock::time_point frame_deadline_{};
  std::shared_ptr<asio::steady_timer> watch_timer_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto frame_stream::read_frame() -> asio::awaitable<std::string> {
  give_back(inbound_);  // the previous frame has been handled
  inbound_ = 0;
  try {
    std::array<unsigned char, 4> header{};
    // Waits as long as it takes: idle time between frames is the peer's.
    std::size_t got = co_await socket_.async_read_some(asio::buffer(header), asio::use_awaitable);
    begin_frame();
    if (got < header.size())
      co_await asio::async_read(socket_, asio::buffer(header.data() + got, header.size() - got),
                                asio::use_awaitable);
    frame_length_ = static_cast<std::size_t>(header[0]) | static_cast<std::size_t>(header[1]) << 8 |
                    static_cast<std::size_t>(header[2]) << 16 |
                    static_cast<std::size_t>(header[3]) << 24;
    if (frame_length_ > limits_.max_frame_bytes)
      throw_error(errc::protocol_error,
                  {.operation = "read frame",
                   .expected = "a frame of at most " + std::to_string(limits_.max_frame_bytes) +
                               " bytes (max_frame_bytes)",
                   .seen = std::to_string(frame_length_) + " bytes"});
    std::string body;
    std::size_t have = 0;
    while (have < frame_length_) {
      if (have == body.size()) {  // full: double it, up to the announced length
        std::size_t size = std::min(frame_length_, std::max(first_piece, 2 * body.size()));
        take(size - body.size(), "a frame of " + std::to_string(frame_length_) + " bytes");
        inbound_ += size - body.size();
        body.resize(size);
      }
      have += co_await asio::async_read(
          socket_, asio::buffer(body.data() + have, body.size() - have), asio::use_awaitable);
    }
    in_frame_ = false;
    co_return body;
  } catch (const dcomm::error&) {
    end_failed_read();
    throw;
  } catch (const std::system_error& e) {
    end_failed_read();
    if (failure_) std::rethrow_exception(failure_);
    throw_error(errc::peer_lost, {.operation = "read frame", .detail = e.code().message()});
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto frame_stream::watch(std::weak_ptr<frame_stream> weak,
                                                      std::shared_ptr<asio::steady_timer> timer)
    -> asio::awaitable<void> {
  for (;;) {
    asio::error_code ec;
    co_await timer->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    auto self = weak.lock();
    if (!self || self->closed_) co_return;
    auto now = detail::clock::now();
    if (self->in_frame_ && now >= self->frame_deadline_) {
      // Bytes waiting unread mean the reader is behind (its executor did
      // not run for a while), not that the peer went silent: once per
      // frame, that earns another frame_timeout.
      if (self->extended_ || self->socket_.available(ec) == 0 || ec) {
        self->fail(
            error(errc::timeout, {.operation = "read frame", .detail = self->stalled_frame()}));
        co_return;
      }
      self->extended_ = true;
      self->frame_deadline_ = now + self->limits_.frame_timeout;
    }
    timer->expires_at(self->in_frame_ ? self->frame_deadline_ : now + self->limits_.frame_timeout);
  }
}

DCOMM_EMIT_ON_USE_DEFINITION auto frame_stream::write_loop(std::shared_ptr<frame_stream> self)
    -> asio::awaitable<void> {
  while (!self->closed_ && !self->outbox_.empty()) {
    // Out of the queue before the write: close() may clear the queue
    // while the write is in flight, and the bytes under it must stay.
    outgoing frame = std::move(self->outbox_.front());
    self->outbox_.pop_front();
    std::array<asio::const_buffer, 2> buffers{asio::buffer(frame.header), asio::buffer(frame.body)};
    asio::error_code ec;
    co_await asio::async_write(self->socket_, buffers,
                               asio::redirect_error(asio::use_awaitable, ec));
    self->give_back(4 + frame.body.size());
    if (ec) self->fail(error(errc::peer_lost, {.operation = "send frame", .detail = ec.message()}));
  }
  self->writing_ = false;
}

}  // namespace dcomm::store_detail

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::store_detail::frame_stream::read_frame<void>() -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::store_detail::frame_stream::watch<void>(std::weak_ptr<frame_stream> weak, std::shared_ptr<asio::steady_timer> timer) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::store_detail::frame_stream::write_loop<void>(std::shared_ptr<frame_stream> self) -> asio::awaitable<void>)
// clang-format on
// End of the separate-compilation block.
