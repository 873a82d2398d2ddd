// elastic_bench: what a lost rank costs the survivors (issue 43,
// docs/elastic.md). In each round a world of forked ranks all_reduces; one
// rank (a different one each round, rank 0 among them) SIGKILLs itself in the
// middle of one; the survivors, with revoke_on_failure, catch the error,
// shrink and all_reduce again. A row per world: from the kill to the
// survivors' error (detection, the revoke's flood), to shrink's return
// (agreement and the new communicator), and to the end of their next
// all_reduce, each the slowest survivor's, the median and the largest of
// the rounds. The clock is CLOCK_MONOTONIC, one for every process of the host.
//
//   elastic_bench --world 8 --rounds 20
//   elastic_bench --world 8 --hosts 2          # shared memory inside, TCP across
//   elastic_bench --world 4 --transport tcp
//   elastic_bench --world 8 --netns dcb0=10.99.0.2,dcb1=10.99.0.3 --master-addr 10.99.0.1
//                                               # hosts as network namespaces (root)
//   elastic_bench --world 2 --heal 100M         # heal(): rank 0's state to the others
//   elastic_bench --world 3 --replace 100M      # a replacement from its exec to training
//
// --replace: the job's store in a process of its own (as dcomm-run
// --elastic serves it); the members all_reduce and grow at every step; a
// new process (this program, exec'd) joins, is healed B bytes of state
// and all_reduces with them. A row: ms from the fork before its exec to
// join's return, to heal's, and to the end of its first all_reduce.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../tests/support/fork_world.hpp"
#include "../tests/support/listening_socket.hpp"
#include "../tests/support/store_process.hpp"
#include "dcomm/command_line.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/elastic.hpp"
#include "dcomm/init_process_group.hpp"

namespace {

using namespace std::chrono_literals;

struct settings {
  int world = 4;
  int hosts = 0;          // > 0: the ranks play this many hosts of consecutive ranks
  std::string transport;  // cpu_backend::options::transport; empty: the backend's
  int rounds = 10;
  std::size_t bytes = 4;
  int warmup = 20;                // all_reduces before the kill
  std::size_t heal_bytes = 0;     // > 0: time heal() of this much state instead
  std::size_t replace_bytes = 0;  // > 0: time a replacement's start instead
  // "NAME=ADDR,...": the ranks are hosts in these network namespaces
  // (consecutive ranks in each), bound to ADDR; the store at master_addr.
  std::string netns;
  std::string master_addr = "127.0.0.1";
};

// --netns's namespaces, in order: {name, address}.
std::vector<std::pair<std::string, std::string>> namespaces_of(const settings& s) {
  std::vector<std::pair<std::string, std::string>> found;
  for (std::size_t at = 0; at < s.netns.size();) {
    std::size_t comma = s.netns.find(',', at);
    if (comma == std::string::npos) comma = s.netns.size();
    const std::string entry = s.netns.substr(at, comma - at);
    const std::size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == entry.size())
      throw std::invalid_argument("--netns: '" + entry + "' is not NAME=ADDRESS");
    found.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
    at = comma + 1;
  }
  return found;
}

// Rank `rank`'s namespace of --netns: {name, address}; none without it.
std::optional<std::pair<std::string, std::string>> namespace_of(const settings& s, int rank) {
  const auto spaces = namespaces_of(s);
  if (spaces.empty()) return std::nullopt;
  return spaces[static_cast<std::size_t>(rank) * spaces.size() / static_cast<std::size_t>(s.world)];
}

// Moves this (single-threaded, just forked) rank into its network
// namespace of --netns (ip netns add's /var/run/netns/NAME).
void enter_namespace(const settings& s, int rank) {
  const auto space = namespace_of(s, rank);
  if (!space) return;
  const std::string path = "/var/run/netns/" + space->first;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0)
    throw std::system_error(errno, std::generic_category(), "setns " + path);
  ::close(fd);
}

constexpr int max_world = 64;

// What the ranks of one round write, in memory every process shares.
struct round_record {
  std::atomic<std::int64_t> killed_ns{0};
  std::int64_t caught_ns[max_world];
  std::int64_t shrunk_ns[max_world];
  std::int64_t next_ns[max_world];
};

