// The TCP backend's tuning: for each collective, the algorithm for small
// and for large messages, the DCOMM_ALGO overrides, and which algorithms a
// call may ask for. The algorithms themselves are in tcp/algorithms/<op>.hpp.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "dcomm/backend.hpp"
#include "dcomm/error.hpp"
#include "dcomm/tcp/wire_format.hpp"

namespace dcomm::tcp {


// The algorithms of each collective, for small and for large messages (the
// same where it has one): chosen by size unless a call or DCOMM_ALGO asks
// for one of them.
struct algorithm_choice {
  coll_op op;
  algorithm small, large;
};
inline constexpr algorithm_choice algorithm_table[] = {
    {coll_op::barrier, algorithm::automatic, algorithm::automatic},  // dissemination only
    {coll_op::broadcast, algorithm::binomial_tree, algorithm::chain},
    {coll_op::reduce, algorithm::binomial_tree, algorithm::chain},
    {coll_op::all_reduce, algorithm::recursive_doubling, algorithm::ring},
    {coll_op::scatter, algorithm::direct, algorithm::direct},
    {coll_op::gather, algorithm::direct, algorithm::direct},
    {coll_op::all_gather, algorithm::direct, algorithm::ring},
    {coll_op::reduce_scatter, algorithm::direct, algorithm::ring},
    {coll_op::all_to_all, algorithm::direct, algorithm::direct},
    {coll_op::all_gather_v, algorithm::direct, algorithm::direct},
    {coll_op::all_to_all_v, algorithm::direct, algorithm::direct},
};

inline const algorithm_choice& algorithms_of(coll_op op) {
  for (const auto& c : algorithm_table)
    if (c.op == op) return c;
  return algorithm_table[0];
}

// Empty if `a` may be asked of `operation` (a communicator operation's
// name), else why not.
inline std::string refuse_algorithm(std::string_view operation, algorithm a) {
  if (a == algorithm::automatic) return {};
  for (const auto& c : algorithm_table) {
    if (operation != name(c.op)) continue;
    if (a == c.small || a == c.large) return {};
    if (c.small == algorithm::automatic)
      return "algorithm " + std::string(dcomm::name(a)) + " is not available for " +
             std::string(operation) + " (it has one algorithm: leave it automatic)";
    return "algorithm " + std::string(dcomm::name(a)) + " is not available for " +
           std::string(operation) + " (it has " + std::string(dcomm::name(c.small)) +
           (c.large == c.small ? std::string() : " and " + std::string(dcomm::name(c.large))) + ")";
  }
  return "algorithm " + std::string(dcomm::name(a)) + " is not available for " +
         std::string(operation) + " (it has no algorithm to choose: leave it automatic)";
}

// "all_reduce=ring,broadcast=chain" (the DCOMM_ALGO variable) as overrides.
inline std::map<coll_op, algorithm> parse_algorithm_overrides(std::string_view spec) {
  std::map<coll_op, algorithm> out;
  auto fail = [&](std::string why) {
    throw_error(errc::invalid_argument,
                {.operation = "tcp_backend",
                 .key = "DCOMM_ALGO",
                 .seen = std::string(spec),
                 .detail = why + "; expected op=algorithm[,op=algorithm...], e.g. "
                                 "all_reduce=ring,broadcast=chain"});
  };
  while (!spec.empty()) {
    auto comma = spec.find(',');
    auto item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string_view::npos) fail("'" + std::string(item) + "' has no '='");
    auto op_name = item.substr(0, eq);
    auto a = parse_algorithm(item.substr(eq + 1));
    if (!a) fail("unknown algorithm '" + std::string(item.substr(eq + 1)) + "'");
    std::optional<coll_op> op;
    for (int i = 1; i <= static_cast<int>(coll_op::all_to_all); ++i)
      if (op_name == name(static_cast<coll_op>(i))) op = static_cast<coll_op>(i);
    if (!op) fail("unknown operation '" + std::string(op_name) + "'");
    if (auto why = refuse_algorithm(op_name, *a); !why.empty()) fail(why);
    out[*op] = *a;
  }
  return out;
}

}  // namespace dcomm::tcp
