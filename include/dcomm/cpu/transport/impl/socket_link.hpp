// socket_link's bodies (cpu/transport/socket_link.hpp).
#pragma once

#include "dcomm/cpu/transport/socket_link.hpp"

namespace dcomm::cpu {

// Frames go out in order, several per gathered write; the next batch once
// this one is written (link_events::written, then write_queued).
DCOMM_DECL void socket_link::write() {
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
