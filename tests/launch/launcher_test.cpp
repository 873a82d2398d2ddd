// dcomm-run as a user runs it: a child process whose output and exit status
// are checked. Most ranks are /bin/sh scripts, so those tests cost processes,
// not builds; where a rank must speak dcomm, this very binary is the rank
// program (`launcher_tests --as-rank ...`, see main). $DCOMM_RUN is the
// launcher's path (set by meson).
//
// Size: dcomm-run's tests, the trace analyzer's (dcomm-trace run through
// dcomm-run) and the network interfaces' (dcomm-run in network namespaces),
// with the same helpers and rank programs, share this file: each test
// executable costs a compile of the CPU backend per build.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/cpu_backend.hpp"
#include "dcomm/detail/hmac.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/rendezvous.hpp"
#include "dcomm/trace/error_file.hpp"
#include "support/deadline.hpp"
#include "support/listening_socket.hpp"
#include "support/process_probe.hpp"
#include "support/run_launcher.hpp"

using namespace std::chrono_literals;
using dcomm::test::is_fresh_token;
using dcomm::test::start_time_if_running;
using namespace dcomm::test::launcher_run;

namespace {

// Waits (a few seconds at most) until none of `processes` (pid, start time)
// runs any more; returns the pids still running.
std::vector<pid_t> still_running_after_a_while(
    const std::vector<std::pair<pid_t, std::string>>& processes) {
  std::vector<pid_t> running;
  auto until = std::chrono::steady_clock::now() + 10s;
  do {
    running.clear();
    for (const auto& [pid, started] : processes)
      if (start_time_if_running(pid) == started) running.push_back(pid);
    if (running.empty()) break;
    std::this_thread::sleep_for(20ms);
  } while (std::chrono::steady_clock::now() < until);
  return running;
}

const std::string print_token = "echo token=${DCOMM_JOB_TOKEN:-none}";

// Each rank adds rank + 1 to the store's "sum", then waits until every rank has.
void add_to_sum_and_wait(const dcomm::rendezvous_result& world) {
  auto& s = *world.store;
  s.add("sum", world.rank + 1, dcomm::blocking);
  s.set("added/" + std::to_string(world.rank), "1", dcomm::blocking);
  std::vector<std::string> all;
  for (int r = 0; r < world.world_size; ++r) all.push_back("added/" + std::to_string(r));
  s.wait(all, dcomm::blocking);
}

// The rank program of the store test (`launcher_tests --as-rank` under
// dcomm-run). Rank 1 first knocks on the job's store as a stranger would,
// with no token; then every rank joins with what dcomm-run gave it, and they
// agree on a sum. Rank 0 says whether the stranger's key got in.
int as_rank() {
  try {
    const char* rank_text = std::getenv("RANK");
    const char* port_text = std::getenv("MASTER_PORT");
    if (!rank_text || !port_text || !std::getenv("MASTER_ADDR"))
      throw std::runtime_error("not started by dcomm-run");
    if (std::string(rank_text) == "1") {
      auto stranger =
          dcomm::tcp_store::create({.host = std::getenv("MASTER_ADDR"),
                                    .port = static_cast<std::uint16_t>(std::atoi(port_text)),
                                    .timeout = 20s,
                                    .job_token = ""});
      try {
        stranger->set("stranger", "was here", dcomm::blocking);
        std::printf("stranger: served\n");
      } catch (const dcomm::error& e) {
        std::printf("stranger: %s\n", e.code() == dcomm::errc::auth_failed ? "refused" : e.what());
      }
      std::fflush(stdout);
    }
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 30s});
    auto& s = *world.store;
    add_to_sum_and_wait(world);  // rank 1's stranger is done by now
    std::printf("sum=%s\n", s.get("sum", dcomm::blocking).c_str());
    if (world.rank == 0)
      std::printf(
          "stranger key: %s\n",
          s.check(std::vector<std::string>{"stranger"}, dcomm::blocking) ? "present" : "absent");
    std::fflush(stdout);
    dcomm::depart(world, dcomm::blocking);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank failed: %s\n", e.what());
    return 1;
  }
}

// The rank program under torchrun without --standalone
// (`launcher_tests --as-agent-store-rank`): rendezvous joins the agent's
// TCPStore; the ranks agree on a sum through it, then all_reduce.
int as_agent_store_rank() {
  try {
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 30s});
    const bool c10d = dynamic_cast<dcomm::c10d_store*>(world.store.get()) != nullptr;
    auto& s = *world.store;
    add_to_sum_and_wait(world);
    std::printf("rank %d: store %s, sum=%s\n", world.rank, c10d ? "c10d" : "dcomm",
                s.get("sum", dcomm::blocking).c_str());
    std::fflush(stdout);
    dcomm::depart(world, dcomm::blocking);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank failed: %s\n", e.what());
    return 1;
  }
}

