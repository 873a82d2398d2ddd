// The TCP backend's connection mesh: every pair of ranks ends up with one
// authenticated socket that really leads to the rank it claims to.
#include "dcomm/detail/tcp_mesh.hpp"

#include <doctest/doctest.h>

#include <array>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/rendezvous.hpp"
#include "dcomm/spawn.hpp"
#include "support/deadline.hpp"
#include "support/store_world.hpp"

using namespace std::chrono_literals;

namespace {

// Each rank sends its rank number to every peer and checks what it reads
// back from sockets[p] is p.
asio::awaitable<void> exchange_ranks(dcomm::detail::mesh_sockets& sockets, int rank) {
  for (std::size_t p = 0; p < sockets.size(); ++p) {
    if (static_cast<int>(p) == rank) continue;
    std::array<int, 1> mine{rank};
    co_await asio::async_write(sockets[p], asio::buffer(mine), asio::use_awaitable);
  }
  for (std::size_t p = 0; p < sockets.size(); ++p) {
    if (static_cast<int>(p) == rank) continue;
    std::array<int, 1> theirs{-1};
    co_await asio::async_read(sockets[p], asio::buffer(theirs), asio::use_awaitable);
    if (theirs[0] != static_cast<int>(p))
      throw std::runtime_error("socket " + std::to_string(p) + " leads to rank " +
                               std::to_string(theirs[0]));
  }
}

// Runs the mesh in a thread world over one hash_store; returns each rank's
// error message ("" on success).
std::vector<std::string> thread_world(int world, const std::vector<int>& ranks,
                                      std::chrono::milliseconds limit,
                                      std::vector<std::string> tokens = {}) {
  dcomm::test::hash_world store_world;
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::jthread> threads;
  for (int r : ranks)
    threads.emplace_back([&, r] {
      asio::io_context ctx;
      auto s = store_world.handle(ctx.get_executor());
      dcomm::detail::mesh_options options{.bind_host = "127.0.0.1"};
      if (!tokens.empty()) options.job_token = tokens[static_cast<std::size_t>(r)];
      try {
        dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
          auto sockets = co_await dcomm::detail::connect_mesh(s, r, world, options,
                                                              dcomm::clock::now() + limit);
          co_await exchange_ranks(sockets, r);
        }());
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  threads.clear();
  return errors;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("tcp mesh: every pair connected to the right rank, in thread worlds") {
  DCOMM_TEST_DEADLINE(60s);
  for (int world : {1, 2, 3, 5}) {
    CAPTURE(world);
    std::vector<int> all;
    for (int r = 0; r < world; ++r) all.push_back(r);
    for (const auto& e : thread_world(world, all, 20s)) CHECK_MESSAGE(e.empty(), e);
  }
}

TEST_CASE("tcp mesh: 4 processes from dcomm::spawn over a tcp_store") {
  DCOMM_TEST_DEADLINE(60s);
  dcomm::spawn(4, [](int, int) {
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 30s});
    asio::io_context ctx;
    dcomm::detail::mesh_options options{.bind_host = "127.0.0.1"};
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      auto sockets = co_await dcomm::detail::connect_mesh(world.store, world.rank, world.world_size,
                                                          options, dcomm::clock::now() + 30s);
      co_await exchange_ranks(sockets, world.rank);
    }());
    dcomm::depart(world, dcomm::blocking);
  });
}

TEST_CASE("tcp mesh: a rank that never comes is named at the deadline") {
  DCOMM_TEST_DEADLINE(30s);
  auto errors = thread_world(3, {0, 1}, 1s);  // rank 2 never starts
  CHECK(contains(errors[0], "timed out in tcp mesh (rank 0), peers ranks {2}"));
  CHECK(contains(errors[1], "(rank 1)"));
  CHECK(contains(errors[1], "ranks {2}"));
}

TEST_CASE("tcp mesh: a peer without the job token is refused, not connected") {
  DCOMM_TEST_DEADLINE(30s);
  if (!dcomm::detail::have_crypto()) return;
  auto errors = thread_world(2, {0, 1}, 1s, {"the-token", "another-token"});
  CHECK(contains(errors[0], "ranks {1}"));  // rank 0 refused it and kept waiting
  CHECK(contains(errors[1], "authentication failed"));
}
