// dcomm::spawn: the PyTorch tutorial's mp.spawn in C++. Forks n ranks on this
// host, each with the env:// variables of a private rendezvous
// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
// runs fn(rank, world_size) in each, and waits for all of them.
//
//   dcomm::spawn(4, [](int rank, int world_size) {
//     auto world = dcomm::rendezvous({.init_method = "env://"});
//     ...
//   });
//
// Rank 0 inherits a socket already listening on a free port
// (DCOMM_MASTER_LISTEN_FD), so concurrent jobs never race for a port. When a
// rank fails (exception, non-zero exit, signal), the others are stopped
// (SIGTERM, then SIGKILL after a grace period) and spawn throws
// errc::rank_failed naming the rank, how it ended and its exception message.
//
// The job is authenticated by default: the ranks share a fresh random
// DCOMM_JOB_TOKEN (unless one is set already, or this build has no OpenSSL),
// so nobody else who reaches rank 0's store or a rank's port gets in. The
// ranks die with the process that spawned them (PR_SET_PDEATHSIG), even when
// it is killed by SIGKILL. When pipe() or fork() fails, the ranks already
// started are stopped and spawn throws errc::system_error naming the call.
//
// The machinery, shared with dcomm-run where it can be, is in launch/.
#pragma once

#include <chrono>
#include <concepts>
#include <optional>
#include <string>
#include <utility>

#include "dcomm/error.hpp"
#include "dcomm/launch/forked_ranks.hpp"
#include "dcomm/launch/job_token.hpp"

namespace dcomm {

struct spawn_options {
  // Address the ranks meet at; rank 0 listens there on a port picked for you.
  std::string master_addr = "127.0.0.1";
  // How long the whole job may run before every rank is killed.
  std::chrono::milliseconds timeout = std::chrono::hours(24);
  // Between SIGTERM and SIGKILL when the others are stopped.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // Authenticate the job: the ranks get a fresh random DCOMM_JOB_TOKEN,
  // or the one already set in this process's environment. Nothing is
  // generated where this build has no OpenSSL (a token would be refused).
  // false: the ranks get no token at all, and anyone may join the job.
  bool auth = true;
};

// Runs fn(rank, world_size) — or fn(rank) — in n forked processes and waits
// for all of them; see the top of this header.
template <typename F>
requires std::invocable<F&, int, int> || std::invocable<F&, int>
void spawn(int n, F&& fn, const spawn_options& options = {}) {
  if (n < 1)
    throw_error(errc::invalid_argument,
                {.operation = "spawn", .expected = "at least 1 rank", .seen = std::to_string(n)});
  // One token for the whole job, chosen before anything needs cleaning up.
  const std::optional<std::string> token = launch::job_token_for_ranks(options.auth, true);
  launch::forked_ranks ranks(n, options.master_addr, options.grace);
  ranks.start(fn, token);
  ranks.wait(options.timeout);
}

}  // namespace dcomm
