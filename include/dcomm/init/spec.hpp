// What an init_method resolves to (init_spec) and how the environment is
// read (env_lookup): the vocabulary of the init component, public through
// dcomm/init_method.hpp.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace dcomm {

enum class init_kind { env, tcp, file };

struct init_spec {
  init_kind kind = init_kind::env;
  std::string url;         // as given, for error messages
  std::string host;        // env:// (MASTER_ADDR) and tcp://; IPv6 without brackets, e.g. "::1"
  std::uint16_t port = 0;  // env:// (MASTER_PORT) and tcp://
  // env://: the variables host and port came from ("MASTER_ADDR and
  // MASTER_PORT", or a cluster's: init/cluster.hpp), for messages.
  std::string address_from;
  std::string path;  // file://
  int rank = -1;
  int world_size = -1;
  std::optional<int> local_rank, local_world_size;
  // Where the rank came from: "code", "query", "RANK/WORLD_SIZE", "OpenMPI",
  // "MPICH/Hydra" or "Slurm". world_size comes from the same place unless it
  // was given separately (e.g. world_size in code, rank from the environment).
  std::string launcher;

  // "tcp://host:port" (IPv6 host in brackets) or "file:///path", for messages.
  std::string address() const {
    if (kind == init_kind::file) return "file://" + path;
    const bool ipv6 = host.find(':') != std::string::npos;
    return "tcp://" + (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }
};

// Returns the value of an environment variable, or nullopt when it is unset.
// An empty env_lookup stands for an empty environment.
using env_lookup = std::function<std::optional<std::string>(std::string_view name)>;

// Reads the real process environment. Like ::getenv, not safe against a
// concurrent setenv in another thread.
inline env_lookup process_environment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

}  // namespace dcomm