// The rank program of the tcp:// tests (`launcher_tests --as-url-rank URL`
// under dcomm-run): the ranks meet through URL's store, agree on a sum and
// say where the store is.
int as_url_rank(const std::string& url) {
  try {
    auto world = dcomm::rendezvous({.init_method = url, .timeout = 5s});
    auto& s = *world.store;
    add_to_sum_and_wait(world);
    std::printf("sum=%s store=%s\n", s.get("sum", dcomm::blocking).c_str(), s.address().c_str());
    std::fflush(stdout);
    dcomm::depart(world, dcomm::blocking);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank failed: %s\n", e.what());
    return 1;
  }
}

// The rank program of the analyzer's tests (`launcher_tests --as-trace-rank
// SCENARIO` under dcomm-run --trace-dir; world 3, calls with 3 s deadlines). Every
// rank makes barrier #0 and all_reduce #1; then, for call #2:
//   sleeper:  rank 1 sleeps instead (until dcomm-run stops it)
//   lingering: as sleeper, but rank 2 stays after its call failed (still
//             running when dcomm-run asks for the dumps); rank 0 exits 1 s
//             after its own failure
//   mismatch: rank 1 calls broadcast (root 0) where the others all_reduce
//   killed:   rank 2 kills itself (SIGKILL)
//   clean:    every rank calls all_reduce (the job succeeds)
//   straggler: 20 all_reduces, rank 1 calling each 20 ms after the others;
//             then every rank dumps its recorder to DCOMM_TRACE_DIR itself
// A rank whose call fails says so and exits 1.
int as_trace_rank(const std::string& scenario) {
  try {
    // Start-up has the default deadline: a rank slow to start on a loaded
    // machine is not what these scenarios are about.
    auto comm = dcomm::init_process_group<dcomm::cpu_backend>({.init_method = "env://"});
    const dcomm::op_options o{.timeout = 3s};
    std::vector<float> v(4, 1.0f);
    comm.barrier(o, dcomm::blocking);
    comm.all_reduce(v, dcomm::sum, o, dcomm::blocking);
    std::printf("ready\n");
    std::fflush(stdout);
    const int rank = comm.rank();
    if ((scenario == "sleeper" || scenario == "lingering") && rank == 1) {
      std::this_thread::sleep_for(60s);
    } else if (scenario == "lingering") {
      try {
        comm.all_reduce(v, dcomm::sum, o, dcomm::blocking);
      } catch (const dcomm::error& e) {
        std::fprintf(stderr, "rank failed: %s\n", e.what());
        // Rank 2 has failed (and dumped) too when rank 0's exit stops the job.
        std::this_thread::sleep_for(rank == 2 ? 60s : 1s);
        return 1;
      }
    } else if (scenario == "killed" && rank == 2) {
      ::raise(SIGKILL);
    } else if (scenario == "mismatch" && rank == 1) {
      comm.broadcast(v, 0, o, dcomm::blocking);
    } else if (scenario == "straggler") {
      for (int i = 0; i < 20; ++i) {
        if (rank == 1) std::this_thread::sleep_for(20ms);
        comm.all_reduce(v, dcomm::sum, o, dcomm::blocking);
      }
      comm.dump_trace(dcomm::trace::failure_dump_path(rank));
    } else {
      comm.all_reduce(v, dcomm::sum, o, dcomm::blocking);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank failed: %s\n", e.what());
    return 1;
  }
}

// `launcher_tests --as-failing-rank` (world 3, under dcomm-run): rank 1
// throws from main, an uncaught exception that ends it through
// std::terminate; the others fail in a barrier on its loss.
int as_failing_rank() {
  auto comm =
      dcomm::init_process_group<dcomm::cpu_backend>({.init_method = "env://", .timeout = 5s});
  if (comm.rank() == 1) throw std::runtime_error("rank 1 gives up: its dataset is missing");
  comm.barrier(dcomm::blocking);
  return 0;
}

// What a survivor writes to its TORCHELASTIC_ERROR_FILE when `peer` is lost
// in `operation`; it then exits 1.
int exit_on_lost_peer(const char* operation, int rank, int peer) {
  const dcomm::error lost(dcomm::errc::peer_lost,
                          {.operation = operation,
                           .rank = rank,
                           .peers = "rank " + std::to_string(peer),
                           .detail = "it closed the connection without a goodbye"});
  dcomm::trace::write_error_file(lost.what());
  return 1;
}

// `launcher_tests --as-late-culprit` (world 2, under dcomm-run): rank 1
// fails first (its error file written) but its process lingers; rank 0
// then dies of it, naming it, and is reaped first. dcomm-run must name
// rank 1, as it would when the kernel reports a survivor's death before the
// failed rank's (its sockets close before its exit is reported).
int as_late_culprit() {
  const char* rank = std::getenv("RANK");
  if (rank && std::string(rank) == "1") {
    dcomm::trace::write_error_file("rank 1 gives up: its dataset is missing");
    std::this_thread::sleep_for(1500ms);
    return 3;
  }
  std::this_thread::sleep_for(300ms);
  return exit_on_lost_peer("barrier", 0, 1);
}

// `launcher_tests --as-killed-culprit` (world 3, under dcomm-run): while
// rank 0 holds dcomm-run stopped (SIGSTOP, 2 s), rank 2 is killed and
// rank 1 exits 1 with an error naming it, as a survivor does on the lost
// peer; once dcomm-run runs again it reaps both in one pass, stamped at
// the same moment. Rank 2, killed, wrote no error file: dcomm-run must
// name it, not rank 1 (as on a loaded machine, where dcomm-run is slow to
// run). Rank 0 stops dcomm-run only once ranks 1 and 2 have started
// (each leaves a file named for dcomm-run's pid): stopped earlier, it
// would start rank 2 only after the window, which then dies alone.
int as_killed_culprit() {
  const std::string rank = std::getenv("RANK") ? std::getenv("RANK") : "";
  const pid_t launcher = ::getppid();
  const auto started = [&](const std::string& r) {
    return "/tmp/dcomm-killed-culprit-" + std::to_string(launcher) + "." + r;
  };
  if (rank == "0") {
    for (int i = 0; i < 1000; ++i) {
      if (std::filesystem::exists(started("1")) && std::filesystem::exists(started("2"))) break;
      std::this_thread::sleep_for(10ms);
    }
    std::filesystem::remove(started("1"));
    std::filesystem::remove(started("2"));
    ::kill(launcher, SIGSTOP);
    std::this_thread::sleep_for(2s);
    ::kill(launcher, SIGCONT);
    std::this_thread::sleep_for(30s);  // until dcomm-run stops it
    return 0;
  }
  std::ofstream(started(rank)) << "started\n";
  // Until dcomm-run is stopped (its state 'T' in /proc), at most 10 s.
  const std::string stat = "/proc/" + std::to_string(launcher) + "/stat";
  for (int i = 0; i < 1000; ++i) {
    std::string s;
    std::getline(std::ifstream(stat), s);
    if (s.find(") T ") != std::string::npos) break;
    std::this_thread::sleep_for(10ms);
  }
  if (rank == "2") ::raise(SIGKILL);
  std::this_thread::sleep_for(300ms);
  return exit_on_lost_peer("all_reduce", 1, 2);
}

// A fresh folder for a test's dumps.
std::string temporary_folder() {
  char name[] = "/tmp/dcomm-trace-test-XXXXXX";
  REQUIRE(::mkdtemp(name) != nullptr);
  return name;
}

// Whether the JSON file at `path` holds what `check` (a Python expression
// over `d`) says: Python's parser, meson's own interpreter.
bool json_holds(const std::string& path, const std::string& check) {
  const std::string script = path + ".check.py";
  std::ofstream(script) << "import json, sys\nd = json.load(open(sys.argv[1]))\n"
                        << "sys.exit(0 if (" << check << ") else 1)\n";
  const int status = std::system(("python3 '" + script + "' '" + path + "'").c_str());
  std::remove(script.c_str());
  return status == 0;
}

std::string trace_tool() {
  return launcher().substr(0, launcher().rfind('/') + 1) + "dcomm-trace";
}

struct trace_run {
  result job;       // dcomm-run --trace-dir
  result analyzer;  // dcomm-trace over the folder afterwards
};

// Runs the scenario's world of 3 under dcomm-run --trace-dir, then
// dcomm-trace (beside dcomm-run) over the dumps.
trace_run run_traced(const std::string& scenario) {
  const std::string dir = temporary_folder();
  trace_run t;
  t.job = run({"-n", "3", "--grace", "5", "--timeout", "60", "--trace-dir", dir, self_path(),
               "--as-trace-rank", scenario});
  // dcomm-trace is run through dcomm-run's own -n 1, as any program is.
  t.analyzer = run({"-n", "1", "--no-prefix", trace_tool(), dir});
  std::system(("rm -rf '" + dir + "'").c_str());
  return t;
}

}  // namespace

