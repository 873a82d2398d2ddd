#include "dcomm/error.hpp"

#include <doctest/doctest.h>

#include <ostream>  // doctest prints std::error_code through it
#include <string>

TEST_CASE("dcomm::error names what the user needs, once") {
  dcomm::error e(dcomm::errc::timeout, {.operation = "tcp_store.get",
                                        .rank = 3,
                                        .peers = "ranks {1,2}",
                                        .key = "k",
                                        .address = "tcp://h:1",
                                        .expected = "4 ranks",
                                        .seen = "2",
                                        .detail = "still missing"});
  std::string what = e.what();
  CHECK(what ==
        "dcomm: timed out in tcp_store.get (rank 3), peers ranks {1,2}, key 'k', at tcp://h:1: "
        "expected 4 ranks, seen 2: still missing");
  CHECK(e.code() == dcomm::errc::timeout);
  CHECK(e.code().category().name() == std::string("dcomm"));
  CHECK(e.context().rank == 3);
  // Catchable as std::system_error with the same code.
  try {
    dcomm::throw_error(dcomm::errc::peer_lost, {.operation = "recv", .rank = 1});
  } catch (const std::system_error& se) {
    CHECK(se.code() == dcomm::make_error_code(dcomm::errc::peer_lost));
    CHECK(std::string(se.what()) == "dcomm: peer lost in recv (rank 1)");
  }
}

TEST_CASE("every errc has its own message") {
  for (int v = static_cast<int>(dcomm::errc::timeout);
       v <= static_cast<int>(dcomm::errc::revoked); ++v) {
    auto message = dcomm::make_error_code(static_cast<dcomm::errc>(v)).message();
    CHECK(message != "unknown dcomm error");
    for (int w = static_cast<int>(dcomm::errc::timeout); w < v; ++w)
      CHECK(dcomm::make_error_code(static_cast<dcomm::errc>(w)).message() != message);
  }
}
