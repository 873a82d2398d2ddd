// What connect_mesh (cpu/startup/mesh.hpp) takes and what it gives: its options, and
// the sockets of the mesh. On their own so that the accepting side
// (cpu/startup/mesh_acceptance.hpp) and the transport can name them.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "dcomm/detail/socket.hpp"

namespace dcomm::cpu {

struct mesh_options {
  std::string purpose = "tcp_backend";
  std::string job_token{};
  // Where to listen; empty: every interface (IPv6 and IPv4).
  std::string bind_host = "";
  // The address the other ranks use to reach this one.
  std::string advertise_host = "127.0.0.1";
  std::string key_prefix = "dcomm/mesh";
  // How long one incoming connection may take over its handshake (never
  // past the overall deadline). A real peer needs one round trip.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(5);
  // Incoming handshakes in flight at once; beyond it the oldest is dropped.
  std::size_t max_pending_handshakes = 64;
};

// sockets[p] is connected to rank p; sockets[rank] stays closed.
using mesh_sockets = std::vector<detail::ip_tcp::socket>;

}  // namespace dcomm::cpu
