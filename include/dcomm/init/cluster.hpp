// Where env:// finds rank 0's store when MASTER_ADDR and MASTER_PORT are not
// set, from what the cluster already says, as Lightning and torch's tooling
// do: Kubeflow Trainer's PyTorchJob (PET_MASTER_ADDR, PET_MASTER_PORT), and
// Slurm (the first host of the step's node list; a port from the job id).
// A rank started directly by a Kubernetes job, one per pod, takes its rank
// and world size from PET_NODE_RANK (or JobSet's JOB_COMPLETION_INDEX) and
// PET_NNODES.
#pragma once

#include <charconv>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dcomm/init/spec.hpp"
#include "dcomm/init/url.hpp"

namespace dcomm::init {

// Slurm's compressed host lists: "node[01-03,07],login2,rack[1-2]-gpu[1-2]"
// to node01 node02 node03 node07 login2 rack1-gpu1 rack1-gpu2 rack2-gpu1
// rack2-gpu2. A range keeps the width of its first number ("[08-10]":
// 08 09 10). Nothing (an empty list) for text that is not one.
inline std::vector<std::string> expand_hostlist(std::string_view list) {
  // Items at the top level, split on commas outside brackets.
  std::vector<std::string_view> items;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= list.size(); ++i) {
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      items.push_back(list.substr(start, i - start));
      start = i + 1;
    } else if (list[i] == '[') {
      if (++depth > 1) return {};
    } else if (list[i] == ']') {
      if (--depth < 0) return {};
    }
  }
  if (depth != 0) return {};
  std::vector<std::string> hosts;
  for (std::string_view item : items) {
    if (item.empty()) return {};
    std::vector<std::string> names{""};
    while (!item.empty()) {
      const std::size_t open = item.find('[');
      const std::string_view prefix = item.substr(0, open);
      for (auto& n : names) n += prefix;
      if (open == std::string_view::npos) break;
      const std::size_t close = item.find(']', open);
      const std::string_view ranges = item.substr(open + 1, close - open - 1);
      item = item.substr(close + 1);
      std::vector<std::string> numbers;
      std::size_t at = 0;
      while (at <= ranges.size()) {
        std::size_t comma = ranges.find(',', at);
        if (comma == std::string_view::npos) comma = ranges.size();
        const std::string_view range = ranges.substr(at, comma - at);
        at = comma + 1;
        const std::size_t dash = range.find('-');
        const std::string_view low = range.substr(0, dash);
        const std::string_view high = dash == std::string_view::npos ? low : range.substr(dash + 1);
        unsigned long a = 0, b = 0;
        if (low.empty() || high.empty() ||
            std::from_chars(low.data(), low.data() + low.size(), a).ptr !=
                low.data() + low.size() ||
            std::from_chars(high.data(), high.data() + high.size(), b).ptr !=
                high.data() + high.size() ||
            b < a || b - a > 100000)
          return {};
        for (unsigned long v = a; v <= b; ++v) {
          std::string digits = std::to_string(v);
          if (digits.size() < low.size()) digits.insert(0, low.size() - digits.size(), '0');
          numbers.push_back(std::move(digits));
        }
      }
      std::vector<std::string> product;
      for (const auto& n : names)
        for (const auto& d : numbers) product.push_back(n + d);
      names = std::move(product);
    }
    for (auto& n : names) hosts.push_back(std::move(n));
  }
  return hosts;
}

// The port a Slurm job's ranks agree on without being told: 15000 plus the
// last four digits of the job id (Lightning's rule, so that a job mixing
// both meets at one port).
inline std::optional<std::uint16_t> slurm_port(std::string_view job_id) {
  const std::string_view tail = job_id.size() > 4 ? job_id.substr(job_id.size() - 4) : job_id;
  unsigned v = 0;
  if (tail.empty() ||
      std::from_chars(tail.data(), tail.data() + tail.size(), v).ptr != tail.data() + tail.size())
    return std::nullopt;
  return static_cast<std::uint16_t>(15000 + v);
}

// A host or port and the variable it was read or derived from.
struct cluster_value {
  value_source from;  // the variable and its value
  std::string value;  // what it gives: a host, or a port
  bool derived = false;
};

// MASTER_ADDR, else PET_MASTER_ADDR, else the first host of Slurm's node
// list (the step's, then the job's).
inline std::optional<cluster_value> master_addr_source(const env_lookup& env) {
  for (std::string_view name : {"MASTER_ADDR", "PET_MASTER_ADDR"})
    if (auto v = lookup(env, name))
      return cluster_value{{value_origin::environment, std::string(name), *v}, *v};
  for (std::string_view name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    auto v = lookup(env, name);
    if (!v) continue;
    const auto hosts = expand_hostlist(*v);
    if (hosts.empty())
      throw_init_error("env://", name, "a Slurm host list, e.g. node[01-04],login1", in_quotes(*v),
                       "set MASTER_ADDR to rank 0's host");
    return cluster_value{{value_origin::environment, std::string(name), *v}, hosts.front(), true};
  }
  return std::nullopt;
}

// MASTER_PORT, else PET_MASTER_PORT, else the port of Slurm's job id.
inline std::optional<cluster_value> master_port_source(const env_lookup& env) {
  for (std::string_view name : {"MASTER_PORT", "PET_MASTER_PORT"})
    if (auto v = lookup(env, name))
      return cluster_value{{value_origin::environment, std::string(name), *v}, *v};
  if (auto id = lookup(env, "SLURM_JOB_ID"))
    if (auto port = slurm_port(*id))
      return cluster_value{
          {value_origin::environment, "SLURM_JOB_ID", *id}, std::to_string(*port), true};
  return std::nullopt;
}

}  // namespace dcomm::init
