// DCOMM_SOCKET_IFNAME's syntax (NCCL_SOCKET_IFNAME's) and the choice among
// a host's interfaces (cpu/startup/interfaces.hpp); the real thing, in network
// namespaces, is in tests/launch/launcher_test.cpp ("network interfaces").
#include "dcomm/cpu/startup/interfaces.hpp"

#include <doctest/doctest.h>

#include <ostream>
#include <string>
#include <vector>

using dcomm::cpu::choose_interface_address;
using dcomm::cpu::interface_filter;

TEST_CASE("interface names: prefixes, exclusions, exact names") {
  CHECK(interface_filter("eth").matches("eth0"));
  CHECK(interface_filter("eth").matches("eth10"));
  CHECK_FALSE(interface_filter("eth").matches("ib0"));
  CHECK(interface_filter("eth,ib").matches("ib0"));
  CHECK_FALSE(interface_filter("^docker,lo").matches("docker0"));
  CHECK_FALSE(interface_filter("^docker,lo").matches("lo"));
  CHECK(interface_filter("^docker,lo").matches("eth0"));
  CHECK(interface_filter("=eth0").matches("eth0"));
  CHECK_FALSE(interface_filter("=eth0").matches("eth01"));
  CHECK_FALSE(interface_filter("^=eth0").matches("eth0"));
  CHECK(interface_filter("^=eth0").matches("eth01"));
  for (const char* bad : {"", "^", "=", "^=", ","}) {
    INFO(bad);
    CHECK_THROWS_AS(interface_filter{bad}, dcomm::error);
  }
}

TEST_CASE("the address: towards the store first, then IPv4, then IPv6, in the system's order") {
  const std::vector<dcomm::cpu::interface_address> host = {{"lo", "127.0.0.1", false},
                                                           {"eth0", "fd00::2", true},
                                                           {"eth0", "192.0.2.2", false},
                                                           {"eth1", "198.51.100.7", false},
                                                           {"ib0", "fd01::9", true}};
  CHECK(choose_interface_address(host, interface_filter("eth"), "") == "192.0.2.2");
  CHECK(choose_interface_address(host, interface_filter("eth"), "198.51.100.7") == "198.51.100.7");
  CHECK(choose_interface_address(host, interface_filter("eth"), "fd00::2") == "fd00::2");
  CHECK(choose_interface_address(host, interface_filter("^lo,eth"), "127.0.0.1") == "fd01::9");
  CHECK(choose_interface_address(host, interface_filter("=lo"), "") == "127.0.0.1");
  try {
    choose_interface_address(host, interface_filter("docker"), "");
    FAIL("no interface matches: expected an error");
  } catch (const dcomm::error& e) {
    const std::string what = e.what();
    CHECK(e.code() == dcomm::errc::invalid_argument);
    CHECK(what.find("DCOMM_SOCKET_IFNAME") != std::string::npos);
    CHECK(what.find("matches 'docker'") != std::string::npos);
    CHECK(what.find("eth1 198.51.100.7") != std::string::npos);  // what there is
  }
}