// A round's record, in memory the forked ranks share (mapped before the
// fork): every rank writes its own slots.
struct shared_record {
  round_record* record = nullptr;
  shared_record() {
    void* p = ::mmap(nullptr, sizeof(round_record), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
    record = static_cast<round_record*>(p);
  }
  ~shared_record() { ::munmap(record, sizeof(round_record)); }
  shared_record(const shared_record&) = delete;
  shared_record& operator=(const shared_record&) = delete;
};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool lost(const dcomm::error& e) {
  return e.code() == dcomm::errc::peer_lost || e.code() == dcomm::errc::revoked;
}

// Rank `rank`'s start-up: loopback, the links and hosts asked for.
dcomm::init_options<dcomm::cpu_backend> rank_options(const settings& s, int rank,
                                                     std::chrono::milliseconds timeout) {
  dcomm::init_options<dcomm::cpu_backend> o{.timeout = timeout};
  o.backend.bind_host = "127.0.0.1";
  o.backend.revoke_on_failure = true;
  if (!s.transport.empty()) o.backend.transport = s.transport;
  if (s.hosts > 0) o.backend.host_id = "bench-host-" + std::to_string(rank * s.hosts / s.world);
  if (const auto space = namespace_of(s, rank)) {
    o.backend.bind_host = space->second;
    o.backend.host_id = "bench-netns-" + space->first;  // a host of its own: no shared memory
  }
  return o;
}

// The "links" column.
std::string links_of(const settings& s) {
  if (!s.netns.empty()) return std::to_string(namespaces_of(s).size()) + " netns";
  if (s.hosts > 0) return std::to_string(s.hosts) + " hosts";
  return s.transport.empty() ? "auto" : s.transport;
}

// One rank of a round: `victim` kills itself in its all_reduce number
// s.warmup; the others return 0 once they have all_reduced after shrinking.
int run_rank(const settings& s, int rank, int victim, round_record& record) {
  enter_namespace(s, rank);
  auto c = dcomm::init_process_group<dcomm::cpu_backend>(rank_options(s, rank, 20s));
  std::vector<float> v(std::max<std::size_t>(1, s.bytes / sizeof(float)), 1.0f);
  for (int step = 0;; ++step) {
    if (rank == victim && step == s.warmup) {
      c.all_reduce(v, dcomm::sum, [](std::exception_ptr) {});
      std::this_thread::sleep_for(100us);
      record.killed_ns = now_ns();
      ::kill(::getpid(), SIGKILL);
    }
    try {
      c.all_reduce(v, dcomm::sum, dcomm::blocking);
      std::fill(v.begin(), v.end(), 1.0f);
    } catch (const dcomm::error& e) {
      if (!lost(e)) throw;
      record.caught_ns[rank] = now_ns();
      break;
    }
    if (step > s.warmup + 1000) return 3;  // the failure never came
  }
  c = c.shrink(dcomm::blocking);
  record.shrunk_ns[rank] = now_ns();
  std::fill(v.begin(), v.end(), 1.0f);
  c.all_reduce(v, dcomm::sum, dcomm::blocking);
  record.next_ns[rank] = now_ns();
  return v[0] == static_cast<float>(s.world - 1) && c.size() == s.world - 1 ? 0 : 4;
}

struct spread {
  double median = 0, largest = 0;
};

spread of(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  if (ms.empty()) return {};
  return {ms[ms.size() / 2], ms.back()};
}

int run(const settings& s) {
  shared_record shared;
  round_record* record = shared.record;
  std::vector<double> caught, shrunk, next;
  int failed_rounds = 0;
  for (int round = 0; round < s.rounds; ++round) {
    new (record) round_record{};
    const int victim = round % s.world;
    dcomm::test::listening_socket master(s.master_addr.c_str());
    auto results = dcomm::test::fork_world(s.world, 60s, [&](int rank) -> int {
      dcomm::test::set_rank_environment(master, rank, s.world);
      ::setenv("MASTER_ADDR", s.master_addr.c_str(), 1);
      return run_rank(s, rank, victim, *record);
    });
    bool ok = true;
    std::int64_t last_caught = 0, last_shrunk = 0, last_next = 0;
    for (int r = 0; r < s.world; ++r) {
      if (r == victim) continue;
      const auto& result = results[static_cast<std::size_t>(r)];
      if (!result.ok()) {
        ok = false;
        std::fprintf(stderr, "elastic_bench: round %d (rank %d killed): %s\n", round, victim,
                     dcomm::test::describe(results).c_str());
        break;
      }
      last_caught = std::max(last_caught, record->caught_ns[r]);
      last_shrunk = std::max(last_shrunk, record->shrunk_ns[r]);
      last_next = std::max(last_next, record->next_ns[r]);
    }
    if (!ok || record->killed_ns == 0) {
      ++failed_rounds;
      continue;
    }
    const double killed = static_cast<double>(record->killed_ns.load());
    caught.push_back((static_cast<double>(last_caught) - killed) / 1e6);
    shrunk.push_back((static_cast<double>(last_shrunk) - killed) / 1e6);
    next.push_back((static_cast<double>(last_next) - killed) / 1e6);
  }
  const auto c = of(caught), sh = of(shrunk), n = of(next);
  const std::string links = links_of(s);
  std::printf("%6d %10s %10zu %7zu %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", s.world, links.c_str(),
              s.bytes, caught.size(), c.median, c.largest, sh.median, sh.largest, n.median,
              n.largest);
  if (failed_rounds > 0) std::fprintf(stderr, "elastic_bench: %d round(s) failed\n", failed_rounds);
  return failed_rounds > 0 ? 1 : 0;
}

// heal(): rank 0 at step 1 with a pattern, the others at step 0 with zeros;
// the slowest rank's time, from a barrier's end to heal's.
int run_heal(const settings& s) {
  shared_record shared;
  round_record* record = shared.record;
  std::vector<double> ms;
  for (int round = 0; round < s.rounds; ++round) {
    new (record) round_record{};
    dcomm::test::listening_socket master(s.master_addr.c_str());
    auto results = dcomm::test::fork_world(s.world, 120s, [&](int rank) -> int {
      dcomm::test::set_rank_environment(master, rank, s.world);
      ::setenv("MASTER_ADDR", s.master_addr.c_str(), 1);
      enter_namespace(s, rank);
      auto c = dcomm::init_process_group<dcomm::cpu_backend>(rank_options(s, rank, 60s));
      std::vector<std::uint8_t> model(s.heal_bytes, 0);
      if (rank == 0)
        for (std::size_t i = 0; i < model.size(); ++i) model[i] = static_cast<std::uint8_t>(i * 7);
      std::vector<std::span<std::uint8_t>> state{dcomm::bytes_of(model)};
      c.barrier(dcomm::blocking);
      const std::int64_t start = now_ns();
      const auto h = dcomm::heal(c, rank == 0 ? 1 : 0, state, dcomm::blocking);
      record->next_ns[rank] = now_ns() - start;
      const bool ok =
          h.source == 0 && model.back() == static_cast<std::uint8_t>((model.size() - 1) * 7);
      return ok ? 0 : 2;
    });
    std::int64_t slowest = 0;
    bool ok = true;
    for (int r = 0; r < s.world; ++r) {
      ok = ok && results[static_cast<std::size_t>(r)].ok();
      slowest = std::max(slowest, record->next_ns[r]);
    }
    if (!ok) {
      std::fprintf(stderr, "elastic_bench: heal round %d: %s\n", round,
                   dcomm::test::describe(results).c_str());
      return 1;
    }
    ms.push_back(static_cast<double>(slowest) / 1e6);
  }
  const auto t = of(ms);
  const std::string links = links_of(s);
  std::printf("%6d %10s %12zu %7zu %9.2f %9.2f %8.2f\n", s.world, links.c_str(), s.heal_bytes,
              ms.size(), t.median, t.largest, static_cast<double>(s.heal_bytes) / (t.median * 1e6));
  return 0;
}

using dcomm::test::store_process;

void set_served_environment(const store_process& store) {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(store.socket.port).c_str(), 1);
  ::setenv("DCOMM_STORE_SERVED", "1", 1);
}

