// Reading what a peer publishes in the store at start-up (its mesh
// address, its host): the one way such a read fails, shared by
// cpu/startup/mesh.hpp and cpu/startup/locality.hpp.
#pragma once

#include <cstdlib>
#include <exception>
#include <string>

#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"

namespace dcomm::cpu {

// Rethrows `failure`, a failed read of `key` (rank `peer`'s `what`), as the
// dcomm::error of `operation` on `rank`: a timeout blames the peer (it
// never published: it died, or never started); a store that failed names
// whom it names.
[[noreturn]] inline void rethrow_unpublished(std::exception_ptr failure, const char* operation,
                                             int rank, int peer, const std::string& key,
                                             const char* what) {
  try {
    detail::rethrow_as_dcomm_error(failure, {});
  } catch (const dcomm::error& e) {
    const bool late = e.code() == errc::timeout;
    throw error(e.code(),
                {.operation = operation,
                 .rank = rank,
                 .peers = late || e.context().peers.empty() ? "rank " + std::to_string(peer)
                                                            : e.context().peers,
                 .key = key,
                 .address = e.context().address,
                 .detail = late ? "rank " + std::to_string(peer) + " did not publish its " + what +
                                      " by the deadline"
                                : std::string("reading its ") + what + ": " + e.what()});
  }
  std::abort();  // not reached: the block above always throws
}

}  // namespace dcomm::cpu
