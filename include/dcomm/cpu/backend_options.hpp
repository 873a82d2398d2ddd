// The CPU backend's options (cpu_backend::options): where it listens, its
// algorithms' thresholds, and its shared memory. Those an environment
// variable sets read it by default, as torch's do.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <string>

#include "dcomm/option_string.hpp"

namespace dcomm::cpu {

// Every member is trivially destructible (text in option_string), so that
// options holding these can be a braced temporary in a co_await on g++ 12.
struct backend_options {
  // Where this rank listens for its peers; empty: every interface.
  option_string bind_host = "";
  // The address peers use to reach this rank. Empty: $DCOMM_SOCKET_ADDR,
  // else the local address that routes to the store's host.
  option_string advertise_host = "";
  // Messages up to this size are sent at once; larger ones wait until
  // the receiver has posted its buffer, and land in it directly.
  std::size_t eager_limit = 64 * 1024;
  // The pipelining unit of the ring and chain algorithms.
  std::size_t chunk_bytes = 512 * 1024;
  // Up to these sizes (bytes) an op runs its small algorithm, above them
  // its large one; the table in cpu/algorithms/dispatch.hpp says which op
  // reads which (reduce reads small_broadcast). The defaults: docs/performance.md,
  // "The thresholds".
  std::size_t small_all_reduce = 64 * 1024;
  std::size_t small_broadcast = 256 * 1024;
  std::size_t small_all_gather = 64 * 1024;
  std::size_t small_reduce_scatter = 64 * 1024;
  // CUDA tensors larger than this go slice by slice in send, recv,
  // broadcast, reduce and all_reduce, their copies to and from the device
  // overlapped with the network; the other operations stage them whole.
  // A collective's ranks must agree: the same kind of tensor (host or
  // CUDA) and the same staging_slice, else the call fails with
  // errc::mismatch. Send and recv need not: slices are not seen on the wire.
  std::size_t staging_slice = 4 * 1024 * 1024;
  // Rooted operations (broadcast, reduce, scatter, gather) confirm that
  // every rank made the same call before any rank returns (a
  // dissemination of empty messages, log2(n) rounds beside the algorithm;
  // docs/communicator.md). Off: a root that only sends returns at once, as
  // in MPI, and a rank whose call differs is caught only where messages
  // arrive. Every rank must agree (else errc::mismatch).
  bool confirm_rooted = true;
  // Per-operation algorithm overrides, "all_reduce=ring,broadcast=chain".
  option_string algorithms = std::getenv("DCOMM_ALGO");
  // The links between ranks of one host: "auto" (shared memory; TCP
  // between hosts), "shm" (the same, and a rank that cannot tell its host
  // fails at start-up) or "tcp" (loopback sockets). A pair of ranks uses
  // shared memory only if neither says "tcp". Empty: "auto". The default
  // is $DCOMM_TRANSPORT where set.
  option_string transport = [] {
    const char* v = std::getenv("DCOMM_TRANSPORT");
    return option_string(v ? v : "auto");
  }();
  // Which host this rank counts as for shared memory; empty: what the
  // kernel says (shm/host_identity.hpp), or $DCOMM_HOST_ID. Ranks with
  // different ids talk TCP: tests make one machine play several hosts.
  option_string host_id = "";
  // Each shared memory link's ring, per direction (a power of two).
  std::size_t shm_ring_bytes = 1 << 20;
  // Each of a rank's two slots in an arena, where the collectives
  // of a group on one host meet (a multiple of 4096): what one step of
  // an operation moves per rank.
  std::size_t shm_slot_bytes = 256 * 1024;
  // Messages above eager_limit to a rank of this host: the receiver reads
  // them from the sender's buffer (process_vm_readv, one copy instead of
  // two through the ring) where the kernel allows; likewise an all_reduce
  // of 1-16 MiB among a host's ranks, where that is the faster way
  // (cpu/algorithms/dispatch.hpp: in place from 4 MiB, a core each).
  // On unless $DCOMM_SHM_SINGLE_COPY is 0. Which way is faster depends on
  // the machine: process_vm_readv's speed against memcpy's
  // (docs/communicator.md gives two machines' figures: measure yours).
  bool shm_single_copy = [] {
    const char* v = std::getenv("DCOMM_SHM_SINGLE_COPY");
    return !(v && std::string(v) == "0");
  }();
  // A lost peer or a timeout revokes the failed call's group on its own
  // (communicator::revoke), so that every member's pending and later calls
  // of it, and of the groups made from it, fail at once with errc::revoked,
  // not only the calls that needed the rank; on where $DCOMM_REVOKE_ON_FAILURE
  // is 1. For programs that recover (agree, shrink: docs/elastic.md).
  bool revoke_on_failure = [] {
    const char* v = std::getenv("DCOMM_REVOKE_ON_FAILURE");
    return v && std::string(v) == "1";
  }();
  // How long a waiting operation polls shared memory before it sleeps
  // (a system call to wake it then); $DCOMM_SHM_SPIN_US if set. Polling
  // stops where the ranks of the host outnumber the cores this process
  // may use.
  std::chrono::nanoseconds shm_spin = [] {
    const char* v = std::getenv("DCOMM_SHM_SPIN_US");
    return std::chrono::nanoseconds(std::chrono::microseconds(v && *v ? std::atol(v) : 20));
  }();
};

}  // namespace dcomm::cpu
