// The CPU backend's start: the address this rank advertises, the mesh of
// links to its peers (cpu/startup/mesh.hpp) tuned for bulk transfer, and the
// transport started over them (cpu/transport/transport.hpp).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/cpu/startup/interfaces.hpp"
#include "dcomm/cpu/startup/locality.hpp"
#include "dcomm/cpu/startup/mesh.hpp"
#include "dcomm/cpu/transport/transport.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/shm/handover.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm::cpu {

// The address peers use to reach this rank: `advertise_host` if set, else
// $DCOMM_SOCKET_ADDR, else `bind_host` if it names one interface, else one
// of the interfaces $DCOMM_SOCKET_IFNAME names (cpu/startup/interfaces.hpp), else
// the local address that routes to the store's host, else loopback.
inline std::string advertised_address(const asio::any_io_executor& ex, std::string advertise_host,
                                      const std::string& bind_host, const std::string& store_host) {
  if (advertise_host.empty())
    if (const char* v = std::getenv("DCOMM_SOCKET_ADDR"); v && *v) advertise_host = v;
  if (advertise_host.empty() && !bind_host.empty() && bind_host != "0.0.0.0" && bind_host != "::")
    advertise_host = bind_host;
  if (advertise_host.empty())
    if (const char* v = std::getenv("DCOMM_SOCKET_IFNAME"); v && *v)
      advertise_host = choose_interface_address(local_interfaces(), interface_filter(v),
                                                detail::local_address_towards(ex, store_host));
  if (advertise_host.empty()) advertise_host = detail::local_address_towards(ex, store_host);
  if (advertise_host.empty()) advertise_host = "127.0.0.1";
  return advertise_host;
}

inline void tune_link(detail::ip_tcp::socket& socket) {
  asio::error_code ignored;
  socket.set_option(detail::ip_tcp::no_delay(true), ignored);
  // Generous buffers keep a large message flowing while the receiver is
  // busy reducing the previous chunk.
  socket.set_option(asio::socket_base::send_buffer_size(4 << 20), ignored);
  socket.set_option(asio::socket_base::receive_buffer_size(4 << 20), ignored);
}

// Connects this rank to every peer through the store and starts the
// transport over the links, on the executor it is awaited from.
// Which links go through shared memory, and how.
struct shm_options {
  link_choice links = link_choice::automatic;
  shm::segment_sizes sizes{};  // of the rings and of the arena's slots
  std::string host_id{};       // empty: shm::host_identity()
};

// The sizes, or invalid_argument before anything starts.
inline shm::segment_sizes checked(shm::segment_sizes sizes) {
  if (sizes.ring_bytes < 4096 || (sizes.ring_bytes & (sizes.ring_bytes - 1)) != 0)
    throw_error(errc::invalid_argument,
                {.operation = "cpu_backend",
                 .expected = "shm_ring_bytes: a power of two of at least 4096",
                 .seen = std::to_string(sizes.ring_bytes)});
  if (sizes.slot_bytes == 0 || sizes.slot_bytes % 4096 != 0)
    throw_error(errc::invalid_argument, {.operation = "cpu_backend",
                                         .expected = "shm_slot_bytes: a positive multiple of 4096",
                                         .seen = std::to_string(sizes.slot_bytes)});
  return sizes;
}

// Connects this rank to every peer through the store, shares memory with
// the peers on its host (cpu/startup/locality.hpp, shm/handover.hpp), and starts
// the transport over the links, on the executor it is awaited from.
DCOMM_EMIT_ON_USE asio::awaitable<std::shared_ptr<transport>> connect_transport(
    std::shared_ptr<store> s, int rank, int world, mesh_options mesh, transport_options options,
    detail::clock::time_point deadline, shm_options shm = {}) {
  auto ex = co_await asio::this_coro::executor;
  // The mesh first: once it is complete every rank is known to be alive
  // and to have published its host. The lowest rank of a host then makes
  // the segment and hands it out in the background, without waiting: the
  // rings exist before the others map them. The others fetch it from it.
  const std::string host =
      world > 1 ? host_to_publish(shm.links, rank, shm.host_id) : std::string();
  if (world > 1) co_await publish_host(s, mesh.key_prefix, rank, host);
  auto sockets = co_await connect_mesh(s, rank, world, mesh, deadline);
  for (auto& socket : sockets)
    if (socket.is_open()) tune_link(socket);
  // From here a failure (the store's host died: its reads fail) leaves
  // peers still in their mesh: they hear why, not a bare close that would
  // blame this rank.
  shm_links links;
  peers_published peers{std::vector<int>(static_cast<std::size_t>(world), 0), {}};
  std::exception_ptr failure;
  try {
    if (world > 1) {
      peers = co_await read_peers_published(s, mesh.key_prefix, rank, world, host, deadline);
      links.local = ranks_on_this_host(peers.host_of, rank);
      if (links.local.size() > 1) {
        // Every pair's link goes through the one segment of the host.
        const std::string key = mesh.key_prefix + "/shm/" + std::to_string(links.local.front());
        auto shared =
            co_await shm::host_segment::open(s, key, rank, links.local, shm.sizes, deadline);
        links.segment = shared.get();
        // Polling costs a core: where the host's ranks outnumber this
        // process's cores, a waiting rank gives its core away between
        // looks (sched_yield), so that the ranks with work run (world 4 on
        // 2 cores: small calls 5x faster than sleeping at once).
        if (links.local.size() > shm::usable_cores()) options.shm_yield = true;
      } else {
        links.local.clear();
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    auto [reason, culprit] = mesh_detail::cause_of(failure);
    mesh_detail::say_goodbye(sockets, reason, culprit);
    std::rethrow_exception(failure);
  }
  auto net =
      std::make_shared<transport>(ex, rank, world, std::move(sockets), options, std::move(links),
                                  std::move(peers.host_of), std::move(peers.clock_offsets));
  net->start();
  co_return net;
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::connect_transport<void>(std::shared_ptr<store> s, int rank, int world, mesh_options mesh, transport_options options, detail::clock::time_point deadline, shm_options shm) -> asio::awaitable<std::shared_ptr<transport>>)
// clang-format on
// End of the separate-compilation block.
