// Which host a rank runs on, as shared memory sees it: two ranks may share
// a segment when their identities are equal. Published through the store
// at start-up (cpu/startup/locality.hpp), never guessed from LOCAL_WORLD_SIZE or
// from addresses: containers and network namespaces on one machine would
// fool both.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <cstdlib>
#include <fstream>
#include <string>

namespace dcomm::shm {

// The kernel's boot id (a fresh random id per boot, the same in every
// container of the machine), the host name (two machines booted from one
// image keep distinct names), and the network namespace: segments are
// handed over through abstract unix sockets, which live in it, so ranks in
// different network namespaces count as different hosts and talk TCP.
// Empty where /proc cannot tell: such a rank shares memory with no one.
//
// $DCOMM_HOST_ID overrides it, so that tests can make one machine play
// several hosts (ranks with different ids never share memory).
inline std::string host_identity() {
  if (const char* v = std::getenv("DCOMM_HOST_ID"); v && *v) return v;
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0) name[0] = '\0';
  std::array<char, 64> net{};
  const ssize_t n = ::readlink("/proc/self/ns/net", net.data(), net.size() - 1);
  if (boot.empty() || n <= 0) return {};
  return boot + "/" + name.data() + "/" + std::string(net.data(), static_cast<std::size_t>(n));
}

// The cores this process may run on (its affinity mask, which a container
// or a launcher's binding narrows), at least 1.
inline std::size_t usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
    return static_cast<std::size_t>(CPU_COUNT(&set));
  return 1;
}

}  // namespace dcomm::shm
