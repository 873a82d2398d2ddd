// dcomm::spawn: real ranks that rendezvous through the environment it sets,
// and the failures the parent must report instead of hanging.
#include "dcomm/spawn.hpp"

#include <doctest/doctest.h>
#include <signal.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "dcomm/rendezvous.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;

namespace {

std::string spawn_error(int n, const std::function<void(int, int)>& fn,
                        dcomm::spawn_options options = {}) {
  try {
    dcomm::spawn(n, fn, options);
  } catch (const dcomm::error& e) {
    return std::string(e.what()) + " [" + e.context().operation + "]";
  }
  return "no error";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("spawn: 4 ranks rendezvous over env:// and agree on a sum") {
  DCOMM_TEST_DEADLINE(60s);
  dcomm::spawn(4, [](int rank, int world_size) {
    if (std::getenv("LOCAL_RANK") != std::to_string(rank)) throw std::runtime_error("LOCAL_RANK");
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 30s});
    if (world.rank != rank || world.world_size != world_size)
      throw std::runtime_error("rank/world size differ from spawn's");
    auto& s = *world.store;
    s.add("sum", rank + 1, dcomm::blocking);
    s.set("added/" + std::to_string(rank), "1", dcomm::blocking);
    std::vector<std::string> all;
    for (int r = 0; r < world_size; ++r) all.push_back("added/" + std::to_string(r));
    s.wait(all, dcomm::blocking);
    if (s.get("sum", dcomm::blocking) != "10") throw std::runtime_error("wrong sum");
    dcomm::depart(world, dcomm::blocking);
  });
}

TEST_CASE("spawn: a world of one, and fn(rank) with an int result") {
  DCOMM_TEST_DEADLINE(30s);
  dcomm::spawn(1, [](int rank, int world_size) {
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 10s});
    if (rank != 0 || world_size != 1 || world.world_size != 1) throw std::runtime_error("world");
  });
  dcomm::spawn(3, [](int rank) { return rank >= 0 ? 0 : 1; });
}

TEST_CASE("spawn: a failing rank is named with how it ended; the others are stopped") {
  DCOMM_TEST_DEADLINE(60s);
  // The healthy ranks wait for rank 2 forever (well, 10 minutes): spawn
  // must stop them rather than wait.
  auto waits_for_two = [](int rank, int) {
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 30s});
    if (rank == 2) return;
    world.store->get("never set", std::chrono::minutes(10), dcomm::blocking);
  };
  SUBCASE("an exception") {
    auto what = spawn_error(4, [&](int rank, int n) {
      if (rank == 2) throw std::runtime_error("bad batch 17");
      waits_for_two(rank, n);
    });
    CHECK(contains(what, "a rank failed in spawn (rank 2)"));
    CHECK(contains(what, "exit status 1"));
    CHECK(contains(what, "bad batch 17"));
    CHECK(contains(what, "the other 3 rank(s) were stopped"));
  }
  SUBCASE("an exit code") {
    auto what = spawn_error(3, [&](int rank, int n) {
      if (rank == 1) std::_Exit(3);
      waits_for_two(rank, n);
    });
    CHECK(contains(what, "(rank 1)"));
    CHECK(contains(what, "exit status 3"));
  }
  SUBCASE("a signal") {
    auto what = spawn_error(2, [&](int rank, int) {
      if (rank == 0) std::this_thread::sleep_for(std::chrono::minutes(10));
      // As a real crash: doctest's handler, inherited, would carry on.
      ::signal(SIGSEGV, SIG_DFL);
      ::raise(SIGSEGV);
    });
    CHECK(contains(what, "(rank 1)"));
    CHECK(contains(what, "signal 11"));
  }
}

TEST_CASE("spawn: the job's timeout kills every rank and names them") {
  DCOMM_TEST_DEADLINE(30s);
  auto what =
      spawn_error(2, [](int, int) { std::this_thread::sleep_for(std::chrono::minutes(10)); },
                  {.timeout = 300ms, .grace = 100ms});
  CHECK(contains(what, "timed out in spawn"));
  CHECK(contains(what, "ranks {0,1}"));
}

TEST_CASE("spawn: bad input is refused before anything is forked") {
  DCOMM_TEST_DEADLINE(10s);
  CHECK(contains(spawn_error(0, [](int, int) {}), "invalid argument"));
  CHECK(contains(spawn_error(2, [](int, int) {}, {.master_addr = "not-an-ip"}), "master_addr"));
}
