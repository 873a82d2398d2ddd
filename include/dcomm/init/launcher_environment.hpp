// Where a launcher puts the rank, the world size and the local rank:
// torchrun's RANK/WORLD_SIZE, OpenMPI, MPICH/Hydra, Slurm, and a Kubernetes
// job of one rank per pod (Kubeflow Trainer's PET_NODE_RANK/PET_NNODES, or
// JobSet's JOB_COMPLETION_INDEX), and how a value given in code, in the
// URL's query and in the environment are reconciled.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "dcomm/init/url.hpp"

namespace dcomm::init {

// A launcher family: the variables one launcher sets for every process.
struct launcher_family {
  std::string_view name;
  std::string_view rank_var;
  std::string_view size_var;
  std::string_view local_rank_var;
  std::string_view local_size_var;  // empty: read another way (Slurm), or none (a pod's one rank)
};

// The order is the detection order: torchrun/dcomm-run run inside mpirun or
// srun allocations and must win over them, and mpirun inside an srun
// allocation must win over Slurm, whose variables leak into everything the
// batch script starts.
inline constexpr launcher_family torchrun_family{"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE",
                                                 "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
inline constexpr launcher_family launcher_families[] = {
    torchrun_family,
    {"OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""},
    {"Kubeflow PET_*", "PET_NODE_RANK", "PET_NNODES", "", ""},
    {"JobSet", "JOB_COMPLETION_INDEX", "PET_NNODES", "", ""},
};

// A Kubernetes job started the program itself, one process per pod: a pod
// asked for more (PET_NPROC_PER_NODE) needs a launcher to start them.
inline bool one_rank_per_pod(const launcher_family& f) {
  return f.name == "Kubeflow PET_*" || f.name == "JobSet";
}

// Slurm writes per-node task counts as "2" or "2(x3)" (2 tasks on each of 3
// nodes), and as "2(x2),1" when nodes differ; only a count that is the same on
// every node is a local world size, so anything else is left unset rather
// than failing a job that Slurm itself accepted.
inline std::optional<int> parse_slurm_tasks_per_node(std::string_view text) {
  int count = 0;
  const char* const last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(text.data(), last, count);
  if (ec != std::errc{} || count < 1) return std::nullopt;
  if (end == last) return count;
  std::string_view rest(end, static_cast<std::size_t>(last - end));
  if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')') return std::nullopt;
  rest = rest.substr(2, rest.size() - 3);
  int nodes = 0;
  const auto [nodes_end, nodes_ec] = std::from_chars(rest.data(), rest.data() + rest.size(), nodes);
  if (nodes_ec != std::errc{} || nodes_end != rest.data() + rest.size() || nodes < 1)
    return std::nullopt;
  return count;
}

// SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; the step's own
// layout is the fallback.
inline std::optional<sourced_int> slurm_local_size(const env_lookup& env) {
  for (std::string_view name : {"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"}) {
    auto text = lookup(env, name);
    if (!text) continue;
    if (auto count = parse_slurm_tasks_per_node(*text))
      return sourced_int{*count, {value_origin::environment, std::string(name), *text}};
  }
  return std::nullopt;
}
// silently overrides the other.
inline std::optional<sourced_int> explicit_value(std::optional<int> code,
                                                 const std::optional<value_source>& query,
                                                 std::string_view name, std::string_view meaning,
                                                 std::string_view url) {
  std::optional<sourced_int> from_code, from_query;
  if (code)
    from_code = sourced_int{*code, {value_origin::code, std::string(name), std::to_string(*code)}};
  if (query) from_query = sourced_int{parse_int(*query, url, meaning), *query};
  if (from_code && from_query && from_code->value != from_query->value)
    throw_init_error(url, name, "the same " + std::string(name) + " in code and in the URL",
                     from_code->source.describe() + " but " + from_query->source.describe(),
                     "give " + std::string(name) + " in one place only");
  return from_code ? from_code : from_query;
}

inline std::string_view origin_launcher(const sourced_int& v, std::string_view family) {
  switch (v.source.origin) {
    case value_origin::code:
      return "code";
    case value_origin::query:
      return "query";
    case value_origin::url:
    case value_origin::environment:
      break;
  }
  return family;
}

inline const launcher_family* detect_family(const env_lookup& env, bool need_rank) {
  for (const launcher_family& family : launcher_families)
    if (lookup(env, family.rank_var)) return &family;
  // The rank was given explicitly and only the size is missing: any
  // launcher that says how many processes it started will do.
  if (!need_rank)
    for (const launcher_family& family : launcher_families)
      if (lookup(env, family.size_var)) return &family;
  return nullptr;
}

inline void resolve_local(init_spec& spec, const env_lookup& env, const launcher_family* family,
                          std::string_view url) {
  if (family != nullptr && one_rank_per_pod(*family)) {  // the pod's only rank
    spec.local_rank = 0;
    spec.local_world_size = 1;
    return;
  }
  if (family == nullptr) {
    // Rank and size came from code or the URL: take the local layout from
    // whichever launcher started this process.
    family = &torchrun_family;
    for (const launcher_family& f : launcher_families)
      if (lookup(env, f.local_rank_var)) {
        family = &f;
        break;
      }
  }
  std::optional<sourced_int> local_rank =
      env_int(env, family->local_rank_var, url, "local rank (index of this process on its node)");
  if (!local_rank) local_rank = env_int(env, "LOCAL_RANK", url, "local rank");
  std::optional<sourced_int> local_size =
      family->name == "Slurm"
          ? slurm_local_size(env)
          : env_int(env, family->local_size_var, url, "local world size (processes per node)");
  if (!local_size) local_size = env_int(env, "LOCAL_WORLD_SIZE", url, "local world size");

  if (local_rank) check_rank_value(*local_rank, url, "local rank");
  if (local_size) check_size_value(*local_size, url, "local world size");
  if (local_rank && local_size)
    check_rank_below_size(*local_rank, *local_size, url, "local rank", "local world size");
  if (local_rank) spec.local_rank = local_rank->value;
  if (local_size) spec.local_world_size = local_size->value;
}

inline void resolve_ranks(init_spec& spec, std::optional<int> code_rank,
                          std::optional<int> code_size, const query_values& query,
                          const env_lookup& env, std::string_view url) {
  std::optional<sourced_int> rank =
      explicit_value(code_rank, query.rank, "rank", "rank (0..world_size-1)", url);
  std::optional<sourced_int> size = explicit_value(code_size, query.world_size, "world_size",
                                                   "world size (number of ranks)", url);
  if (rank) check_rank_value(*rank, url, "rank");
  if (size) check_size_value(*size, url, "world size");

  const launcher_family* family = nullptr;
  if (spec.kind == init_kind::env && (!rank || !size)) {
    family = detect_family(env, !rank);
    if (family != nullptr && one_rank_per_pod(*family))
      if (auto per_node = lookup(env, "PET_NPROC_PER_NODE"); per_node && *per_node != "1")
        throw_init_error(url, "PET_NPROC_PER_NODE", "1: one rank per pod, started by the pod",
                         "PET_NPROC_PER_NODE=" + in_quotes(*per_node),
                         "more than one rank per pod needs a launcher to start them: run the "
                         "program under dcomm-run (it reads the PET_* variables) or torchrun");
    if (family == nullptr)
      throw_init_error(
          url, !rank ? "RANK" : "WORLD_SIZE",
          std::string(!rank ? "the rank" : "the world size") +
              " from a launcher (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, "
              "PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS, PET_NODE_RANK/PET_NNODES or "
              "JOB_COMPLETION_INDEX/PET_NNODES), from code, or from the URL",
          "none of them set",
          "start the program with torchrun, dcomm-run, mpirun, mpiexec or srun, or pass rank "
          "and world_size in code or as env://?rank=R&world_size=N");
    if (!rank) {
      rank = env_int(env, family->rank_var, url, "rank (0..world_size-1)");
      check_rank_value(*rank, url, "rank");
    }
    if (!size) {
      size = env_int(env, family->size_var, url, "world size (number of ranks)");
      if (!size)
        throw_init_error(
            url, family->size_var,
            std::string(family->size_var) + " next to " + std::string(family->rank_var),
            std::string(family->rank_var) + " is set but " + std::string(family->size_var) +
                " is not",
            "env:// takes the rank and the world size from the same launcher (" +
                std::string(family->name) + "); set " + std::string(family->size_var) +
                " or pass world_size in code");
      check_size_value(*size, url, "world size");
    }
  }
  if (!rank || !size) {
    const std::string_view scheme = spec.kind == init_kind::tcp ? "tcp://" : "file://";
    const std::string_view missing = !rank ? "rank" : "world_size";
    throw_init_error(url, missing, "rank and world_size", std::string(missing) + " not given",
                     "pass rank and world_size in code (init_options{.rank = R, .world_size = "
                     "N} to init_process_group; rendezvous_options alike) or in the query "
                     "string (" +
                         std::string(scheme) + "...?rank=R&world_size=N)");
  }
  check_rank_below_size(*rank, *size, url, "rank", "world size");

  spec.rank = rank->value;
  spec.world_size = size->value;
  spec.launcher = origin_launcher(*rank, family != nullptr ? family->name : "");
  resolve_local(spec, env, family, url);
}

}  // namespace dcomm::init
