// Rendezvous through every init method and launcher family, in real
// processes, and the failures a user must get instead of a hang.
#include "dcomm/rendezvous.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"
#include "support/store_world.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
using dcomm::errc;

namespace {

using dcomm::test::contains;

dcomm::env_lookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

using dcomm::test::listening_socket;

// After rendezvous every rank adds its rank; all must see the full sum, then
// they depart (rank 0, which may host the store, last).
int check_world(dcomm::rendezvous_result& world, int expected_rank, int expected_size) {
  auto& s = *world.store;
  if (world.rank != expected_rank || world.world_size != expected_size) return 10;
  s.add("sum", world.rank, dcomm::blocking);
  s.add("arrived", 1, dcomm::blocking);
  while (std::stoi(s.get("arrived", dcomm::blocking)) < expected_size)
    std::this_thread::sleep_for(1ms);
  int sum = std::stoi(s.get("sum", dcomm::blocking));
  if (sum != expected_size * (expected_size - 1) / 2) return 11;
  dcomm::depart(world, dcomm::blocking);
  return 0;
}

void require_all_ok(const std::vector<dcomm::test::child_result>& results) {
  for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
}

}  // namespace

TEST_CASE("env:// with every launcher family, in real processes") {
  DCOMM_TEST_DEADLINE(120s);
  struct family {
    const char* name;
    const char* rank_var;
    const char* size_var;
    const char* local_rank_var;
  };
  const family families[] = {
      {"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
      {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  for (const auto& f : families) {
    CAPTURE(f.name);
    constexpr int n = 4;
    listening_socket ls;
    auto results = dcomm::test::fork_world(n, 60s, [&](int rank) {
      std::map<std::string, std::string> vars = {
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(ls.port)},
          {f.rank_var, std::to_string(rank)},
          {f.size_var, std::to_string(n)},
          {f.local_rank_var, std::to_string(rank)},
      };
      if (rank == 0) vars["DCOMM_MASTER_LISTEN_FD"] = std::to_string(ls.fd());
      const auto env = env_of(vars);
      auto world = dcomm::rendezvous({.init_method = "env://", .env = &env});
      if (world.spec.launcher != f.name) return 20;
      if (world.local_rank != rank) return 21;
      return check_world(world, rank, n);
    });
    require_all_ok(results);
  }
}

TEST_CASE("tcp:// with rank and world size in code or in the query string") {
  DCOMM_TEST_DEADLINE(60s);
  constexpr int n = 3;
  listening_socket ls;
  auto results = dcomm::test::fork_world(n, 40s, [&](int rank) {
    std::map<std::string, std::string> vars;
    if (rank == 0) vars["DCOMM_MASTER_LISTEN_FD"] = std::to_string(ls.fd());
    std::string url = "tcp://127.0.0.1:" + std::to_string(ls.port);
    const auto env = env_of(vars);
    dcomm::rendezvous_options options{.env = &env};
    if (rank == 1) {  // this one reads them from the URL
      options.init_method = url + "?rank=1&world_size=" + std::to_string(n);
    } else {
      options.init_method = url;
      options.rank = rank;
      options.world_size = n;
    }
    auto world = dcomm::rendezvous(options);
    return check_world(world, rank, n);
  });
  require_all_ok(results);
}

// Issue 41: an inherited listening socket (DCOMM_MASTER_LISTEN_FD, from
// dcomm-run or spawn) is adopted only where it listens on the port rank 0
// is asked for; a job that names another port meets there.
TEST_CASE("DCOMM_MASTER_LISTEN_FD on another port: rank 0 listens where it is asked to") {
  DCOMM_TEST_DEADLINE(60s);
  constexpr int n = 2;
  listening_socket launchers;  // a launcher's socket, on a port the job does not name
  const std::string port = std::to_string(dcomm::test::free_port());
  for (bool env : {false, true}) {
    CAPTURE(env);
    auto results = dcomm::test::fork_world(n, 40s, [&](int rank) {
      const std::string init_method =
          env ? std::string("env://")
              : "tcp://127.0.0.1:" + port + "?rank=" + std::to_string(rank) + "&world_size=2";
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      if (rank == 0) ::setenv("DCOMM_MASTER_LISTEN_FD", std::to_string(launchers.fd()).c_str(), 1);
      try {
        auto world = dcomm::rendezvous({.init_method = init_method, .timeout = 5s});
        if (!contains(world.store->address(), ":" + port)) return 20;
        // Not adopted, and not closed: the launcher's socket is not rank 0's to close.
        if (rank == 0 && ::fcntl(launchers.fd(), F_GETFD) == -1) return 21;
        return check_world(world, rank, n);
      } catch (const dcomm::error& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        return 22;
      }
    });
    require_all_ok(results);
  }
}

TEST_CASE("tcp:// over IPv6") {
  DCOMM_TEST_DEADLINE(60s);
  std::unique_ptr<listening_socket> ls;
  try {
    ls = std::make_unique<listening_socket>("::1");
  } catch (const std::system_error& e) {
    MESSAGE("skipped: no IPv6 loopback here (" << e.what() << ")");
    return;
  }
  constexpr int n = 2;
  auto results = dcomm::test::fork_world(n, 40s, [&](int rank) {
    std::map<std::string, std::string> vars;
    if (rank == 0) vars["DCOMM_MASTER_LISTEN_FD"] = std::to_string(ls->fd());
    const auto env = env_of(vars);
    auto world = dcomm::rendezvous({.init_method = "tcp://[::1]:" + std::to_string(ls->port),
                                    .rank = rank,
                                    .world_size = n,
                                    .env = &env});
    if (world.store->address().find("[::1]") == std::string::npos) return 30;
    return check_world(world, rank, n);
  });
  require_all_ok(results);
}

TEST_CASE("file:// in real processes; the file is gone after a clean end") {
  DCOMM_TEST_DEADLINE(60s);
  dcomm::test::temp_dir dir;
  std::string path = dir.path + "/rendezvous";
  constexpr int n = 3;
  auto results = dcomm::test::fork_world(n, 40s, [&](int rank) {
    const auto env = env_of({});
    auto world = dcomm::rendezvous(
        {.init_method = "file://" + path, .rank = rank, .world_size = n, .env = &env});
    return check_world(world, rank, n);
  });
  require_all_ok(results);
  CHECK_FALSE(std::filesystem::exists(path));
}

TEST_CASE("a thread world over one hash_store, and a world of one") {
  DCOMM_TEST_DEADLINE(30s);
  for (int n : {1, 5}) {
    CAPTURE(n);
    dcomm::test::hash_world world;
    std::vector<std::string> failures;
    std::mutex m;
    std::vector<std::jthread> ranks;
    for (int r = 0; r < n; ++r)
      ranks.emplace_back([&, r] {
        dcomm::detail::io_thread io;
        try {
          dcomm::rendezvous(world.handle(io.get_executor()), r, n, {}, dcomm::blocking);
        } catch (const std::exception& e) {
          std::lock_guard lock(m);
          failures.push_back(e.what());
        }
      });
    ranks.clear();
    CHECK_MESSAGE(failures.empty(), (failures.empty() ? "" : failures.front()));
  }
}

TEST_CASE("missing ranks are reported while waiting and named at the deadline") {
  DCOMM_TEST_DEADLINE(30s);
  dcomm::test::hash_world world;
  std::vector<std::string> progress;
  std::mutex m;
  std::vector<std::string> errors(3);
  std::vector<std::jthread> ranks;
  const dcomm::progress_callback on_progress = [&](std::string_view line) {
    std::lock_guard lock(m);
    progress.emplace_back(line);
  };
  for (int r : {0, 2})  // rank 1 never comes
    ranks.emplace_back([&, r] {
      dcomm::detail::io_thread io;
      try {
        dcomm::rendezvous(
            world.handle(io.get_executor()), r, 3,
            {.timeout = 1500ms, .progress_interval = 300ms, .on_progress = &on_progress},
            dcomm::blocking);
      } catch (const dcomm::error& e) {
        std::lock_guard lock(m);
        errors[static_cast<std::size_t>(r)] =
            std::string(e.what()) + " [" + e.code().message() + "]";
      }
    });
  ranks.clear();
  for (int r : {0, 2}) {
    const auto& what = errors[static_cast<std::size_t>(r)];
    CHECK(contains(what, "timed out in rendezvous"));
    CHECK(contains(what, "ranks {1}"));
    CHECK(contains(what, "rank " + std::to_string(r)));
  }
  REQUIRE_FALSE(progress.empty());
  CHECK(contains(progress.front(), "waiting for ranks {1} at hash_store"));
  CHECK(contains(progress.front(), "of 1 s"));
  // One line per 300 ms of the 1.5 s each, not a burst before the deadline.
  CHECK(progress.size() <= 2 * 5);
}

TEST_CASE("ranks that disagree on the world size, or share a rank, fail instead of hanging") {
  DCOMM_TEST_DEADLINE(30s);
  auto run_two = [](int rank_a, int size_a, int rank_b, int size_b) {
    dcomm::test::hash_world world;
    std::vector<std::string> errors(2);
    {
      std::vector<std::jthread> ranks;
      int spec[2][2] = {{rank_a, size_a}, {rank_b, size_b}};
      for (int i = 0; i < 2; ++i)
        ranks.emplace_back([&, i] {
          dcomm::detail::io_thread io;
          try {
            dcomm::rendezvous(world.handle(io.get_executor()), spec[i][0], spec[i][1],
                              {.timeout = 1s}, dcomm::blocking);
          } catch (const dcomm::error& e) {
            errors[static_cast<std::size_t>(i)] = e.what();
          }
        });
    }
    return errors;
  };
  SUBCASE("world size") {
    auto errors = run_two(0, 2, 1, 3);
    bool named = contains(errors[0] + errors[1], "disagree on the world size");
    CHECK(named);
    CHECK(contains(errors[0] + errors[1], "mismatch"));
  }
  SUBCASE("the same rank twice") {
    auto errors = run_two(0, 2, 0, 2);
    CHECK(contains(errors[0] + errors[1], "claimed by more than one process"));
    // Neither may think the world formed: rank 1 never came.
    CHECK_FALSE(errors[0].empty());
    CHECK_FALSE(errors[1].empty());
  }
}

TEST_CASE("one rank with the wrong WORLD_SIZE: every rank fails at once with its reason") {
  // Rank 2 says 5 where the others say 4. Whoever finds the mismatch tells
  // the others through the store: nobody waits for the deadline (20 s), and
  // nobody is left with a bare "peer lost" when rank 0 and its store go.
  DCOMM_TEST_DEADLINE(60s);
  constexpr int n = 4;
  listening_socket ls;
  auto results = dcomm::test::fork_world(n, 40s, [&](int rank) {
    std::map<std::string, std::string> vars = {{"MASTER_ADDR", "127.0.0.1"},
                                               {"MASTER_PORT", std::to_string(ls.port)},
                                               {"RANK", std::to_string(rank)},
                                               {"WORLD_SIZE", rank == 2 ? "5" : "4"}};
    if (rank == 0) vars["DCOMM_MASTER_LISTEN_FD"] = std::to_string(ls.fd());
    // Rank 2 comes last (most often), so that the others are already waiting.
    if (rank == 2) std::this_thread::sleep_for(300ms);
    try {
      const auto env = env_of(vars);
      dcomm::rendezvous({.init_method = "env://", .timeout = 20s, .env = &env});
    } catch (const dcomm::error& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      const std::string what = e.what();
      const bool named = contains(what, "disagree on the world size") &&
                         (contains(what, "says 5") || contains(what, "said 5"));
      return named ? 0 : 2;
    }
    return 1;
  });
  require_all_ok(results);
}

TEST_CASE("another program on the store's port: the handshake says so, not just 'timed out'") {
  DCOMM_TEST_DEADLINE(60s);
  auto join_as_rank_1 = [](std::uint16_t port) -> std::string {
    try {
      dcomm::rendezvous({.init_method = "tcp://127.0.0.1:" + std::to_string(port),
                         .rank = 1,
                         .world_size = 2,
                         .timeout = 2s});
    } catch (const dcomm::error& e) {
      return std::string(e.what()) + " [" + e.code().message() + "]";
    }
    return "no error";
  };
  listening_socket ls;
  SUBCASE("one that waits for its own protocol") {
    std::jthread silent([&] {
      const int fd = ::accept(ls.fd(), nullptr, nullptr);
      std::this_thread::sleep_for(3s);
      if (fd >= 0) ::close(fd);
    });
    const std::string what = join_as_rank_1(ls.port);
    INFO(what);
    CHECK(contains(
        what,
        "nothing answered the handshake: another program (not a dcomm server) may hold the port"));
  }
  SUBCASE("one that answers in its own protocol") {
    std::jthread http([&] {
      const int fd = ::accept(ls.fd(), nullptr, nullptr);
      if (fd < 0) return;
      const std::string reply =
          "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      [[maybe_unused]] auto n = ::write(fd, reply.data(), reply.size());
      std::this_thread::sleep_for(500ms);
      ::close(fd);
    });
    const std::string what = join_as_rank_1(ls.port);
    INFO(what);
    CHECK(contains(what,
                   "another program answers at this address, not a dcomm server (it sent "
                   "\"HTTP/1.1 400 Bad Request\")"));
  }
}

TEST_CASE("bad input fails before anything is bound or connected") {
  DCOMM_TEST_DEADLINE(30s);
  auto error_of = [](dcomm::rendezvous_options options,
                     std::map<std::string, std::string> vars = {}) -> std::string {
    const auto env = env_of(std::move(vars));
    options.env = &env;
    try {
      dcomm::rendezvous(options);
    } catch (const dcomm::error& e) {
      return std::string(e.what()) + " [" + e.code().message() + "]";
    }
    return "no error";
  };
  auto what = error_of({.init_method = "env://"}, {{"MASTER_ADDR", "127.0.0.1"}, {"RANK", "0"}});
  CHECK(contains(what, "MASTER_PORT"));
  what = error_of(
      {.init_method = "env://"},
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}, {"RANK", "4"}, {"WORLD_SIZE", "4"}});
  CHECK(contains(what, "invalid argument"));
  CHECK(contains(what, "4"));
  what = error_of({.init_method = "tcp://127.0.0.1", .rank = 0, .world_size = 1});
  CHECK(contains(what, "port"));
  what = error_of({.init_method = "udp://x:1", .rank = 0, .world_size = 1});
  CHECK(contains(what, "invalid argument"));
  what = error_of({.init_method = "file://relative/path", .rank = 0, .world_size = 1});
  CHECK(contains(what, "invalid argument"));
  what = error_of({.init_method = "env://"}, {{"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", "29500"},
                                              {"RANK", "0"},
                                              {"WORLD_SIZE", "1"},
                                              {"DCOMM_MASTER_LISTEN_FD", "x"}});
  CHECK(contains(what, "DCOMM_MASTER_LISTEN_FD"));
}

