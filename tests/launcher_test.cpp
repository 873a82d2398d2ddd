// dcomm-run as a user runs it: a child process whose output and exit status
// are checked. The ranks are /bin/sh scripts, so each test costs processes,
// not builds. $DCOMM_RUN is the launcher's path (set by meson).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "support/deadline.hpp"

using namespace std::chrono_literals;

namespace {

struct result {
  int status = -1;  // the exit code, or 128 + signal
  std::string out, err;
  double seconds = 0;
};

std::string launcher() {
  const char* path = std::getenv("DCOMM_RUN");
  REQUIRE_MESSAGE(path, "DCOMM_RUN is not set (run the tests through meson)");
  return path;
}

// Runs dcomm-run with `args`; `after_start` runs (with the launcher's pid)
// once it has printed `wait_for` on stdout, e.g. to send it a signal.
result run(std::vector<std::string> args, const std::string& wait_for = "",
           void (*after_start)(pid_t) = nullptr) {
  args.insert(args.begin(), launcher());
  int out[2], err[2];
  REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(126);
  }
  ::close(out[1]);
  ::close(err[1]);
  result r;
  bool signalled = false;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open = 2;
  while (open > 0) {
    ::poll(fds, 2, 100);
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      } else {
        (i == 0 ? r.out : r.err).append(buffer, static_cast<std::size_t>(n));
      }
    }
    if (after_start && !signalled && r.out.find(wait_for) != std::string::npos) {
      signalled = true;
      after_start(pid);
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
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
                 "[1] ready", [](pid_t launcher_pid) {
                   // Both ranks must have set their trap: wait for rank 0 too.
                   std::this_thread::sleep_for(300ms);
                   ::kill(launcher_pid, SIGTERM);
                 });
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
    CHECK(has(bad.err, "-n needs an integer >= 1"));
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
}
