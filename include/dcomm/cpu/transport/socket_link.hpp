// A link over one socket of the mesh (cpu/startup/mesh.hpp): frames go out
// several per gathered write and come in through Asio's reads. The
// transport's default kind of link (cpu/transport/link.hpp says what a link
// does; cpu/transport/transport.hpp's make_link who gets which).
#pragma once

#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cstddef>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "dcomm/cpu/transport/link.hpp"
#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/task.hpp"

namespace dcomm::cpu {

class socket_link final : public link {
 public:
  // `ex`: the transport's executor, on which writes complete; frames per
  // gathered write at most `max_batch`, and a payload over `eager_limit`
  // goes on its own.
  socket_link(detail::ip_tcp::socket s, asio::any_io_executor ex, std::size_t max_batch,
              std::size_t eager_limit)
      : link({.carries = transports::tcp}),
        socket_(std::move(s)),
        ex_(std::move(ex)),
        max_batch_(max_batch),
        eager_limit_(eager_limit),
        headers_(max_batch) {
    gather_.reserve(2 * max_batch);
  }

  void write() override;
  std::size_t read_now(void*, std::size_t) override {
    return 0;  // Asio tries the read at once in `read` anyway
  }
  detail::task<std::size_t> read(void* dst, std::size_t n, bool all) override {
    return read_socket(dst, n, all);
  }

  bool open() const override { return socket_.is_open(); }
  void shut_for_sending(const wire_header&) override {
    asio::error_code ignored;
    socket_.shutdown(detail::ip_tcp::socket::shutdown_send, ignored);
  }
  std::size_t unacknowledged() override {
#ifdef TIOCOUTQ
    int n = 0;
    if (::ioctl(socket_.native_handle(), TIOCOUTQ, &n) == 0 && n > 0)
      return static_cast<std::size_t>(n);
#endif
    return 0;
  }
  void close(const wire_header*) override {
    asio::error_code ignored;
    socket_.shutdown(detail::ip_tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  DCOMM_EMIT_ON_USE detail::task<std::size_t> read_socket(void* dst, std::size_t n, bool all);

  detail::ip_tcp::socket socket_;
  asio::any_io_executor ex_;
  std::size_t max_batch_;
  std::size_t eager_limit_;
  // The batch's headers, copied (frames may move while it is written), and
  // the buffers of its gathered write.
  std::vector<wire_header> headers_;
  std::vector<asio::const_buffer> gather_;
  std::size_t batch_bytes_ = 0;
};

// Frames go out in order, several per gathered write; the next batch once
// this one is written (link_events::written, then write_queued).
inline void socket_link::write() {
  send_queue& q = *queue_;
  if (q.batch > 0 || q.frames.empty()) return;
  gather_.clear();
  std::size_t total = 0;
  while (!q.frames.empty() && q.frames.front().cancelled) q.frames.pop_front();
  if (q.frames.empty()) return;
  while (q.batch < q.frames.size() && q.batch < max_batch_) {
    outgoing_frame& f = q.frames[q.batch];
    if (f.cancelled) {
      ++q.batch;  // written as nothing, popped with the batch
      continue;
    }
    wire_header& h = headers_[q.batch] = f.header;
    gather_.push_back(asio::buffer(&h, sizeof h));
    if (f.bytes > 0) gather_.push_back(asio::buffer(f.payload, f.bytes));
    if (f.item) f.item->in_flight = true;
    total += sizeof f.header + f.bytes;
    ++q.batch;
    if (f.bytes > eager_limit_) break;  // a large payload goes on its own
  }
  batch_bytes_ = total;
  // A span, not the vector: the write operation keeps a copy of the
  // sequence, and a copied vector would allocate on every write.
  // Its operation memory from the pool: no allocation per write. The
  // handler keeps the transport, which owns this link, alive.
  detail::with_pooled_handler(
      ex_,
      [keep = owner_->keep_alive(), this](const asio::error_code& ec, std::size_t) {
        keep->written(peer_, queue_->batch, batch_bytes_, ec);
        if (!ec) keep->write_queued(peer_);
      },
      [&](auto handler) {
        asio::async_write(
            socket_, std::span<const asio::const_buffer>(gather_),
            [total](const asio::error_code& ec, std::size_t done) -> std::size_t {
              return ec ? 0 : total - done;
            },
            std::move(handler));
      });
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<std::size_t> socket_link::read_socket(void* dst,
                                                                                std::size_t n,
                                                                                bool all) {
  if (all) {
    auto [ec, got] = co_await asio::async_read(
        socket_, asio::buffer(dst, n),
        [n](const asio::error_code& ec, std::size_t done) -> std::size_t {
          return ec ? 0 : n - done;
        },
        detail::use_task);
    if (ec) throw asio::system_error(ec);
    co_return got;
  }
  auto [ec, got] = co_await socket_.async_read_some(asio::buffer(dst, n), detail::use_task);
  if (ec) throw asio::system_error(ec);
  co_return got;
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::socket_link::read_socket<void>(void* dst, std::size_t n, bool all) -> detail::task<std::size_t>)
// clang-format on
// End of the separate-compilation block.
