// dcomm-run --elastic as a user runs it: the job's store in dcomm-store
// (beside dcomm-run), a failed rank's slot restarted with DCOMM_JOINING=1,
// --max-restarts and --min-ranks ending the job, the summary. The ranks are
// /bin/sh scripts, or this binary (`launcher_tests --as-elastic-store-rank`)
// where one must speak to the store.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "dcomm/store/tcp_store.hpp"
#include "support/deadline.hpp"
#include "support/run_launcher.hpp"

using namespace std::chrono_literals;
using namespace dcomm::test::launcher_run;

namespace elastic_launcher {

// Rank 0 leaves a key in the job's store and dies by SIGKILL; its slot's
// next process (joining) reads the key back (the store outlived rank 0,
// which hosts it in a job that is not elastic) and tells rank 1, which
// waited, that it may end.
int as_store_rank() {
  try {
    const char* token = std::getenv("DCOMM_JOB_TOKEN");
    auto s = dcomm::tcp_store::create(
        {.host = std::getenv("MASTER_ADDR"),
         .port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT"))),
         .timeout = 30s,
         .job_token = token ? token : ""});
    const std::string rank = std::getenv("RANK");
    const char* joining = std::getenv("DCOMM_JOINING");
    if (joining && std::string(joining) == "1") {
      std::printf("joined: kept=%s\n", s->get("left by rank 0", dcomm::blocking).c_str());
      s->set("done", "1", dcomm::blocking);
    } else if (rank == "0") {
      s->set("left by rank 0", "pid " + std::to_string(::getpid()), dcomm::blocking);
      std::fflush(stdout);
      ::raise(SIGKILL);
    } else {
      s->get("done", dcomm::blocking);
      std::printf("rank 1: done\n");
    }
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank failed: %s\n", e.what());
    return 1;
  }
}

// The pid of launcher `pid`'s child that runs dcomm-store (-1: none).
pid_t store_child_of(pid_t pid) {
  std::ifstream children("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) +
                         "/children");
  for (pid_t child; children >> child;) {
    std::error_code ec;
    const auto exe = std::filesystem::read_symlink("/proc/" + std::to_string(child) + "/exe", ec);
    if (!ec && exe.filename() == "dcomm-store") return child;
  }
  return -1;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  return text.str();
}

}  // namespace elastic_launcher

TEST_SUITE("elastic launcher") {
  TEST_CASE("a failed rank's slot is restarted; the new process is told to join") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "2", "--elastic", "/bin/sh", "-c",
                  "if [ \"$DCOMM_JOINING\" = 1 ]; then "
                  "echo joined restart=$TORCHELASTIC_RESTART_COUNT served=$DCOMM_STORE_SERVED; "
                  "exit 0; fi; "
                  "echo first restart=$TORCHELASTIC_RESTART_COUNT served=$DCOMM_STORE_SERVED; "
                  "if [ $RANK = 1 ]; then exit 3; fi; sleep 1; echo survivor"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(has(r.out, "[1] first restart=0 served=1"));
    CHECK(has(r.out, "[1] joined restart=1 served=1"));
    CHECK(has(r.out, "[0] survivor"));
    CHECK(has(r.err, "dcomm-run: rank 1 (pid "));
    CHECK(has(r.err, ") exited with status 3\n"));
    CHECK(has(r.err, "restarting rank 1's slot (restart 1 of --max-restarts 3)"));
    CHECK(has(r.err,
              "elastic job: 1 failure(s), 1 restart(s) of --max-restarts 3; the job "
              "succeeded"));
  }

  TEST_CASE("restarts used up: the job ends with the failed rank's status, the rest stopped") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "2", "--elastic", "--max-restarts", "2", "/bin/sh", "-c",
                  "if [ $RANK = 1 ]; then exit 5; fi; exec sleep 30"});
    INFO(r.out, r.err);
    CHECK(r.status == 5);
    CHECK(has(r.err, "restart 2 of --max-restarts 2"));
    CHECK(has(r.err, "no restarts left (--max-restarts 2): stopping the other 1 rank(s)"));
    CHECK(
        has(r.err, "3 failure(s), 2 restart(s) of --max-restarts 2; the job ended with status 5"));
    CHECK(r.seconds < 20);  // the sleeper was stopped, not waited for
  }

  TEST_CASE("--min-ranks: a failure that leaves fewer running ends the job") {
    DCOMM_TEST_DEADLINE(60s);
    auto r = run({"-n", "3", "--elastic", "--min-ranks", "3", "/bin/sh", "-c",
                  "if [ $RANK = 2 ]; then kill -9 $$; fi; exec sleep 30"});
    INFO(r.out, r.err);
    CHECK(r.status == 128 + 9);
    CHECK(has(r.err, "was killed by signal 9"));
    CHECK(has(r.err, "2 of this node's ranks run, under --min-ranks 3: stopping the other 2"));
    CHECK(has(r.err, "1 failure(s), 0 restart(s)"));
  }

  TEST_CASE("the job's store outlives rank 0: its slot's next process finds rank 0's key") {
    DCOMM_TEST_DEADLINE(90s);
    auto r = run({"-n", "2", "--elastic", self_path(), "--as-elastic-store-rank"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(has(r.err, "rank 0 (pid "));
    CHECK(has(r.err, "was killed by signal 9"));
    CHECK(has(r.out, "[0] joined: kept=pid "));
    CHECK(has(r.out, "[1] rank 1: done"));
    CHECK(has(r.err, "1 failure(s), 1 restart(s)"));
  }

  TEST_CASE("a store that does not end on SIGTERM is killed: dcomm-run still ends") {
    DCOMM_TEST_DEADLINE(60s);
    bool stopped = false;
    auto r = run({"-n", "2", "--elastic", "/bin/sh", "-c", "echo ready; sleep 0.5"},
                 {.on_output = [&](pid_t launcher, const std::string& out) {
                   if (!has(out, "ready")) return false;
                   const pid_t store = elastic_launcher::store_child_of(launcher);
                   stopped = store > 0 && ::kill(store, SIGSTOP) == 0;
                   return true;
                 }});
    INFO(r.out, r.err);
    CHECK(stopped);
    CHECK(r.status == 0);
    CHECK(r.seconds < 20);
  }

  TEST_CASE("--tee: a restarted slot's process appends to the slot's log") {
    DCOMM_TEST_DEADLINE(60s);
    const auto dir = std::filesystem::temp_directory_path() /
                     ("dcomm-elastic-logs-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    auto r = run({"-n", "2", "--elastic", "--tee", "1", "--log-dir", dir.string(), "/bin/sh", "-c",
                  "if [ \"$DCOMM_JOINING\" = 1 ]; then echo second; exit 0; fi; "
                  "if [ $RANK = 1 ]; then echo first; exit 1; fi; sleep 1"});
    INFO(r.out, r.err);
    CHECK(r.status == 0);
    CHECK(elastic_launcher::read_file(dir / "1" / "stdout.log") == "first\nsecond\n");
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("--max-restarts and --min-ranks without --elastic, or over -n: usage errors") {
    DCOMM_TEST_DEADLINE(30s);
    auto r = run({"-n", "2", "--max-restarts", "1", "/bin/true"});
    CHECK(r.status == 2);
    CHECK(has(r.err, "--max-restarts and --min-ranks apply to --elastic jobs"));
    r = run({"-n", "2", "--elastic", "--min-ranks", "3", "/bin/true"});
    CHECK(r.status == 2);
    CHECK(has(r.err, "--min-ranks 3 is over the 2 rank(s) of this node"));
  }
}
