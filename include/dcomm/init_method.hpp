// Parsing of torch-style init_method URLs (env://, tcp://, file://) and of the
// environment that launchers (torchrun, dcomm-run, mpirun, mpiexec, srun) set.
// Nothing here touches the network: every mistake in a URL or a variable is
// reported here, with the variable and the value, before a rank starts waiting
// for peers that will never come.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "dcomm/error.hpp"
#include "dcomm/init/cluster.hpp"
#include "dcomm/init/launcher_environment.hpp"
#include "dcomm/init/spec.hpp"
#include "dcomm/init/url.hpp"

namespace dcomm {

// Turns an init_method URL plus the launcher's environment into an
// init_spec, or throws dcomm::error (errc::invalid_argument) naming the URL
// part or variable to fix. rank and world_size, when given, win over the
// environment; if the URL's query string also gives them they must agree.
inline init_spec parse_init_method(std::string_view url, std::optional<int> rank = {},
                                   std::optional<int> world_size = {},
                                   const env_lookup& env = process_environment()) {
  const init::url_parts parts = init::split_url(url);
  init_spec spec;
  spec.url = std::string(url);

  if (parts.scheme == "env") {
    spec.kind = init_kind::env;
    if (!parts.has_authority || !parts.authority.empty() || !parts.path.empty())
      init::throw_init_error(
          url, "init_method", "env:// with nothing after it but an optional ?query",
          init::in_quotes(url),
          "env:// reads the address from MASTER_ADDR and MASTER_PORT; to put it in the URL, "
          "use tcp://host:port");
  } else if (parts.scheme == "tcp") {
    spec.kind = init_kind::tcp;
    if (!parts.has_authority)
      init::throw_init_error(url, "init_method", "tcp://host:port", init::in_quotes(url),
                             "write two slashes after tcp:");
    if (!parts.path.empty() && parts.path != "/")
      init::throw_init_error(url, "init_method", "tcp://host:port with no path",
                             init::in_quotes(parts.path), "remove the path after the port");
    init::parse_tcp_authority(spec, parts.authority, url);
  } else if (parts.scheme == "file") {
    spec.kind = init_kind::file;
    constexpr std::string_view example = "file:///absolute/path, e.g. file:///tmp/dcomm_init";
    if (parts.has_authority && !parts.authority.empty() && parts.authority != "localhost")
      init::throw_init_error(
          url, "path", std::string(example), init::in_quotes(url),
          "file:// is followed by an absolute path, so it takes three slashes; '" +
              std::string(parts.authority) + "' was read as a host name");
    if (parts.path.empty())
      init::throw_init_error(url, "path", std::string(example), init::in_quotes(url),
                             "the path is missing");
    if (parts.path.front() != '/')
      init::throw_init_error(url, "path", std::string(example), init::in_quotes(parts.path),
                             "the path must be absolute: every rank resolves it from its "
                             "own working directory");
    if (parts.path.back() == '/')
      init::throw_init_error(url, "path", std::string(example), init::in_quotes(parts.path),
                             "the path names a directory; name a file inside it");
    spec.path = std::string(parts.path);
  } else {
    init::throw_init_error(url, "init_method", std::string(init::supported_init_methods),
                           init::in_quotes(url),
                           "unknown scheme " + init::in_quotes(parts.scheme + "://"));
  }

  const init::query_values query = init::parse_query(parts.query, url);

  if (spec.kind == init_kind::env) {
    // MASTER_ADDR and MASTER_PORT, else what the cluster says
    // (init/cluster.hpp: Kubeflow's PET_*, Slurm's node list and job id).
    const auto addr = init::master_addr_source(env);
    const auto port = init::master_port_source(env);
    for (auto [name, value] : {std::pair{"MASTER_ADDR", &addr}, std::pair{"MASTER_PORT", &port}})
      if (!*value)
        init::throw_init_error(url, name, "MASTER_ADDR and MASTER_PORT in the environment",
                               std::string(name) + " unset",
                               "env:// needs MASTER_ADDR (host of rank 0) and MASTER_PORT "
                               "(port it listens on), or a cluster's own variables "
                               "(PET_MASTER_ADDR/PET_MASTER_PORT, or Slurm's node list and job "
                               "id); set " +
                                   std::string(name) + " or use tcp://host:port");
    spec.host =
        addr->derived ? addr->value : init::checked_master_addr(addr->value, url, addr->from.name);
    spec.port = port->derived ? static_cast<std::uint16_t>(std::stoi(port->value))
                              : init::checked_port(port->from, url);
    spec.address_from = addr->from.name + (addr->derived ? " (its first host)" : "") + " and " +
                        port->from.name + (port->derived ? " (15000 + its last four digits)" : "");
  }

  init::resolve_ranks(spec, rank, world_size, query, env, url);
  return spec;
}

}  // namespace dcomm