// The replacement (`elastic_bench --as-replacement B STARTED_NS`, exec'd
// by a member): join, heal, all_reduce; its times go to the store.
int run_replacement(std::size_t bytes, std::int64_t started) {
  ::unsetenv("RANK");
  settings s;
  // Its model made first, as a program's would be: the heal fills it.
  std::vector<std::uint8_t> model(bytes, 0);
  auto c = dcomm::join<dcomm::cpu_backend>(rank_options(s, 0, 20s));
  const std::int64_t joined = now_ns();
  std::vector<std::span<std::uint8_t>> state{dcomm::bytes_of(model)};
  const auto h = dcomm::heal(c, -1, state, dcomm::blocking);
  const std::int64_t healed = now_ns();
  std::vector<float> v{1.0f};
  c.all_reduce(v, dcomm::sum, dcomm::blocking);
  const std::int64_t trained = now_ns();
  const bool ok = h.step == 1 && model.back() == static_cast<std::uint8_t>((bytes - 1) * 7) &&
                  v[0] == static_cast<float>(c.size());
  auto store = dcomm::tcp_store::create(
      {.host = "127.0.0.1",
       .port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT"))),
       .timeout = 20s});
  store->set("bench/replacement",
             std::to_string(joined - started) + " " + std::to_string(healed - started) + " " +
                 std::to_string(trained - started) + " " + (ok ? "ok" : "wrong"),
             dcomm::blocking);
  return ok ? 0 : 2;
}

