// Operation identity (dcomm/operation.hpp): every operation has one name,
// which parses back to it; which ones are collectives.
#include <doctest/doctest.h>

#include <set>
#include <string>

#include "dcomm/operation.hpp"

using dcomm::operation;

TEST_SUITE("operation") {
  TEST_CASE("each operation's name is its own and parses back to it") {
    std::set<std::string> seen;
    for (int i = 0; i <= static_cast<int>(operation::global_rank); ++i) {
      const auto op = static_cast<operation>(i);
      const std::string name = dcomm::name(op);
      CAPTURE(name);
      CHECK(name != "unknown operation");
      CHECK(seen.insert(name).second);
      CHECK(dcomm::parse_operation(name) == op);
    }
    CHECK(std::string(dcomm::name(operation::all_reduce)) == "all_reduce");
    CHECK(std::string(dcomm::name(operation::all_to_all_v)) == "all_to_all_v");
    CHECK(std::string(dcomm::name(static_cast<operation>(200))) == "unknown operation");
    CHECK_FALSE(dcomm::parse_operation("allreduce"));
    CHECK_FALSE(dcomm::parse_operation(""));
    CHECK_FALSE(dcomm::parse_operation("all_reduce "));
    static_assert(dcomm::parse_operation("barrier") == operation::barrier);
  }

  TEST_CASE("send, recv and their request forms are not collectives; everything else is") {
    for (operation op : {operation::send, operation::recv, operation::isend, operation::irecv})
      CHECK_FALSE(dcomm::is_collective(op));
    for (operation op : {operation::barrier, operation::all_gather_v, operation::broadcast_object,
                         operation::split})
      CHECK(dcomm::is_collective(op));
  }
}
