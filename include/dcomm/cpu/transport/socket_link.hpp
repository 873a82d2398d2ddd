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

}  // namespace dcomm::cpu

// The bodies: header-only everywhere, in the separate-compilation mode
// in the library alone (DCOMM_DECL, detail/asio.hpp).
#if !defined(DCOMM_SEPARATE_COMPILATION) || defined(DCOMM_SOURCE)
#include "dcomm/cpu/transport/impl/socket_link.hpp"
#endif

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::socket_link::read_socket<void>(void* dst, std::size_t n, bool all) -> detail::task<std::size_t>)
// clang-format on
// End of the separate-compilation block.
