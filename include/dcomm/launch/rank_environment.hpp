// The environment one rank starts with: dcomm's env:// variables (torch's
// too), the job token and, for rank 0, the rendezvous socket to adopt. The
// launcher fills it in before fork and the child applies it after.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <optional>
#include <string>

namespace dcomm::launch {

struct rank_environment {
  std::string master_addr;   // MASTER_ADDR
  int master_port = 0;       // MASTER_PORT
  int rank = 0;              // RANK
  int world_size = 1;        // WORLD_SIZE
  int local_rank = 0;        // LOCAL_RANK: among the ranks of this host
  int local_world_size = 1;  // LOCAL_WORLD_SIZE
  // GROUP_RANK: the node, under dcomm-run. std::nullopt: left as inherited.
  std::optional<int> group_rank{};
  // DCOMM_JOB_TOKEN (see job_token.hpp). std::nullopt: removed, so a token in
  // the launcher's environment does not leak into an open job.
  std::optional<std::string> job_token{};
  // The rendezvous socket (master_socket.hpp), or -1. Rank 0 adopts it
  // (DCOMM_MASTER_LISTEN_FD, kept open across exec); every other rank closes
  // it, so only rank 0's store can accept on it.
  int listen_fd = -1;
  // DCOMM_STORE_SERVED=1: the store is served by a process of its own (an
  // elastic launcher's), rank 0 connects to it as the others do.
  bool store_served = false;
  // DCOMM_JOINING=1 and TORCHELASTIC_RESTART_COUNT: a restarted rank's
  // process joins the running job (dcomm::join) instead of starting one.
  bool joining = false;
  int restart_count = 0;

  // Sets the variables in this process: in the child, after fork and before
  // running or exec'ing the rank.
  void apply() const {
    auto set = [](const char* name, const std::string& value) { ::setenv(name, value.c_str(), 1); };
    set("MASTER_ADDR", master_addr);
    set("MASTER_PORT", std::to_string(master_port));
    set("RANK", std::to_string(rank));
    set("WORLD_SIZE", std::to_string(world_size));
    set("LOCAL_RANK", std::to_string(local_rank));
    set("LOCAL_WORLD_SIZE", std::to_string(local_world_size));
    if (group_rank) set("GROUP_RANK", std::to_string(*group_rank));
    if (job_token)
      set("DCOMM_JOB_TOKEN", *job_token);
    else
      ::unsetenv("DCOMM_JOB_TOKEN");
    // These ranks meet at the store MASTER_PORT names, ours: not at the
    // agent's of a torchrun that started this launcher (rendezvous.hpp
    // would join that one instead).
    ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
    auto flag = [&set](const char* name, bool on) {
      if (on)
        set(name, "1");
      else
        ::unsetenv(name);
    };
    flag("DCOMM_STORE_SERVED", store_served);
    flag("DCOMM_JOINING", joining);
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count));
    if (rank == 0 && listen_fd >= 0) {
      ::fcntl(listen_fd, F_SETFD, 0);  // a launcher may have made it close-on-exec
      set("DCOMM_MASTER_LISTEN_FD", std::to_string(listen_fd));
    } else {
      ::unsetenv("DCOMM_MASTER_LISTEN_FD");
      if (listen_fd >= 0) ::close(listen_fd);
    }
  }
};

}  // namespace dcomm::launch
