// Growing a job in place (issue 43, dcomm/elastic.hpp): joiners admitted at
// the members' grow(), ranked after them; a killed rank's replacement joins
// the survivors after they shrink, rank 0 killed too (the store has a
// process of its own), and heal() brings it the model and the step, cycle
// after cycle. Processes: fork.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/cpu_backend.hpp"
#include "dcomm/elastic.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/store/tcp_store.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"
#include "support/store_process.hpp"

using namespace std::chrono_literals;

namespace elastic_grow {

using dcomm::test::store_process;

// Which host process `index` plays: 0 unless DCOMM_TEST_HOSTS=k.
int host_of(int index) {
  const char* hosts = std::getenv("DCOMM_TEST_HOSTS");
  const int k = hosts && *hosts ? std::max(1, std::atoi(hosts)) : 0;
  return k > 0 ? index % k : 0;
}

// Process `index`'s options. DCOMM_TEST_HOSTS=k plays k hosts (shared
// memory inside each, TCP between them), process i on host i mod k: meson
// runs the suite so.
dcomm::init_options<dcomm::cpu_backend> job_options(int index) {
  dcomm::init_options<dcomm::cpu_backend> o{.timeout = 20s};
  o.backend.bind_host = "127.0.0.1";
  o.backend.revoke_on_failure = true;
  if (std::getenv("DCOMM_TEST_HOSTS"))
    o.backend.host_id = "test-host-" + std::to_string(host_of(index));
  return o;
}

// 0 when c is a world of `size` ranks numbered 0 to size - 1 that reduce;
// `index` is this process's in the test. Sets *host_peers to how many of
// c's ranks play this process's host: its links' kinds, which set how
// many descriptors it holds.
asio::awaitable<int> check_world(const dcomm::communicator<dcomm::cpu_backend>& c, int size,
                                 int index, int* host_peers = nullptr) {
  if (c.size() != size) co_return 30 + c.size();
  std::vector<int> sums{1, c.rank()};
  co_await c.all_reduce(sums, dcomm::sum, asio::use_awaitable);
  const std::vector<int> indices = co_await c.all_gather_object(index, asio::use_awaitable);
  if (host_peers)
    *host_peers = static_cast<int>(std::count_if(
        indices.begin(), indices.end(), [&](int i) { return host_of(i) == host_of(index); }));
  co_return sums[0] == size&& sums[1] == size*(size - 1) / 2 ? 0 : 40;
}

// What a process holds: descriptors, mappings of shared memory segments
// (memfds named "dcomm-shm"), resident memory.
struct resources {
  int fds = 0, shm_maps = 0;
  int host_peers = 0;  // of the world at the time (check_world)
  long resident_kib = 0;
  static resources now() {
    resources r;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
      ++r.fds;
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);)
      if (line.find("dcomm-shm") != std::string::npos) ++r.shm_maps;
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.starts_with("VmRSS:")) r.resident_kib = std::atol(line.c_str() + 6);
    return r;
  }
};

// Whether `n` tickets are taken in the job's store (join()'s first step:
// docs/elastic.md) within a few seconds.
asio::awaitable<bool> tickets_taken(dcomm::store& s, std::int64_t n) {
  for (int tries = 0; tries < 4000; ++tries) {
    if (co_await s.add("dcomm/elastic/tickets", 0, asio::use_awaitable) >= n) co_return true;
    asio::steady_timer pause(co_await asio::this_coro::executor, 1ms);
    co_await pause.async_wait(asio::use_awaitable);
  }
  co_return false;
}

bool lost(const dcomm::error& e) {
  return e.code() == dcomm::errc::peer_lost || e.code() == dcomm::errc::revoked;
}

}  // namespace elastic_grow

using namespace elastic_grow;

