// dcomm-run's command line as torchrun users type it (tools/run/options.hpp),
// a Kubernetes job's PET_* defaults, --tee/--redirects/--log-dir, node 0
// telling the other nodes where it listens, and the first rank to die being
// the one named when a survivor exits right after it.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "support/deadline.hpp"
#include "support/listening_socket.hpp"
#include "support/run_launcher.hpp"

using namespace std::chrono_literals;
using namespace dcomm::test::launcher_run;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string fresh_folder() {
  char name[] = "/tmp/dcomm-run-test-XXXXXX";
  REQUIRE(::mkdtemp(name) != nullptr);
  return name;
}

const std::string print_layout = "echo $RANK/$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE";

}  // namespace

TEST_SUITE("launcher") {
  TEST_CASE("torchrun's spellings, -n2, and a --help that explains every option") {
    DCOMM_TEST_DEADLINE(60s);
    for (const std::vector<std::string>& flags : {std::vector<std::string>{"-n2"},
                                                  {"--nproc_per_node", "2"},
                                                  {"--nproc-per-node=2"},
                                                  {"--nproc_per_node=2", "--standalone"}}) {
      std::vector<std::string> args = flags;
      args.insert(args.end(), {"/bin/sh", "-c", print_layout});
      auto r = run(args);
      INFO(flags.front(), ": ", r.out, r.err);
      CHECK(r.status == 0);
      CHECK(has(r.out, "[1] 1/2 local=1/2"));
    }
    auto multi = run({"--nnodes=2", "--node_rank=1", "--master_addr=127.0.0.1",
                      "--master_port=29999", "-n", "1", "/bin/sh", "-c", print_layout});
    CHECK(has(multi.out, "[1] 1/2 local=0/1"));
    // The program's own options are its own, even those dcomm-run has.
    auto own = run({"-n", "1", "--no-prefix", "/bin/echo", "-n", "--help"});
    CHECK(own.out == "--help");
    const auto help = run({"--help"});
    CHECK(help.status == 0);
    for (const char* option :
         {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
          "--standalone", "--log-dir", "--tee", "--redirects", "--no-prefix", "--no-auth",
          "--grace", "--timeout", "--trace-dir", "--timeline", "PET_NPROC_PER_NODE"})
      CHECK_MESSAGE(has(help.out, option), option);
    for (const std::vector<std::string>& bad : {std::vector<std::string>{"--bogus", "/bin/true"},
                                                {"-n"},
                                                {"--nnodes", "1:4", "/bin/true"},
                                                {"--tee", "5", "/bin/true"},
                                                {"-t", "1", "-r", "1", "/bin/true"},
                                                {"--master-port", "70000", "/bin/true"},
                                                {"--grace", "inf", "/bin/true"},
                                                {"--no-prefix=1", "/bin/true"}}) {
      const auto r = run(bad);
      INFO(bad.front(), ": ", r.err);
      CHECK(r.status == 2);
      CHECK(has(r.err, "dcomm-run --help lists the options"));
    }
    // A port past 65535 is refused, not handed to ranks that could not meet on it.
    CHECK(has(run({"--master-port", "70000", "/bin/true"}).err,
              "dcomm-run: --master-port needs an integer from 1 to 65535, not '70000'"));
    CHECK(has(run({"--no-prefix=1", "/bin/true"}).err, "dcomm-run: --no-prefix takes no value"));
  }

  TEST_CASE("a Kubernetes job's PET_* variables are the defaults; the command line wins") {
    DCOMM_TEST_DEADLINE(60s);
    const std::vector<std::string> pet{"PET_NPROC_PER_NODE=2", "PET_NNODES=3", "PET_NODE_RANK=2",
                                       "PET_MASTER_ADDR=127.0.0.1", "PET_MASTER_PORT=29998"};
    auto r = run({"/bin/sh", "-c", print_layout + " at=$MASTER_ADDR:$MASTER_PORT"}, {.env = pet});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(has(r.out, "[5] 5/6 local=1/2 at=127.0.0.1:29998"));
    auto indexed = pet;
    indexed[2] = "JOB_COMPLETION_INDEX=1";
    CHECK(has(run({"/bin/sh", "-c", print_layout}, {.env = indexed}).out, "[3] 3/6 local=1/2"));
    auto flags = run({"-n", "1", "--node-rank", "0", "/bin/sh", "-c", print_layout}, {.env = pet});
    CHECK(has(flags.out, "[0] 0/3 local=0/1"));
  }

  TEST_CASE("--tee copies and --redirects moves each rank's output to --log-dir") {
    DCOMM_TEST_DEADLINE(60s);
    const std::string dir = fresh_folder();
    const std::string script = "echo out$RANK; echo err$RANK >&2";
    auto tee = run({"-n", "2", "--tee", "3", "--log-dir", dir, "/bin/sh", "-c", script});
    INFO(tee.out, tee.err);
    CHECK(tee.status == 0);
    CHECK(has(tee.out, "[1] out1"));
    CHECK(has(tee.err, "[1] err1"));
    CHECK(read_file(dir + "/1/stdout.log") == "out1\n");
    CHECK(read_file(dir + "/0/stderr.log") == "err0\n");
    auto moved = run({"-n", "2", "-r", "1", "--log-dir", dir, "/bin/sh", "-c", script});
    CHECK_FALSE(has(moved.out, "out"));
    CHECK(has(moved.err, "[0] err0"));
    CHECK(read_file(dir + "/0/stdout.log") == "out0\n");
    // Without --log-dir, a fresh folder, named.
    auto named = run({"-n", "1", "-t", "1", "/bin/sh", "-c", script});
    CHECK(has(named.err, "dcomm-run: the ranks' output goes to /tmp/dcomm-run-"));
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("node 0 of a multi-node job says where the others find it") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"--nnodes", "2", "--node-rank", "0", "-n", "1", "--timeout", "0.2", "/bin/sh",
                  "-c", "exec sleep 5"});
    INFO(r.err);
    CHECK(has(r.err, "dcomm-run: node 0 of 2: rank 0's store listens at 127.0.0.1:"));
    CHECK(has(r.err, "start the other nodes with --master-addr 127.0.0.1 --master-port "));
  }

  TEST_CASE("the first rank to die is named, not a survivor that exits right after it") {
    DCOMM_TEST_DEADLINE(120s);
    // Rank 1 kills itself; rank 0 exits 1 5 ms after it sees rank 1 dead
    // (a zombie, or gone), as a survivor failing on the lost peer would. A
    // child of rank 1 keeps its output open, so the launcher hears of
    // neither end through the pipes: both come in one 20 ms pass of its
    // loop, where only the time each died tells them apart.
    const std::string dir = fresh_folder();
    const std::string script =
        "if [ $RANK = 1 ]; then (sleep 1 &); echo $$ > " + dir + "/pid.$N.tmp; mv " + dir +
        "/pid.$N.tmp " + dir +
        "/pid.$N; kill -9 $$; fi; "
        "while [ ! -e " +
        dir + "/pid.$N ]; do :; done; read p < " + dir +
        "/pid.$N; "
        "while read -r s < /proc/$p/stat 2>/dev/null; do case \"$s\" in *\") Z \"*) break;; "
        "esac; done; sleep 0.005; exit 1";
    for (int n = 0; n < 10; ++n) {
      auto r = run({"-n", "2", "/bin/bash", "-c", script}, {.env = {"N=" + std::to_string(n)}});
      INFO("run ", n, ": ", r.err);
      CHECK(r.status == 128 + 9);
      CHECK(has(r.err, "dcomm-run: rank 1 (pid "));
      CHECK_FALSE(has(r.err, "dcomm-run: rank 0 (pid "));
    }
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("each rank writes its TORCHELASTIC_ERROR_FILE; dcomm-run prints the blamed one's") {
    DCOMM_TEST_DEADLINE(90s);
    const std::string dir = fresh_folder();
    const std::string outer = dir + "/dcomm-run.json";  // as if torchrun ran dcomm-run
    SUBCASE("an uncaught exception") {
      auto r = run({"-n", "3", "--timeout", "60", self_path(), "--as-failing-rank"},
                   {.env = {"TORCHELASTIC_ERROR_FILE=" + outer}});
      INFO(r.err);
      CHECK(r.status != 0);
      CHECK(has(r.err, "dcomm-run: rank 1 (pid "));
      CHECK(has(r.err, "dcomm-run: rank 1 failed with: rank 1 gives up: its dataset is missing"));
      const std::string json = read_file(outer);
      INFO(json);
      CHECK(has(json,
                "{\"message\": {\"message\": \"rank 1: rank 1 gives up: its dataset is "
                "missing\", \"extraInfo\": {\"timestamp\": \""));
    }
    SUBCASE("a survivor reaped before the rank it names: the named one is blamed") {
      auto r = run({"-n", "2", "--timeout", "60", self_path(), "--as-late-culprit"});
      INFO(r.err);
      CHECK(r.status == 1);  // rank 0 ended first: its status (rank 1 is then stopped)
      CHECK(has(r.err, "dcomm-run: rank 1 (pid "));
      CHECK(has(r.err, " failed first (rank 0, which exited with status 1, names it)"));
      CHECK(has(r.err, "dcomm-run: rank 1 failed with: rank 1 gives up: its dataset is missing"));
    }
    SUBCASE("a killed rank reaped with the survivor that names it: the killed one is blamed") {
      auto r = run({"-n", "3", "--timeout", "60", self_path(), "--as-killed-culprit"});
      INFO(r.err);
      CHECK(r.status == 128 + 9);
      CHECK(has(r.err, "dcomm-run: rank 2 (pid "));
      CHECK(has(r.err,
                " was killed by signal 9 (Killed) first (rank 1, which exited with status "
                "1, names it)"));
    }
    SUBCASE("a dcomm::error caught by the program, which returns 1") {
      auto r = run({"-n", "3", "--timeout", "60", self_path(), "--as-trace-rank", "mismatch"});
      INFO(r.err);
      CHECK(r.status == 1);
      CHECK(has(r.err, " failed with: dcomm: mismatch between ranks in "));
    }
    std::filesystem::remove_all(dir);
  }
}

