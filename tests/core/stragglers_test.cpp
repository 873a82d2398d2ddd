// Stragglers (dcomm/trace/stragglers.hpp, detail/arrivals.hpp): a rank
// delayed on purpose is the one every rank's stats() names, over shared
// memory, over TCP and across two "hosts"; the flight recorder says which
// transport carried each call and who called it last; rank 0 warns once;
// the stamps' rounding and the clocks of other boots.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/cpu/startup/locality.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/detail/arrivals.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::require;

namespace {

asio::awaitable<void> pause(std::chrono::milliseconds d) {
  asio::steady_timer t(co_await asio::this_coro::executor, d);
  co_await t.async_wait(asio::use_awaitable);
}

// Each rank's links: every rank of one host (shared memory: the arena for
// the small collectives), TCP for every link, or two "hosts" of two.
enum class links { shm, tcp, two_hosts };

dcomm::cpu_backend::options links_of(links l, int rank) {
  dcomm::cpu_backend::options o;
  o.transport = l == links::tcp ? "tcp" : "auto";
  if (l == links::two_hosts) o.host_id = "straggler-test-host-" + std::to_string(rank / 2);
  return o;
}

const char* expected_transport(links l) {
  return l == links::shm ? "shm" : l == links::tcp ? "tcp" : "shm+tcp";
}

// stderr into a file while it exists (the warning goes there).
struct captured_stderr {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("dcomm-stragglers-" + std::to_string(::getpid()) + ".err");
  int saved = -1;
  captured_stderr() {
    std::fflush(stderr);
    saved = ::dup(2);
    std::FILE* f = std::fopen(path.c_str(), "w");
    ::dup2(::fileno(f), 2);
    std::fclose(f);
  }
  std::string release() {
    std::fflush(stderr);
    if (saved >= 0) {
      ::dup2(saved, 2);
      ::close(saved);
      saved = -1;
    }
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    std::filesystem::remove(path);
    return s.str();
  }
  ~captured_stderr() { release(); }
};

struct straggler_ms {
  explicit straggler_ms(const char* v) { ::setenv("DCOMM_STRAGGLER_MS", v, 1); }
  ~straggler_ms() { ::unsetenv("DCOMM_STRAGGLER_MS"); }
};

int count_of(const std::string& s, const std::string& part) {
  int n = 0;
  for (auto at = s.find(part); at != std::string::npos; at = s.find(part, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_SUITE("stragglers") {
  TEST_CASE("a rank delayed on purpose is the straggler every rank's stats() names") {
    DCOMM_TEST_DEADLINE(120s);
    straggler_ms quiet("0");  // the warning has a test of its own
    for (links l : {links::shm, links::tcp, links::two_hosts}) {
      const std::string over = expected_transport(l);
      CAPTURE(over);
      constexpr int rounds = 12;
      static constexpr auto delay = 30ms;  // static: clang 14 wants a constexpr duration captured
      DCOMM_REQUIRE_WORLD(
          4,
          [l](comm& c, int rank) -> asio::awaitable<void> {
            std::vector<float> small(5, 1.0f), large(300000, 1.0f);
            std::vector<int> mine{rank}, all(4);
            for (int i = 0; i < rounds; ++i) {
              // Rank 2 calls each collective 30 ms after the others.
              if (rank == 2) co_await pause(delay);
              co_await c.all_reduce(i % 2 ? large : small, dcomm::sum);
              if (rank == 2) co_await pause(delay);
              co_await c.barrier();
              if (rank == 2) co_await pause(delay);
              co_await c.broadcast(small, 0);  // rooted: heard of through its confirmation
              if (rank == 2) co_await pause(delay);
              co_await c.all_gather(mine, all);
            }
            const auto s = c.stats();
            require(s.collectives_measured == 4 * rounds,
                    "collectives measured: " + std::to_string(s.collectives_measured));
            require(s.straggler() == 2, "the straggler named: " + std::to_string(s.straggler()));
            require(s.ranks.size() == 4 && s.ranks[2].last >= 4 * rounds - 2,
                    "rank 2 called last " + std::to_string(s.ranks[2].last) + " times");
            require(s.ranks[2].late_mean_us > 20000 && s.ranks[2].late_max_us < 30000 * 10,
                    "rank 2's lateness: " + std::to_string(s.ranks[2].late_mean_us) + " us");
            if (rank == 2)
              require(s.own_late_mean_us > 20000, "rank 2 does not know it is late");
            else
              require(s.own_late_mean_us < 10000,
                      "on time, yet late: " + std::to_string(s.own_late_mean_us) + " us");

            // The flight recorder: the last all_reduce (a large one), who
            // called it last, and what carried it.
            const auto ops = c.trace_records();
            const dcomm::trace::op_record* last = nullptr;
            for (const auto& op : ops)
              if (std::string(op.operation) == "all_reduce") last = &op;
            require(last != nullptr, "no all_reduce recorded");
            require(last->last_caller == 2, "last caller " + std::to_string(last->last_caller));
            require(last->last_call_ns - last->first_call_ns > 20'000'000, "its lateness");
            require(last->carried.names() == expected_transport(l),
                    "carried by " + last->carried.names());
            require(last->ran != dcomm::algorithm::automatic, "the algorithm that ran unsaid");
          },
          20s, [l](int rank) { return links_of(l, rank); });
    }
  }

  TEST_CASE("what carried a call and what ran: arena, ring, a group of one") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(
        2,
        [](comm& c, int rank) -> asio::awaitable<void> {
          std::vector<float> v(4, 1.0f);
          co_await c.all_reduce(v, dcomm::sum);
          co_await c.with({.algorithm = dcomm::algorithm::ring}).all_reduce(v, dcomm::sum);
          auto alone = co_await c.split(rank, 0);
          require(alone.has_value(), "split made no group");
          co_await alone->all_reduce(v, dcomm::sum);
          const auto ops = c.trace_records();
          require(ops.size() == 4, "records: " + std::to_string(ops.size()));
          require(ops[0].carried.names() == "shm" && ops[0].ran == dcomm::algorithm::shared_memory,
                  "the arena's call: " + ops[0].carried.names());
          require(ops[1].carried.names() == "shm" && ops[1].ran == dcomm::algorithm::ring,
                  "the ring over the shared memory rings: " + ops[1].carried.names());
          require(ops[3].carried.names() == "none" && ops[3].last_caller == -1,
                  "a group of one: " + ops[3].carried.names());
          require(c.stats().collectives_measured == 3, "the group of one measured");
        },
        20s, [](int rank) { return links_of(links::shm, rank); });
  }

  TEST_CASE("rank 0 warns once of a rank that keeps calling last") {
    DCOMM_TEST_DEADLINE(120s);
    for (const char* threshold : {"2", "0"}) {
      CAPTURE(threshold);
      straggler_ms set(threshold);
      captured_stderr err;
      DCOMM_REQUIRE_WORLD(3, [](comm& c, int rank) -> asio::awaitable<void> {
        for (int i = 0; i < 80; ++i) {
          if (rank == 1) co_await pause(5ms);
          co_await c.barrier();
        }
      });
      const std::string said = err.release();
      INFO(said);
      const std::string warning = "rank 1 called last in ";
      CHECK(count_of(said, warning) == (threshold[0] == '0' ? 0 : 1));
      if (threshold[0] != '0') CHECK(contains(said, "of the last 64 collectives, on average"));
    }
  }

  TEST_CASE("arrival stamps: rounding, merging, and clocks of another boot") {
    using dcomm::detail::arrivals;
    arrivals a;
    a.note(1'000'500, 0);
    a.note(1'000'000, 1);
    a.note(1'003'200, 3);
    CHECK(a.last_rank == 3);
    CHECK(a.spread_ns() == 3200);
    CHECK_FALSE(a.others);
    const auto s = dcomm::detail::stamp_of(a);
    CHECK(s.spread_us == 4);                                // rounded up: never a later first call
    const arrivals b = dcomm::detail::arrivals_of(s, 500);  // their clock 500 ns behind
    CHECK(b.others);
    CHECK(b.last_ns == 1'003'700);
    CHECK(b.first_ns == 999'700);
    arrivals mine;
    mine.note(1'002'000, 2);
    mine.merge(b);
    CHECK(mine.others);
    CHECK(mine.last_rank == 3);
    CHECK(mine.first_ns == 999'700);
    CHECK(dcomm::detail::stamp_of(arrivals{}).last_rank == -1);
    CHECK_FALSE(dcomm::detail::arrivals_of({}).known());
    // Two boots: moved by the difference of (wall - steady); one boot: not.
    using dcomm::cpu::clock_offset;
    CHECK(clock_offset("boot-a 5000", "boot-a 1000") == 0);
    CHECK(clock_offset("boot-b 5000", "boot-a 1000") == 4000);
    CHECK(clock_offset("boot-b -300", "boot-a 200") == -500);
    CHECK(clock_offset("", "boot-a 200") == 0);
    CHECK(contains(dcomm::cpu::clock_to_publish(), " "));
  }
}