TEST_SUITE("cpu elastic grow") {
  TEST_CASE("grow admits the joiners waiting, ranked after the members in the order they came") {
    DCOMM_TEST_DEADLINE(120s);
    for (const auto& [m, j] : {std::pair{1, 1}, {2, 1}, {3, 2}, {2, 3}}) {
      const int members = m, joiners = j;  // (clang 14 captures no structured binding)
      CAPTURE(members);
      CAPTURE(joiners);
      store_process job;
      auto results = dcomm::test::fork_world(members + joiners, 60s, [&](int index) -> int {
        asio::io_context context{1};
        return dcomm::sync_wait(context, [&]() -> asio::awaitable<int> {
          auto s = job.client(context.get_executor());
          auto o = job_options(index);
          if (index >= members) {
            auto c = co_await dcomm::join<dcomm::cpu_backend>(context.get_executor(), s, o,
                                                              asio::use_awaitable);
            if (c.rank() < members) co_return 20 + c.rank();
            co_return co_await check_world(c, members + joiners, index);
          }
          auto c = co_await dcomm::init_process_group<dcomm::cpu_backend>(
              context.get_executor(), s, index, members, o, asio::use_awaitable);
          // Every joiner waiting first: a joiner admitted by an earlier grow
          // than the last one's would check a world without the later ones
          // (seen under ASan, where joiners start slowly).
          if (!co_await tickets_taken(*s, joiners)) co_return 6;
          // Steps, each ending in grow(), until every joiner is in.
          for (int step = 0; c.size() < members + joiners; ++step) {
            if (step > 4000) co_return 3;
            std::vector<float> v{1.0f};
            co_await c.all_reduce(v, dcomm::sum, asio::use_awaitable);
            if (v[0] != static_cast<float>(c.size())) co_return 4;
            c = co_await dcomm::grow(c, o, asio::use_awaitable);
            if (c.rank() != index) co_return 5;  // a member keeps its rank
            asio::steady_timer pause(context, 1ms);
            co_await pause.async_wait(asio::use_awaitable);
          }
          co_return co_await check_world(c, members + joiners, index);
        }());
      });
      INFO(dcomm::test::describe(results));
      for (const auto& r : results) CHECK(r.exit_code == 0);
    }
  }

  TEST_CASE("grow with nobody waiting returns the communicator itself") {
    DCOMM_TEST_DEADLINE(60s);
    store_process job;
    auto results = dcomm::test::fork_world(3, 30s, [&](int rank) -> int {
      asio::io_context context{1};
      return dcomm::sync_wait(context, [&]() -> asio::awaitable<int> {
        auto s = job.client(context.get_executor());
        auto o = job_options(rank);
        auto c = co_await dcomm::init_process_group<dcomm::cpu_backend>(
            context.get_executor(), s, rank, 3, o, asio::use_awaitable);
        auto same = co_await dcomm::grow(c, o, asio::use_awaitable);
        if (&same.backend() != &c.backend()) co_return 2;
        co_return co_await check_world(same, 3, rank);
      }());
    });
    INFO(dcomm::test::describe(results));
    for (const auto& r : results) CHECK(r.exit_code == 0);
  }

  TEST_CASE("a joiner lost after its admission fails the members' grow; they keep their world") {
    DCOMM_TEST_DEADLINE(60s);
    store_process job;
    auto results = dcomm::test::fork_world(3, 30s, [&](int index) -> int {
      asio::io_context context{1};
      return dcomm::sync_wait(context, [&]() -> asio::awaitable<int> {
        auto s = job.client(context.get_executor());
        auto o = job_options(index);
        o.timeout = 2s;
        if (index == 2) {
          // join()'s first half (the protocol's keys, docs/elastic.md),
          // then death before the meeting.
          const std::int64_t ticket =
              co_await s->add("dcomm/elastic/tickets", 1, asio::use_awaitable);
          const std::string g = co_await s->get("dcomm/elastic/call/" + std::to_string(ticket), 20s,
                                                asio::use_awaitable);
          co_await s->set("dcomm/elastic/answer/" + g + "/" + std::to_string(ticket), "1",
                          asio::use_awaitable);
          co_await s->get("dcomm/elastic/admit/" + std::to_string(ticket), 20s,
                          asio::use_awaitable);
          ::kill(::getpid(), SIGKILL);
        }
        auto c = co_await dcomm::init_process_group<dcomm::cpu_backend>(
            context.get_executor(), s, index, 2, o, asio::use_awaitable);
        // Until the joiner has its ticket: grow() returns c itself.
        if (!co_await tickets_taken(*s, 1)) co_return 3;
        std::vector<int> in{1};
        co_await c.all_reduce(in, dcomm::sum, asio::use_awaitable);  // both saw the ticket
        try {
          auto grown = co_await dcomm::grow(c, o, asio::use_awaitable);
          co_return 4;
        } catch (const dcomm::error& e) {
          // The new world's rank 2 never came: named, by the deadline.
          const std::string what = e.what();
          if (e.code() != dcomm::errc::timeout && e.code() != dcomm::errc::peer_lost) co_return 5;
          if (what.find("ranks {2}") == std::string::npos) co_return 6;
        }
        // The old world goes on, and grows again (nobody waits now).
        auto same = co_await dcomm::grow(c, o, asio::use_awaitable);
        if (&same.backend() != &c.backend()) co_return 7;
        co_return co_await check_world(same, 2, index);
      }());
    });
    INFO(dcomm::test::describe(results));
    CHECK(results[2].signal == SIGKILL);
    CHECK(results[0].exit_code == 0);
    CHECK(results[1].exit_code == 0);
  }

  TEST_CASE("a joiner that died waiting is not admitted: the grow goes on without it") {
    DCOMM_TEST_DEADLINE(60s);
    store_process job;
    auto results = dcomm::test::fork_world(4, 30s, [&](int index) -> int {
      asio::io_context context{1};
      return dcomm::sync_wait(context, [&]() -> asio::awaitable<int> {
        auto s = job.client(context.get_executor());
        auto o = job_options(index);
        o.timeout = 20s;   // a grow that waited for the dead one would take that long
        if (index == 2) {  // join()'s first step (docs/elastic.md), then death
          co_await s->add("dcomm/elastic/tickets", 1, asio::use_awaitable);
          ::kill(::getpid(), SIGKILL);
        }
        if (index == 3) {  // the next ticket: a live joiner
          if (!co_await tickets_taken(*s, 1)) co_return 2;
          auto c = co_await dcomm::join<dcomm::cpu_backend>(context.get_executor(), s, o,
                                                            asio::use_awaitable);
          if (c.rank() != 2) co_return 3;
          co_return co_await check_world(c, 3, index);
        }
        auto c = co_await dcomm::init_process_group<dcomm::cpu_backend>(
            context.get_executor(), s, index, 2, o, asio::use_awaitable);
        if (!co_await tickets_taken(*s, 2)) co_return 4;
        std::vector<int> in{1};
        co_await c.all_reduce(in, dcomm::sum, asio::use_awaitable);  // both saw the tickets
        const auto started = std::chrono::steady_clock::now();
        auto grown = co_await dcomm::grow(c, o, asio::use_awaitable);
        if (std::chrono::steady_clock::now() - started > 10s) co_return 5;
        if (grown.rank() != index) co_return 6;
        co_return co_await check_world(grown, 3, index);
      }());
    });
    INFO(dcomm::test::describe(results));
    CHECK(results[2].signal == SIGKILL);
    for (int i : {0, 1, 3}) CHECK(results[static_cast<std::size_t>(i)].exit_code == 0);
  }

  TEST_CASE("close_joins: a waiting joiner and a later one fail with closed at once") {
    DCOMM_TEST_DEADLINE(60s);
    store_process job;
    auto results = dcomm::test::fork_world(4, 30s, [&](int index) -> int {
      asio::io_context context{1};
      return dcomm::sync_wait(context, [&]() -> asio::awaitable<int> {
        auto s = job.client(context.get_executor());
        auto o = job_options(index);
        o.timeout = 20s;  // a joiner that waited it out would fail the checks' 10 s
        if (index >= 2) {
          const std::vector<std::string> mark{"closed-by-test"};  // named: g++ 12, co_await
          if (index == 3)                                         // comes after the close
            co_await s->wait(mark, 20s, asio::use_awaitable);
          const auto started = std::chrono::steady_clock::now();
          try {
            co_await dcomm::join<dcomm::cpu_backend>(context.get_executor(), s, o,
                                                     asio::use_awaitable);
            co_return 2;
          } catch (const dcomm::error& e) {
            if (e.code() != dcomm::errc::closed) co_return 3;
            if (std::string(e.what()).find("close_joins") == std::string::npos) co_return 4;
          }
          co_return std::chrono::steady_clock::now() - started < 10s ? 0 : 5;
        }
        auto c = co_await dcomm::init_process_group<dcomm::cpu_backend>(
            context.get_executor(), s, index, 2, o, asio::use_awaitable);
        // Until joiner 2 waits (its ticket taken), then closed by rank 0.
        if (!co_await tickets_taken(*s, 1)) co_return 6;
        std::vector<int> in{1};
        co_await c.all_reduce(in, dcomm::sum, asio::use_awaitable);  // both saw the ticket
        if (c.rank() == 0) {
          co_await dcomm::close_joins(c, asio::use_awaitable);
          co_await s->set("closed-by-test", "1", asio::use_awaitable);
        }
        co_await c.barrier(asio::use_awaitable);
        // Closed: grow admits nobody, although a ticket waits.
        auto same = co_await dcomm::grow(c, o, asio::use_awaitable);
        if (&same.backend() != &c.backend()) co_return 7;
        co_return co_await check_world(same, 2, index);
      }());
    });
    INFO(dcomm::test::describe(results));
    for (const auto& r : results) CHECK(r.exit_code == 0);
  }

  // The loop: a rank dies, the survivors revoke and shrink, a
  // replacement joins at their grow(), the world is whole again; cycle
  // after cycle in one job (3; DCOMM_TEST_ELASTIC_CYCLES=20 by hand). A
  // survivor of every cycle holds no more descriptors, shared memory
  // mappings or resident memory after the last than after the first with
  // the same links.
  TEST_CASE("a killed rank's replacement joins the survivors: shrink, grow, cycle after cycle") {
    const char* asked_cycles = std::getenv("DCOMM_TEST_ELASTIC_CYCLES");
    const int world = 4, cycles = asked_cycles ? std::max(1, std::atoi(asked_cycles)) : 3;
    const int steps = 3 * cycles + 3;
    DCOMM_TEST_DEADLINE(std::chrono::seconds(60 + 10 * cycles));
    // Rank 0 first, then ranks 2 and 3 in turn: the original ranks 1 and 2
    // survive every cycle; the others die, replacements among them.
    const auto victim_rank = [](int cycle) { return cycle == 0 ? 0 : cycle % 2 == 1 ? 2 : 3; };
    const auto kill_step = [](int cycle) { return 2 + 3 * cycle; };
    store_process job;
    const auto limit = std::chrono::seconds(50 + 10 * cycles);
    auto results = dcomm::test::fork_world(world + cycles, limit, [&](int index) -> int {
      asio::io_context context{1};
      return dcomm::sync_wait(context, [&]() -> asio::awaitable<int> {
        auto s = job.client(context.get_executor());
        auto o = job_options(index);
        dcomm::communicator<dcomm::cpu_backend> c;
        std::vector<int> state{0, 0};  // the step to run, the cycles done
        // The model: every element step + 1 once a step is done (a step
        // done twice leaves it as it was). heal() brings it to a joiner,
        // with `state`, from the most advanced member.
        std::vector<float> model(1 << 14, 0.0f);
        const std::vector<std::span<std::uint8_t>> held_state{dcomm::bytes_of(model),
                                                              dcomm::bytes_of(state)};
        if (index < world) {
          c = co_await dcomm::init_process_group<dcomm::cpu_backend>(
              context.get_executor(), s, index, world, o, asio::use_awaitable);
        } else {
          // Replacement k comes once the survivors ask for it.
          const std::string k = std::to_string(index - world);
          // Named, not braced in the co_await: g++ 12 destroys such temporaries twice.
          std::vector<std::string> asked{"test/replace/" + k};
          co_await s->wait(asked, limit, asio::use_awaitable);
          c = co_await dcomm::join<dcomm::cpu_backend>(context.get_executor(), s, o,
                                                       asio::use_awaitable);
          const dcomm::heal_result h = co_await dcomm::heal(c, -1, held_state, asio::use_awaitable);
          if (h.step != state[0] || model[0] != model.back()) co_return 8;
          if (int bad = co_await check_world(c, world, index)) co_return bad;
        }
        std::vector<resources> held;  // after each recovery
        while (state[0] < steps) {
          const int cycle = state[1];
          std::vector<float> v(1 << 12, 1.0f);
          if (cycle < cycles && c.rank() == victim_rank(cycle) && state[0] == kill_step(cycle)) {
            c.all_reduce(v, dcomm::sum, [](std::exception_ptr) {});
            std::this_thread::sleep_for(1ms);
            ::kill(::getpid(), SIGKILL);
          }
          bool failed = false;
          try {
            co_await c.all_reduce(v, dcomm::sum, asio::use_awaitable);
          } catch (const dcomm::error& e) {
            if (!lost(e)) throw;
            failed = true;
          }
          if (!failed) {
            if (v[0] != static_cast<float>(c.size())) co_return 10 + state[0];
            std::fill(model.begin(), model.end(), static_cast<float>(state[0] + 1));
            ++state[0];
            continue;
          }
          // Recover: shrink, redo the earliest step not finished
          // everywhere, ask for a replacement and grow until it is in.
          c = co_await c.shrink(asio::use_awaitable);
          std::vector<int> redo{state[0]};
          co_await c.all_reduce(redo, dcomm::min, asio::use_awaitable);
          state[0] = redo[0];  // (in place: heal reads these bytes)
          state[1] = cycle + 1;
          if (c.rank() == 0)
            co_await s->set("test/replace/" + std::to_string(cycle), "1", asio::use_awaitable);
          for (int tries = 0; c.size() < world; ++tries) {
            if (tries > 4000) co_return 3;
            c = co_await dcomm::grow(c, o, asio::use_awaitable);
            asio::steady_timer pause(context, 1ms);
            co_await pause.async_wait(asio::use_awaitable);
          }
          const dcomm::heal_result h =
              co_await dcomm::heal(c, state[0], held_state, asio::use_awaitable);
          if (h.healed.empty() || h.healed.back() != world - 1) co_return 9;  // the joiner's
          int host_peers = 0;
          if (int bad = co_await check_world(c, world, index, &host_peers)) co_return bad;
          held.push_back(resources::now());
          held.back().host_peers = host_peers;
        }
        if (state[1] != cycles) co_return 50 + state[1];
        // The old worlds' links and segments closed: as many held as after
        // the first recovery with the same links (as many peers on this
        // host). Closing is bounded but asynchronous (goodbyes on the
        // links): wait up to 2 s for the last ones; what leaked never goes.
        const auto alike = std::find_if(held.begin(), held.end(), [&](const resources& r) {
          return r.host_peers == held.back().host_peers;
        });
        if (held.size() == static_cast<std::size_t>(cycles) && alike != held.end() - 1) {
          resources last = resources::now();
          for (int i = 0; i < 200 && (last.fds > alike->fds || last.shm_maps > alike->shm_maps);
               ++i) {
            asio::steady_timer pause(context, 10ms);
            co_await pause.async_wait(asio::use_awaitable);
            last = resources::now();
          }
          if (last.fds > alike->fds) co_return 60;
          if (last.shm_maps > alike->shm_maps) co_return 61;
          if (last.resident_kib > alike->resident_kib + 16 * 1024) co_return 62;
        }
        co_return co_await check_world(c, world, index);
      }());
    });
    INFO(dcomm::test::describe(results));
    // The victims, members and replacements, died; the other four finished.
    int killed = 0;
    for (const auto& r : results) {
      if (r.signal == SIGKILL)
        ++killed;
      else
        CHECK(r.exit_code == 0);
    }
    CHECK(killed == cycles);
  }
}
