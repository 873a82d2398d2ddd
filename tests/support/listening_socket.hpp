// Ports for multi-process tests, without races: a socket bound to port 0
// before fork, which rank 0 adopts (DCOMM_MASTER_LISTEN_FD / listen_fd)
// while the others connect to its port.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <string>

#include "dcomm/detail/asio.hpp"

namespace dcomm::test {

struct listening_socket {
  explicit listening_socket(const char* host = "127.0.0.1") {
    auto address = asio::ip::make_address(host);
    acceptor.open(asio::ip::tcp::endpoint(address, 0).protocol());
    acceptor.bind({address, 0});
    acceptor.listen();
    port = acceptor.local_endpoint().port();
  }
  int fd() { return acceptor.native_handle(); }
  asio::io_context ctx;
  asio::ip::tcp::acceptor acceptor{ctx};
  std::uint16_t port = 0;
};

// env:// for a forked `rank` of `world` meeting at `master`'s port on
// 127.0.0.1 (rank 0 adopts the socket).
inline void set_rank_environment(listening_socket& master, int rank, int world) {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(master.port).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  if (rank == 0) ::setenv("DCOMM_MASTER_LISTEN_FD", std::to_string(master.fd()).c_str(), 1);
}

// A port nothing listens on right now (for tests of late or absent servers).
inline std::uint16_t free_port() {
  return listening_socket().port;
}

}  // namespace dcomm::test