// A member: all_reduce and grow until the replacement is in (rank 0
// starts it after s.warmup steps), then heal it and all_reduce with it.
int run_member(const settings& s, int rank) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(s.world).c_str(), 1);
  const auto o = rank_options(s, rank, 20s);
  auto c = dcomm::init_process_group<dcomm::cpu_backend>(o);
  std::vector<std::uint8_t> model(s.replace_bytes);
  for (std::size_t i = 0; i < model.size(); ++i) model[i] = static_cast<std::uint8_t>(i * 7);
  pid_t replacement = -1;
  for (int step = 0; c.size() == s.world; ++step) {
    if (step > s.warmup + 100000) return 3;
    if (rank == 0 && step == s.warmup) {
      const std::string bytes = std::to_string(s.replace_bytes), started = std::to_string(now_ns());
      std::fflush(nullptr);
      replacement = ::fork();
      if (replacement == 0) {
        ::execl("/proc/self/exe", "elastic_bench", "--as-replacement", bytes.c_str(),
                started.c_str(), static_cast<char*>(nullptr));
        std::_Exit(127);
      }
    }
    std::vector<float> v{1.0f};
    c.all_reduce(v, dcomm::sum, dcomm::blocking);
    c = dcomm::grow(c, o, dcomm::blocking);
  }
  std::vector<std::span<std::uint8_t>> state{dcomm::bytes_of(model)};
  dcomm::heal(c, 1, state, dcomm::blocking);
  std::vector<float> v{1.0f};
  c.all_reduce(v, dcomm::sum, dcomm::blocking);
  int status = 0;
  if (replacement > 0) ::waitpid(replacement, &status, 0);
  return replacement < 0 || (WIFEXITED(status) && WEXITSTATUS(status) == 0) ? 0 : 4;
}

