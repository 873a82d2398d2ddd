// A c10d TCPStore in a child process (tests/store/c10d_server.py): torch's
// own (mode "torch", under the Python meson found with torch in
// TORCH_PYTHON) or torch 2's protocol served by the script ("torch2").
// Its commands (set, get, keys) act on the store from the Python side;
// the destructor ends it (its stdin closes), killing it if it lingers.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "dcomm/store/c10d_store.hpp"
#include "support/store_world.hpp"

namespace dcomm::test {

inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

class c10d_server {
 public:
  explicit c10d_server(const std::string& mode) {
    const std::string script = env_or_empty("C10D_SERVER");
    const std::string python =
        mode == "torch" ? env_or_empty("TORCH_PYTHON") : env_or_empty("PYTHON3");
    REQUIRE_MESSAGE(!script.empty(), "C10D_SERVER is not set (run the tests through meson)");
    REQUIRE_MESSAGE(!python.empty(), "no Python for mode ", mode, " (run the tests through meson)");
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::execl(python.c_str(), python.c_str(), script.c_str(), mode.c_str(), nullptr);
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    auto first = line(std::chrono::seconds(60));
    REQUIRE_MESSAGE(first.rfind("port ", 0) == 0, "c10d_server.py ", mode, " said '", first, "'");
    port = static_cast<std::uint16_t>(std::stoi(first.substr(5)));
  }
  c10d_server(const c10d_server&) = delete;
  c10d_server& operator=(const c10d_server&) = delete;
  ~c10d_server() {
    ::close(to_);
    ::close(from_);
    for (int i = 0; i < 100; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
      ::usleep(20000);
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }

  // Sends a command; returns the server's one-line answer.
  std::string command(const std::string& text) {
    std::string all = text + "\n";
    REQUIRE(::write(to_, all.data(), all.size()) == static_cast<ssize_t>(all.size()));
    return line(std::chrono::seconds(30));
  }

  void kill() { ::kill(pid_, SIGKILL); }

  std::uint16_t port = 0;

 private:
  std::string line(std::chrono::milliseconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        auto l = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return l;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      REQUIRE_MESSAGE(left.count() > 0, "c10d_server.py did not answer in time");
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      auto n = ::read(from_, chunk, sizeof chunk);
      REQUIRE_MESSAGE(n != 0, "c10d_server.py ended");
      if (n > 0) buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }

  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buffer_;
};

// The store contract's world (store_world.hpp) over one c10d server, each
// handle under the same prefix as torchrun's workers.
struct c10d_world final : store_world {
  explicit c10d_world(const std::string& mode) : server(mode) {}
  std::shared_ptr<store> handle(asio::any_io_executor ex) override {
    return c10d_store::create(std::move(ex), {.port = server.port, .prefix = "/worker/attempt_0/"});
  }
  c10d_server server;
};

}  // namespace dcomm::test