TEST_SUITE("launcher") {
  TEST_CASE("every rank gets the env:// variables, and its lines their prefix") {
    DCOMM_TEST_DEADLINE(60s);
    auto r =
        run({"-n", "3", "/bin/sh", "-c",
             "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
             "node=$GROUP_RANK at=$MASTER_ADDR:$MASTER_PORT fd=${DCOMM_MASTER_LISTEN_FD:-none}; "
             "echo to-stderr >&2"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    for (int rank = 0; rank < 3; ++rank) {
      std::string p = "[" + std::to_string(rank) + "] rank=" + std::to_string(rank) +
                      " world=3 local=" + std::to_string(rank) + "/3 node=0 at=127.0.0.1:";
      CHECK(has(r.out, p));
      CHECK(has(r.err, "[" + std::to_string(rank) + "] to-stderr\n"));
    }
    CHECK(!has(r.out, ":0 fd"));  // a real port was chosen
    CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 3);
  }

  TEST_CASE("rank 0 can listen on the port it was given: the socket is already bound") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "2", "/bin/sh", "-c",
                  "if [ $RANK = 0 ]; then test -n \"$DCOMM_MASTER_LISTEN_FD\" && echo has-fd; "
                  "else test -z \"$DCOMM_MASTER_LISTEN_FD\" && echo no-fd; fi"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(has(r.out, "[0] has-fd"));
    CHECK(has(r.out, "[1] no-fd"));
  }

  // Issue 41: rank 0 adopts dcomm-run's socket only for the port it is
  // asked to listen on; a job that names its own port meets there.
  TEST_CASE("a job that names another port (tcp://, MASTER_PORT) meets there, not at dcomm-run's") {
    DCOMM_TEST_DEADLINE(60s);
    const std::string port = std::to_string(dcomm::test::free_port());
    const std::string rank_program = "exec '" + self_path() + "' --as-url-rank ";
    for (const std::string& command :
         {rank_program + "\"tcp://127.0.0.1:" + port + "?rank=$RANK&world_size=2\"",
          "MASTER_PORT=" + port + " " + rank_program + "env://"}) {
      CAPTURE(command);
      auto r = run({"-n", "2", "/bin/sh", "-c", command});
      INFO(r.out, r.err);
      CHECK(r.status == 0);
      for (const char* rank : {"[0] ", "[1] "})
        CHECK(has(r.out, std::string(rank) + "sum=3 store=tcp://127.0.0.1:" + port + "\n"));
    }
  }

  TEST_CASE("multi-node ranks: RANK = node rank x nproc + local rank") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"--nnodes", "3", "--node-rank", "2", "--master-addr", "127.0.0.1",
                  "--master-port", "29999", "-n", "2", "/bin/sh", "-c",
                  "echo $RANK/$WORLD_SIZE $GROUP_RANK $MASTER_PORT"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(has(r.out, "[4] 4/6 2 29999"));
    CHECK(has(r.out, "[5] 5/6 2 29999"));
  }

  TEST_CASE("a failing rank: the others are stopped, its status is the launcher's") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "4", "/bin/sh", "-c",
                  "if [ $RANK = 2 ]; then echo failing; exit 3; fi; exec sleep 30"});
    INFO(r.out, r.err);
    CHECK(r.status == 3);
    CHECK(has(r.out, "[2] failing"));
    CHECK(has(r.err, "dcomm-run: rank 2 (pid "));
    CHECK(has(r.err, "exited with status 3; stopping the other 3 rank(s)"));
    CHECK(r.seconds < 20);  // the sleepers were stopped, not waited for
  }

  TEST_CASE("a rank killed by a signal: 128 + the signal, and it is named") {
    DCOMM_TEST_DEADLINE(60s);
    auto r =
        run({"-n", "2", "/bin/sh", "-c", "if [ $RANK = 1 ]; then kill -9 $$; fi; exec sleep 30"});
    INFO(r.out, r.err);
    CHECK(r.status == 128 + 9);
    CHECK(has(r.err, "rank 1 (pid "));
    CHECK(has(r.err, "was killed by signal 9"));
  }

  TEST_CASE("a rank that ignores SIGTERM is killed after the grace period") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"--grace", "0.5", "-n", "2", "/bin/sh", "-c",
                  "if [ $RANK = 0 ]; then exit 1; fi; trap '' TERM; sleep 30; sleep 30"});
    INFO(r.out, r.err);
    CHECK(r.status == 1);
    CHECK(r.seconds < 15);
  }

  TEST_CASE("SIGTERM to the launcher reaches every rank") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "2", "/bin/sh", "-c",
                  "trap 'echo got-term; exit 0' TERM; echo ready; "
                  "while :; do sleep 0.05; done"},
                 {.on_output = [](pid_t launcher_pid, const std::string& out) {
                   if (!has(out, "[1] ready")) return false;
                   // Both ranks must have set their trap: wait for rank 0 too.
                   std::this_thread::sleep_for(300ms);
                   ::kill(launcher_pid, SIGTERM);
                   return true;
                 }});
    INFO(r.out, r.err);
    CHECK(has(r.out, "[0] got-term"));
    CHECK(has(r.out, "[1] got-term"));
    CHECK(r.status == 128 + SIGTERM);
    CHECK(has(r.err, "passing it on to"));
  }

  TEST_CASE("--no-prefix leaves the output alone; a last line without newline is kept") {
    DCOMM_TEST_DEADLINE(60s);
    auto plain = run({"--no-prefix", "-n", "1", "/bin/sh", "-c", "printf 'a\\nb'"});
    CHECK(plain.status == 0);
    CHECK(plain.out == "a\nb");
    auto prefixed = run({"-n", "1", "/bin/sh", "-c", "printf 'a\\nb'"});
    CHECK(prefixed.out == "[0] a\n[0] b\n");
  }

  TEST_CASE("a program that cannot run: 127 and why; bad arguments: 2 and usage") {
    DCOMM_TEST_DEADLINE(60s);
    auto missing = run({"-n", "2", "/nonexistent/program"});
    INFO(missing.err);
    CHECK(missing.status == 127);
    CHECK(has(missing.err, "cannot run /nonexistent/program: No such file or directory"));
    auto bad = run({"-n", "zero", "/bin/true"});
    CHECK(bad.status == 2);
    CHECK(has(bad.err, "--nproc-per-node needs an integer >= 1"));
    CHECK(run({"-n", "2"}).status == 2);
    CHECK(has(run({"--nnodes", "2", "--node-rank", "1", "/bin/true"}).err, "--master-port"));
  }

  TEST_CASE("--timeout stops a job that runs too long: 124, naming the ranks") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"--timeout", "0.5", "-n", "2", "/bin/sh", "-c", "exec sleep 30"});
    INFO(r.err);
    CHECK(r.status == 124);
    CHECK(has(r.err, "ran past --timeout 0.5 s; stopping rank(s) 0 1"));
    CHECK(r.seconds < 15);
  }
  TEST_CASE("single node: the ranks share a fresh job token; another run gets another") {
    DCOMM_TEST_DEADLINE(60s);
    auto job = [] {
      auto r = run({"-n", "3", "/bin/sh", "-c", print_token}, {.env = {"DCOMM_JOB_TOKEN"}});
      INFO(r.out, r.err);
      CHECK(r.status == 0);
      CHECK(r.err.empty());  // nothing to say, with OpenSSL or without
      auto tokens = values_of(r.out, "token");
      REQUIRE(tokens.size() == 3);
      CHECK(std::set<std::string>(tokens.begin(), tokens.end()).size() == 1);
      return tokens[0];
    };
    auto first = job();
    auto second = job();
    if (dcomm::detail::have_crypto()) {
      CHECK(is_fresh_token(first));
      CHECK(is_fresh_token(second));
      CHECK(first != second);
    } else {
      // The ranks would refuse a token at start-up: none is made up.
      CHECK(first == "none");
      CHECK(second == "none");
    }
  }

  TEST_CASE("an explicit DCOMM_JOB_TOKEN is passed on unchanged; --no-auth gives the ranks none") {
    DCOMM_TEST_DEADLINE(60s);
    auto tokens_of = [](std::vector<std::string> args, std::vector<std::string> env) {
      args.insert(args.end(), {"-n", "2", "/bin/sh", "-c", print_token});
      auto r = run(args, {.env = env});
      INFO(r.out, r.err);
      CHECK(r.status == 0);
      CHECK(r.err.empty());
      return values_of(r.out, "token");
    };
    using list = std::vector<std::string>;
    CHECK(tokens_of({}, {"DCOMM_JOB_TOKEN=shared secret=1"}) ==
          list{"shared secret=1", "shared secret=1"});
    CHECK(tokens_of({"--no-auth"}, {"DCOMM_JOB_TOKEN"}) == list{"none", "none"});
    CHECK(tokens_of({"--no-auth"}, {"DCOMM_JOB_TOKEN=shared"}) == list{"none", "none"});
  }

  TEST_CASE(
      "multi-node: no token is made up (other nodes could not know it); a shared one is passed "
      "on") {
    DCOMM_TEST_DEADLINE(60s);
    auto node = [](std::vector<std::string> args, std::vector<std::string> env) {
      args.insert(args.end(), {"--nnodes", "2", "--node-rank", "1", "--master-port", "29999", "-n",
                               "2", "/bin/sh", "-c", print_token});
      return run(args, {.env = env});
    };
    auto open = node({}, {"DCOMM_JOB_TOKEN"});
    INFO(open.out, open.err);
    CHECK(open.status == 0);
    CHECK(values_of(open.out, "token") == std::vector<std::string>{"none", "none"});
    // Said once, so a torchrun user's job still runs but knows it is open.
    CHECK(has(open.err, "not authenticated; set the same token on every node") ==
          dcomm::detail::have_crypto());
    auto shared = node({}, {"DCOMM_JOB_TOKEN=cluster-token"});
    CHECK(shared.status == 0);
    CHECK(values_of(shared.out, "token") ==
          std::vector<std::string>{"cluster-token", "cluster-token"});
    CHECK(shared.err.empty());
    auto quiet = node({"--no-auth"}, {"DCOMM_JOB_TOKEN"});
    CHECK(quiet.status == 0);
    CHECK(quiet.err.empty());
  }

  TEST_CASE("the job's store refuses a client without the token; the ranks get in") {
    DCOMM_TEST_DEADLINE(90s);
    auto r = run({"-n", "3", self_path(), "--as-rank"}, {.env = {"DCOMM_JOB_TOKEN"}});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    for (int rank = 0; rank < 3; ++rank)
      CHECK(has(r.out, "[" + std::to_string(rank) + "] sum=6\n"));
    if (dcomm::detail::have_crypto()) {
      CHECK(has(r.out, "[1] stranger: refused\n"));
      CHECK(has(r.out, "[0] stranger key: absent\n"));
    } else {
      CHECK(has(r.out, "[1] stranger: served\n"));  // no token without OpenSSL: as before
    }
  }

  TEST_CASE("under torchrun, its ranks meet at dcomm-run's store, not at the agent's") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "2", "/bin/sh", "-c", "echo agent=${TORCHELASTIC_USE_AGENT_STORE:-unset}"},
                 {.env = {"TORCHELASTIC_USE_AGENT_STORE=True"}});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(values_of(r.out, "agent") == std::vector<std::string>{"unset", "unset"});
  }

  TEST_CASE("SIGKILL to the launcher: its ranks die with it") {
    DCOMM_TEST_DEADLINE(60s);
    std::vector<std::pair<pid_t, std::string>> ranks;  // pid, start time
    auto r = run({"-n", "3", "/bin/sh", "-c", "echo pid=$$; exec sleep 60"},
                 {.on_output = [&](pid_t launcher_pid, const std::string& out) {
                   auto pids = values_of(out, "pid");
                   if (pids.size() < 3) return false;
                   for (const auto& p : pids) {
                     auto pid = static_cast<pid_t>(std::stoi(p));
                     ranks.emplace_back(pid, start_time_if_running(pid));
                   }
                   ::kill(launcher_pid, SIGKILL);
                   return true;
                 }});
    INFO(r.out, r.err);
    CHECK(r.status == 128 + SIGKILL);
    REQUIRE(ranks.size() == 3);
    // Not a structured binding: clang 14 cannot capture one in CHECK_MESSAGE.
    for (const auto& rank : ranks) CHECK_MESSAGE(!rank.second.empty(), "rank pid ", rank.first);
    auto survivors = still_running_after_a_while(ranks);
    std::string names;
    for (pid_t pid : survivors) names += " " + std::to_string(pid);
    CHECK_MESSAGE(survivors.empty(), "ranks still running after the launcher died:", names);
    for (pid_t pid : survivors) ::kill(pid, SIGKILL);  // not left behind by a failed test
  }
}