int run_replace(const settings& s) {
  std::vector<double> joined, healed, trained;
  for (int round = 0; round < s.rounds; ++round) {
    store_process store;
    set_served_environment(store);
    auto results = dcomm::test::fork_world(s.world, 120s,
                                           [&](int rank) -> int { return run_member(s, rank); });
    if (!std::all_of(results.begin(), results.end(), [](const auto& r) { return r.ok(); })) {
      std::fprintf(stderr, "elastic_bench: replace round %d: %s\n", round,
                   dcomm::test::describe(results).c_str());
      return 1;
    }
    auto client =
        dcomm::tcp_store::create({.host = "127.0.0.1", .port = store.socket.port, .timeout = 20s});
    long long j = 0, h = 0, t = 0;
    char verdict[16] = {};
    const std::string times = client->get("bench/replacement", dcomm::blocking);
    if (std::sscanf(times.c_str(), "%lld %lld %lld %15s", &j, &h, &t, verdict) != 4 ||
        std::string(verdict) != "ok") {
      std::fprintf(stderr, "elastic_bench: replace round %d: the replacement said '%s'\n", round,
                   times.c_str());
      return 1;
    }
    joined.push_back(static_cast<double>(j) / 1e6);
    healed.push_back(static_cast<double>(h) / 1e6);
    trained.push_back(static_cast<double>(t) / 1e6);
  }
  const auto j = of(joined), h = of(healed), t = of(trained);
  const std::string links = links_of(s);
  std::printf("%6d %10s %12zu %7zu %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", s.world, links.c_str(),
              s.replace_bytes, joined.size(), j.median, j.largest, h.median, h.largest, t.median,
              t.largest);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--as-replacement") try {
      return run_replacement(std::strtoull(argv[2], nullptr, 10), std::atoll(argv[3]));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "elastic_bench: the replacement: %s\n", e.what());
      return 1;
    }
  settings s;
  dcomm::command_line cl("elastic_bench",
                         "From a SIGKILL in an all_reduce to the survivors' next all_reduce: "
                         "detection, revoke, agree and shrink, in milliseconds.");
  cl.option("world", s.world, "N", "forked ranks; 4").at_least(2).at_most(max_world);
  cl.option("hosts", s.hosts, "K",
            "the ranks play K hosts of consecutive ranks: shared memory inside each, TCP "
            "between them")
      .at_least(1);
  cl.option("transport", s.transport, "auto|shm|tcp", "the links between ranks of this host")
      .one_of({"auto", "shm", "tcp"});
  cl.option("netns", s.netns, "NAME=ADDR,...",
            "the ranks are hosts in these network namespaces (ip netns add), consecutive ranks "
            "in each, bound to ADDR (root)");
  cl.option("master-addr", s.master_addr, "ADDR",
            "where the rendezvous listens (reachable from every namespace); 127.0.0.1");
  cl.option("rounds", s.rounds, "N", "kills, each in a fresh world; 10").at_least(1);
  cl.bytes("bytes", s.bytes, "B", "each all_reduce's size; 4");
  cl.option("warmup", s.warmup, "N", "all_reduces before the kill; 20").at_least(0);
  cl.bytes("heal", s.heal_bytes, "B",
           "time heal() instead: rank 0 ahead, the others get its B bytes of state");
  cl.bytes("replace", s.replace_bytes, "B",
           "time a replacement instead: from its exec to join, heal of B bytes, all_reduce");
  cl.parse(argc, argv);
  try {
    if (s.replace_bytes > 0) {
      std::printf(
          "# elastic_bench --replace: ms from the fork before a replacement's exec to its "
          "join's return, heal's (B bytes), first all_reduce's end\n");
      std::printf("# %4s %10s %12s %7s %19s %19s %19s\n", "world", "links", "bytes", "rounds",
                  "joined (med, max)", "healed (med, max)", "trained (med, max)");
      return run_replace(s);
    }
    if (s.heal_bytes > 0) {
      std::printf(
          "# elastic_bench --heal: ms of heal() of rank 0's state to the others (digest "
          "on every rank included), slowest rank; GB/s: bytes / median\n");
      std::printf("# %4s %10s %12s %7s %19s %8s\n", "world", "links", "bytes", "rounds",
                  "heal (med, max)", "GB/s");
      return run_heal(s);
    }
    std::printf(
        "# elastic_bench: ms from the kill to the slowest survivor's: error, shrink's "
        "return, next all_reduce's end\n");
    std::printf("# %4s %10s %10s %7s %19s %19s %19s\n", "world", "links", "bytes", "rounds",
                "error (med, max)", "shrunk (med, max)", "next (med, max)");
    return run(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_bench: %s\n", e.what());
    return 1;
  }
}
