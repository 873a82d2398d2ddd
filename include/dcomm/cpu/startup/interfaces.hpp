// Which local address a rank advertises when DCOMM_SOCKET_IFNAME names the
// interfaces to use, in NCCL_SOCKET_IFNAME's syntax:
//   eth,ib        interfaces whose names start with "eth" or "ib"
//   ^docker,lo    every interface except those starting with "docker", "lo"
//   =eth0         exactly eth0 (and ^=eth0: every one but eth0)
// Among the matching interfaces that are up, the address that routes to the
// store comes first (where it matches), then IPv4 before IPv6, in the order
// the system lists them. IPv6 link-local addresses are skipped (a peer
// could not reach them without a scope).
#pragma once

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <string>
#include <string_view>
#include <vector>

#include "dcomm/error.hpp"

namespace dcomm::cpu {

struct interface_address {
  std::string name;     // "eth0"
  std::string address;  // "10.0.0.5", "fd00::2"
  bool ipv6 = false;
};

class interface_filter {
 public:
  explicit interface_filter(std::string_view spec) : spec_(spec) {
    if (spec.starts_with("^")) {
      exclude_ = true;
      spec.remove_prefix(1);
    }
    if (spec.starts_with("=")) {
      exact_ = true;
      spec.remove_prefix(1);
    }
    while (!spec.empty()) {
      auto comma = spec.find(',');
      auto name = spec.substr(0, comma);
      if (!name.empty()) names_.emplace_back(name);
      if (comma == std::string_view::npos) break;
      spec.remove_prefix(comma + 1);
    }
    if (names_.empty())
      throw_error(errc::invalid_argument,
                  {.operation = "cpu_backend",
                   .key = "DCOMM_SOCKET_IFNAME",
                   .expected = "interface names or prefixes: eth0, eth,ib, ^docker,lo or =eth0",
                   .seen = "'" + spec_ + "'"});
  }

  bool matches(std::string_view interface) const {
    bool listed = false;
    for (const auto& n : names_)
      listed = listed || (exact_ ? interface == n : interface.starts_with(n));
    return listed != exclude_;
  }

  const std::string& spec() const noexcept { return spec_; }

 private:
  std::string spec_;
  bool exclude_ = false, exact_ = false;
  std::vector<std::string> names_;
};

// The addresses of this host's interfaces that are up, as getifaddrs lists
// them.
inline std::vector<interface_address> local_interfaces() {
  std::vector<interface_address> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (auto* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
    char text[INET6_ADDRSTRLEN] = {};
    if (i->ifa_addr->sa_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      out.push_back({i->ifa_name, text, false});
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a->sin6_addr)) continue;
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
      out.push_back({i->ifa_name, text, true});
    }
  }
  ::freeifaddrs(list);
  return out;
}

// The address to advertise among `interfaces` (see the top of this file);
// `towards_store` is the local address that routes to the store (may be
// empty). None matching is an invalid_argument that lists what there is.
inline std::string choose_interface_address(const std::vector<interface_address>& interfaces,
                                            const interface_filter& filter,
                                            const std::string& towards_store) {
  const interface_address* best = nullptr;
  auto rank = [&](const interface_address& a) {
    return (a.address == towards_store ? 0 : 2) + (a.ipv6 ? 1 : 0);
  };
  for (const auto& a : interfaces)
    if (filter.matches(a.name) && (!best || rank(a) < rank(*best))) best = &a;
  if (best) return best->address;
  std::string there;
  for (const auto& a : interfaces) there += (there.empty() ? "" : ", ") + a.name + " " + a.address;
  throw_error(errc::invalid_argument,
              {.operation = "cpu_backend",
               .key = "DCOMM_SOCKET_IFNAME",
               .expected = "an interface that is up and matches '" + filter.spec() + "'",
               .seen = there.empty() ? "no interface with an address" : there});
}

}  // namespace dcomm::cpu