// dcomm-trace (tools/trace/verdict.hpp) over real dumps: dcomm-run
// --trace-dir asks the ranks still running for theirs (SIGUSR1) when the job
// fails, and prints the verdict; dcomm-trace says the same afterwards.
TEST_SUITE("trace analyzer") {
  TEST_CASE("a rank that stops making calls is named, with its last call") {
    DCOMM_TEST_DEADLINE(90s);
    auto t = run_traced("sleeper");
    INFO("dcomm-run's stderr:\n", t.job.err, "\ndcomm-trace:\n", t.analyzer.out, t.analyzer.err);
    CHECK(t.job.status == 1);
    CHECK(has(t.job.err, "what the ranks' flight recorders say"));
    const std::string verdict =
        "rank 1 holds up the world group: it has not entered all_reduce #2 (ranks 0, 2 wait in "
        "it); its last call there is all_reduce #1, done";
    CHECK(has(t.job.err, verdict));
    CHECK(t.analyzer.status == 0);
    CHECK(has(t.analyzer.out, verdict));
    // Rank 1 never failed: its dump is the one dcomm-run asked for.
    const auto lines = lines_of(t.analyzer.out);
    CHECK(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
      return l.starts_with("  rank 1 (pid ") && l.ends_with(") dumped on: SIGUSR1");
    }));
  }

  // Issue 41: dcomm-run's SIGUSR1 reaches a rank that failed and dumped
  // already (rank 2 stays after its call failed): its failure's dump, the
  // message that located the culprit, is kept beside the later one.
  TEST_CASE("a rank that failed and dumped before SIGUSR1 keeps its failure's dump") {
    DCOMM_TEST_DEADLINE(90s);
    auto t = run_traced("lingering");
    INFO("dcomm-run's stderr:\n", t.job.err, "\ndcomm-trace:\n", t.analyzer.out, t.analyzer.err);
    CHECK(t.job.status == 1);
    CHECK(t.analyzer.status == 0);
    for (const std::string& report : {t.job.err, t.analyzer.out}) {
      const auto lines = lines_of(report);
      auto line_of = [&](const std::string& start, const std::string& end) {
        return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) {
          const auto at = l.find(start);
          return at != std::string::npos && l.find(end, at) != std::string::npos;
        });
      };
      // The failure's message, naming rank 1 and where it was; then SIGUSR1's.
      CHECK(line_of("rank 2 (pid ",
                    ") dumped on: dcomm: timed out in all_reduce (rank 2), peers "
                    "rank 1"));
      CHECK(line_of("rank 2 (pid ",
                    "rank 1 had not entered this call: its last call in this "
                    "group was #1 (this is #2)"));
      CHECK(line_of("rank 2 (pid ", ") dumped again on: SIGUSR1"));
      CHECK(line_of("rank 0 (pid ", ") dumped on: dcomm: timed out in all_reduce (rank 0)"));
      CHECK(line_of("rank 1 (pid ", ") dumped on: SIGUSR1"));
      CHECK(has(report, "rank 1 holds up the world group: it has not entered all_reduce #2"));
    }
  }

  TEST_CASE("ranks that make different calls: both calls side by side") {
    DCOMM_TEST_DEADLINE(90s);
    auto t = run_traced("mismatch");
    INFO("dcomm-run's stderr:\n", t.job.err, "\ndcomm-trace:\n", t.analyzer.out, t.analyzer.err);
    CHECK(t.job.status == 1);
    CHECK(t.analyzer.status == 0);
    CHECK(has(t.analyzer.out, "the ranks made different calls at #2 of the world group:"));
    CHECK(has(t.analyzer.out, "rank 0: all_reduce float32 x 4; failed ("));
    CHECK(has(t.analyzer.out, "rank 1: broadcast float32 x 4, root 0; failed ("));
    CHECK(has(t.analyzer.out, "rank 2: all_reduce float32 x 4; failed ("));
    CHECK(has(t.job.err, "the ranks made different calls at #2 of the world group:"));
  }

  TEST_CASE("a killed rank is named from the survivors' dumps") {
    DCOMM_TEST_DEADLINE(90s);
    auto t = run_traced("killed");
    INFO("dcomm-run's stderr:\n", t.job.err, "\ndcomm-trace:\n", t.analyzer.out, t.analyzer.err);
    CHECK(t.job.status == 128 + SIGKILL);
    CHECK(t.analyzer.status == 0);
    CHECK(has(t.analyzer.out, "rank 2: no dump"));
    // Gone, if the survivors lost it before dcomm-run's SIGUSR1; else
    // still waiting for it when they dumped.
    CHECK((has(t.analyzer.out,
               "rank 2 is gone: it left no dump, and ranks 0, 1 lost a peer in all_reduce #2 of "
               "the world group") ||
           has(t.analyzer.out,
               "rank 2 left no dump while ranks 0, 1 waited in all_reduce #2 of the world group")));
  }

  TEST_CASE("a rank that keeps calling last is named a straggler") {
    DCOMM_TEST_DEADLINE(90s);
    auto t = run_traced("straggler");
    INFO("dcomm-run's stderr:\n", t.job.err, "\ndcomm-trace:\n", t.analyzer.out, t.analyzer.err);
    CHECK(t.job.status == 0);
    CHECK(t.analyzer.status == 0);
    CHECK(has(t.analyzer.out, "rank 1 is a straggler: it called last in "));
    CHECK(has(t.analyzer.out, " collectives rank 0 recorded, on average "));
    CHECK_FALSE(has(t.analyzer.out, "rank 0 is a straggler"));
    CHECK_FALSE(has(t.analyzer.out, "rank 2 is a straggler"));
  }

  TEST_CASE("dcomm-trace refuses what is not a dump, naming the file") {
    DCOMM_TEST_DEADLINE(30s);
    const std::string dir = temporary_folder();
    const std::string tool = trace_tool();
    auto empty = run({"-n", "1", "--no-prefix", tool, dir});
    CHECK(empty.status == 1);
    CHECK(has(empty.err, "no dcomm-trace-rank*.json in " + dir));
    std::ofstream(dir + "/dcomm-trace-rank0.json")
        << "{\"format\": \"dcomm-flight-recorder/1\", \"rank\": ";
    std::ofstream(dir + "/dcomm-trace-rank1.json") << "{\"format\": \"something else\"}";
    auto bad = run({"-n", "1", "--no-prefix", tool, dir});
    CHECK(bad.status == 1);
    CHECK(has(bad.err, dir + "/dcomm-trace-rank0.json: not a readable dump"));
    CHECK(has(bad.err, dir + "/dcomm-trace-rank1.json: not a flight recorder dump"));
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("dcomm-run --timeline: the ranks' calls merged into one trace, a track per rank") {
    DCOMM_TEST_DEADLINE(90s);
    const std::string dir = temporary_folder();
    const std::string path = dir + "/job.json";
    auto r = run({"-n", "3", "--timeout", "60", "--timeline", path, self_path(), "--as-trace-rank",
                  "clean"});
    INFO("dcomm-run's stderr:\n", r.err);
    CHECK(r.status == 0);
    CHECK(has(r.err, "dcomm-trace: merged the timelines of 3 rank(s) into " + path));
    CHECK(json_holds(
        path,
        "sorted((e['pid'],e['args']['seq'],e['name']) for e in d['traceEvents'] if e['ph']=='X')"
        "==[(p,s,n) for p in range(3) for s,n in [(0,'barrier'),(1,'all_reduce'),(2,'all_reduce')]]"
        " and sorted(e['args']['name'] for e in d['traceEvents'] if e['name']=='process_name')=="
        "['rank 0','rank 1','rank 2']"
        " and d['otherData']['ranks_aligned_by_wall_clock']==[]"));
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("timelines of another boot are aligned through the wall clock") {
    DCOMM_TEST_DEADLINE(30s);
    const std::string dir = temporary_folder();
    // Rank 1's host booted elsewhere: its steady clock reads 1000 s when
    // rank 0's reads 5000 s (same wall clock): its times move by +4000 s.
    const auto rank_file = [&](int rank, const char* boot, long long steady_ns) {
      std::ofstream(dir + "/job-rank" + std::to_string(rank) + ".json")
          << "[{\"name\": \"dcomm_clock\", \"ph\": \"M\", \"pid\": " << rank
          << ", \"args\": {\"steady_ns\": " << steady_ns
          << ", \"realtime_ns\": 9000000000000, \"boot_id\": \"" << boot << "\"}},"
          << "{\"name\": \"barrier\", \"ph\": \"X\", \"pid\": " << rank
          << ", \"tid\": 1, \"ts\": " << steady_ns / 1000 + 10 << ", \"dur\": 1.5}]\n";
    };
    rank_file(0, "boot-a", 5000000000000);
    rank_file(1, "boot-b", 1000000000000);
    rank_file(2, "boot-a", 5000000000000);
    auto r = run({"-n", "1", "--no-prefix", trace_tool(), "--merge-timeline", dir + "/job.json"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(has(r.out, "merged the timelines of 3 rank(s)"));
    CHECK(has(r.out, "(rank 1 aligned by wall clock)"));
    CHECK(json_holds(dir + "/job.json",
                     "[e['ts'] for e in d['traceEvents'] if e['ph']=='X']=="
                     "[5000000010.0, 5000000010.0, 5000000010.0]"
                     " and d['otherData']['ranks_aligned_by_wall_clock']==[1]"));
    std::system(("rm -rf '" + dir + "'").c_str());
  }
}

// Which address a rank advertises (cpu/startup/interfaces.hpp), in a network
// namespace of its own (`unshare -n`: root) with veth pairs: dca0
// 10.71.0.1, dcb0 10.72.0.1 and fd72::1, dcc0 fd73::1 only. The ranks link
// over TCP (DCOMM_TRANSPORT=tcp) to the address each advertised, which
// DCOMM_LOG_LEVEL=info's start-up line names ("reached at ..."). meson's
// test 'network interfaces' is skipped where unshare -n is refused.
TEST_SUITE("network interfaces") {
  // dcomm-run -n 2 over `as_trace_rank("clean")` in a fresh namespace.
  result in_namespace(const std::string& env, const std::string& launcher_args = "") {
    const std::string setup =
        "set -e; ip link set lo up; "
        "for p in a b c; do ip link add dc${p}0 type veth peer name dc${p}1; "
        "ip link set dc${p}0 up; ip link set dc${p}1 up; done; "
        "ip addr add 10.71.0.1/24 dev dca0; ip addr add 10.72.0.1/24 dev dcb0; "
        "ip -6 addr add fd72::1/64 dev dcb0 nodad; ip -6 addr add fd73::1/64 dev dcc0 nodad; "
        "sysctl -qw net.ipv6.conf.dca0.disable_ipv6=1 net.ipv6.conf.dca1.disable_ipv6=1 "
        "net.ipv6.conf.dcb1.disable_ipv6=1 net.ipv6.conf.dcc1.disable_ipv6=1; ";
    const std::string job = "exec env DCOMM_TRANSPORT=tcp DCOMM_LOG_LEVEL=info " + env + " '" +
                            launcher() + "' -n 2 --timeout 60 " + launcher_args + " '" +
                            self_path() + "' --as-trace-rank clean";
    return run({"unshare", "-n", "sh", "-c", setup + job}, {.program = "/usr/bin/env"});
  }

  std::vector<std::string> reached_at(const std::string& err) {
    std::vector<std::string> found;
    for (std::size_t at = err.find("reached at "); at != std::string::npos;
         at = err.find("reached at ", at + 1)) {
      auto begin = at + 11;
      found.push_back(err.substr(begin, err.find(';', begin) - begin));
    }
    return found;
  }

  // Both ranks of a job run with `env` (and dcomm-run `args`) advertise `address`.
  void check_advertised(const std::string& env, const std::string& args,
                        const std::string& address) {
    auto r = in_namespace(env, args);
    INFO(env, " ", args, "\n", r.out, r.err);
    CHECK(r.status == 0);
    CHECK(reached_at(r.err) == std::vector<std::string>{address, address});
  }

  TEST_CASE("by default, the address that routes to the store; over IPv6 too") {
    DCOMM_TEST_DEADLINE(90s);
    check_advertised("", "", "127.0.0.1");
    check_advertised("", "--master-addr ::1", "::1");
  }

  TEST_CASE("DCOMM_SOCKET_IFNAME: a prefix, an exclusion, an exact IPv6-only name") {
    DCOMM_TEST_DEADLINE(90s);
    check_advertised("DCOMM_SOCKET_IFNAME=dcb", "", "10.72.0.1");
    check_advertised("DCOMM_SOCKET_IFNAME=^lo,dcb", "", "10.71.0.1");
    check_advertised("DCOMM_SOCKET_IFNAME==dcc0", "", "fd73::1");
  }

  TEST_CASE("DCOMM_SOCKET_IFNAME that matches nothing: the error lists what there is") {
    DCOMM_TEST_DEADLINE(90s);
    auto r = in_namespace("DCOMM_SOCKET_IFNAME=eth");
    INFO(r.out, r.err);
    CHECK(r.status != 0);
    CHECK(has(r.err, "DCOMM_SOCKET_IFNAME"));
    CHECK(has(r.err, "expected an interface that is up and matches 'eth'"));
    CHECK(has(r.err, "dcb0 10.72.0.1"));
  }
}

namespace elastic_launcher {
int as_store_rank();  // elastic_launcher_test.cpp
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--as-elastic-store-rank")
    return elastic_launcher::as_store_rank();
  if (argc == 2 && std::string(argv[1]) == "--as-rank") return as_rank();
  if (argc == 3 && std::string(argv[1]) == "--as-trace-rank") return as_trace_rank(argv[2]);
  if (argc == 2 && std::string(argv[1]) == "--as-failing-rank") return as_failing_rank();
  if (argc == 2 && std::string(argv[1]) == "--as-agent-store-rank") return as_agent_store_rank();
  if (argc == 2 && std::string(argv[1]) == "--as-late-culprit") return as_late_culprit();
  if (argc == 2 && std::string(argv[1]) == "--as-killed-culprit") return as_killed_culprit();
  if (argc == 3 && std::string(argv[1]) == "--as-url-rank") return as_url_rank(argv[2]);
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}
