// Plain blocking sockets that speak just enough of dcomm's store protocol to
// misbehave on purpose (fake servers, clients that stop mid-frame), and the
// means to watch the other side: did it close the connection, how much
// memory does its process hold, what did it log.
#pragma once

#include <poll.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>

#include "dcomm/detail/handshake.hpp"
#include "dcomm/store/tcp_store.hpp"

namespace dcomm::test {

using asio::ip::tcp;
using namespace std::chrono_literals;

// A connection to 127.0.0.1:port that has passed the store handshake
// (no token), for sending hand-made frames.
struct raw_client {
  explicit raw_client(std::uint16_t port) {
    socket.connect({asio::ip::make_address("127.0.0.1"), port});
    detail::handshake_config config{.purpose = "store"};
    sync_wait(context, detail::client_handshake(socket, config, "test",
                                                std::chrono::steady_clock::now() + 10s));
  }
  // "tcp://127.0.0.1:port" as the server names this connection.
  std::string address() const { return detail::endpoint_address(socket.local_endpoint()); }
  // False if the server has closed the connection.
  bool send(const std::string& bytes) {
    asio::error_code ec;
    asio::write(socket, asio::buffer(bytes), ec);
    return !ec;
  }
  asio::io_context context;
  tcp::socket socket{context};
};

// The server side of the handshake, on a socket of `context`.
inline void accept_handshake(asio::io_context& context, tcp::socket& socket) {
  detail::handshake_config config{.purpose = "store"};
  sync_wait(context, [&]() -> asio::awaitable<void> {
    co_await detail::server_handshake(socket, config, "test",
                                      std::chrono::steady_clock::now() + 10s);
  }());
}

// u32 length + body, as frame_stream writes them.
inline std::string frame(const std::string& body, std::uint32_t announced) {
  detail::wire_writer w;
  w.u32(announced).raw(body);
  return std::move(w.bytes());
}
inline std::string frame(const std::string& body) {
  return frame(body, static_cast<std::uint32_t>(body.size()));
}

// A store request's body: id, operation, arguments.
inline std::string request(std::uint64_t id, store_detail::store_op op, detail::wire_writer args) {
  detail::wire_writer w;
  w.u64(id).u8(static_cast<std::uint8_t>(op)).raw(args.bytes());
  return std::move(w.bytes());
}

// Reads one frame's body.
inline std::string read_frame(tcp::socket& socket) {
  std::array<unsigned char, 4> header{};
  asio::read(socket, asio::buffer(header));
  std::uint32_t length =
      header[0] | header[1] << 8 | header[2] << 16 | static_cast<std::uint32_t>(header[3]) << 24;
  std::string body(length, '\0');
  asio::read(socket, asio::buffer(body));
  return body;
}

// Whether the peer closes the connection (end of file or reset) within
// `limit`; whatever it sends meanwhile is read and dropped.
inline bool closed_within(tcp::socket& socket, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  std::array<char, 1 << 16> buffer{};
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{socket.native_handle(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    auto n = ::recv(socket.native_handle(), buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
  }
}

// A process's resident memory in KiB (VmRSS in /proc/<pid>/status).
inline long resident_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

// Captures what this process writes to stderr (dcomm's log) while alive.
class stderr_capture {
 public:
  stderr_capture() : file_(std::tmpfile()) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    ::dup2(::fileno(file_), 2);
  }
  stderr_capture(const stderr_capture&) = delete;
  stderr_capture& operator=(const stderr_capture&) = delete;
  ~stderr_capture() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    std::fclose(file_);
  }
  std::string text() {
    std::fflush(stderr);
    std::string out;
    std::array<char, 4096> buffer{};
    auto end = ::lseek(::fileno(file_), 0, SEEK_END);
    for (off_t at = 0; at < end;) {
      auto n = ::pread(::fileno(file_), buffer.data(), buffer.size(), at);
      if (n <= 0) break;
      out.append(buffer.data(), static_cast<std::size_t>(n));
      at += n;
    }
    return out;
  }

 private:
  std::FILE* file_;
  int saved_ = -1;
};

}  // namespace dcomm::test