TEST_CASE("a port already in use is named, with the variable to change") {
  DCOMM_TEST_DEADLINE(30s);
  listening_socket taken;
  auto what = [&](std::map<std::string, std::string> extra) -> std::string {
    extra.insert({{"MASTER_ADDR", "127.0.0.1"},
                  {"MASTER_PORT", std::to_string(taken.port)},
                  {"RANK", "0"},
                  {"WORLD_SIZE", "1"}});
    try {
      const auto env = env_of(std::move(extra));
      dcomm::rendezvous({.init_method = "env://", .bind_host = "127.0.0.1", .env = &env});
    } catch (const dcomm::error& e) {
      CHECK(e.code() == errc::address_in_use);
      return e.what();
    }
    return "no error";
  };
  const std::string plain = what({});
  CHECK(contains(plain, std::to_string(taken.port)));
  CHECK(contains(plain, "choose another MASTER_PORT"));
  // Under torchrun without --standalone the port is its agent's store,
  // which rank 0 joins instead (store_test.cpp, "c10d_store").
}

TEST_CASE("depart: rank 0 waits for every rank to leave, and names the ones that do not") {
  DCOMM_TEST_DEADLINE(30s);
  dcomm::test::hash_world world;
  asio::io_context ctx;
  auto handle = [&](int rank) {
    auto s = world.handle(ctx.get_executor());
    s->set_timeout(300ms);
    return dcomm::rendezvous_result{.store = s, .rank = rank, .world_size = 4};
  };
  auto rank0 = handle(0);
  // Ranks 1 and 3 leave, rank 2 never does.
  dcomm::sync_wait(ctx, dcomm::depart(handle(1)));
  dcomm::sync_wait(ctx, dcomm::depart(handle(3)));
  try {
    dcomm::sync_wait(ctx, dcomm::depart(rank0));
    FAIL("rank 0 left while rank 2 was still there");
  } catch (const dcomm::error& e) {
    CHECK(e.code() == errc::timeout);
    CHECK(contains(e.what(), "ranks {2}"));
    CHECK(contains(e.what(), "in depart (rank 0)"));
  }
  dcomm::sync_wait(ctx, dcomm::depart(handle(2)));
  dcomm::sync_wait(ctx, dcomm::depart(rank0));
}
