// The rendezvous socket a launcher opens for rank 0: already listening on a
// free port, so concurrent jobs never race for one. Rank 0 adopts it through
// DCOMM_MASTER_LISTEN_FD (see rank_environment.hpp).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "dcomm/error.hpp"

namespace dcomm::launch {

struct master_socket {
  int fd = -1;             // -1: none (the port was given, another node listens)
  std::uint16_t port = 0;  // MASTER_PORT
};

// A socket listening on addr:0, for rank 0 to adopt. The errors name
// "spawn", as they did before dcomm-run shared this function.
inline master_socket listen_on_free_port(const std::string& addr) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (::inet_pton(AF_INET, addr.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    length = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, addr.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    length = sizeof(sockaddr_in6);
  } else {
    throw_error(errc::invalid_argument, {.operation = "spawn",
                                         .key = "master_addr",
                                         .seen = "'" + addr + "'",
                                         .detail = "must be an IPv4 or IPv6 address"});
  }
  int fd = ::socket(storage.ss_family, SOCK_STREAM, 0);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&storage), length) != 0 ||
      ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0) {
    int err = errno;
    if (fd >= 0) ::close(fd);
    throw_error(errc::invalid_argument,
                {.operation = "spawn",
                 .address = addr,
                 .detail = std::string("cannot listen for the rendezvous: ") + std::strerror(err)});
  }
  auto port = storage.ss_family == AF_INET ? ntohs(v4->sin_port) : ntohs(v6->sin6_port);
  return {fd, port};
}

}  // namespace dcomm::launch