// Under the real torchrun (Debian's python3-torch: meson's test 'torchrun',
// skipped where it is not installed), dcomm programs started with
// --no_python as torch users start theirs.
TEST_SUITE("torchrun") {
  // torchrun 1.13 under Python 3.11 cannot parse --redirects/--tee 0 (its
  // default): Std(0) is no longer iterated. 1 (stdout) parses.
  std::vector<std::string> torchrun_args(std::vector<std::string> args) {
    args.insert(args.begin(), {"--nproc_per_node", "3", "--redirects", "1", "--tee", "1",
                               "--no_python", self_path()});
    return args;
  }
  std::string torchrun() {
    const char* path = std::getenv("TORCHRUN");
    REQUIRE_MESSAGE(path, "TORCHRUN is not set (run the tests through meson)");
    return path;
  }

  TEST_CASE("its failure summary shows each rank's error, not <N/A>") {
    DCOMM_TEST_DEADLINE(120s);
    auto args = torchrun_args({"--as-failing-rank"});
    args.insert(args.begin(), "--standalone");
    auto r = run(args, {.program = torchrun()});
    INFO(r.err);
    CHECK(r.status != 0);
    CHECK(has(r.err, "traceback : rank 1 gives up: its dataset is missing"));
    CHECK(has(r.err, "traceback : dcomm: peer lost in barrier"));
    CHECK_FALSE(has(r.err, "<N/A>"));
  }

  TEST_CASE("without --standalone the ranks join its agent's store") {
    DCOMM_TEST_DEADLINE(120s);
    const int port = dcomm::test::free_port();  // for the agent's store
    auto args = torchrun_args({"--as-agent-store-rank"});
    args.insert(args.begin(),
                {"--master_addr", "127.0.0.1", "--master_port", std::to_string(port)});
    auto r = run(args, {.program = torchrun()});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    for (int rank = 0; rank < 3; ++rank)
      CHECK(has(r.out, "rank " + std::to_string(rank) + ": store c10d, sum=6"));
  }

  TEST_CASE("without --standalone its failure summary shows each rank's error too") {
    DCOMM_TEST_DEADLINE(120s);
    const int port = dcomm::test::free_port();
    auto args = torchrun_args({"--as-failing-rank"});
    args.insert(args.begin(),
                {"--master_addr", "127.0.0.1", "--master_port", std::to_string(port)});
    auto r = run(args, {.program = torchrun()});
    INFO(r.err);
    CHECK(r.status != 0);
    CHECK(has(r.err, "traceback : rank 1 gives up: its dataset is missing"));
    CHECK_FALSE(has(r.err, "<N/A>"));
  }
}
