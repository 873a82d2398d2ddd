// dcomm::spawn: real ranks that rendezvous through the environment it sets,
// and the failures the parent must report instead of hanging.
#include "dcomm/spawn.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "dcomm/detail/hmac.hpp"
#include "dcomm/rendezvous.hpp"
#include "support/deadline.hpp"
#include "support/process_probe.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
using dcomm::test::is_fresh_token;
using dcomm::test::start_time_if_running;

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

using dcomm::test::contains;

// Sets (or, with nullopt, removes) DCOMM_JOB_TOKEN in this process for one
// scope, so a token in the environment the tests run in changes nothing.
class scoped_token {
 public:
  explicit scoped_token(const std::optional<std::string>& value) {
    if (const char* old = std::getenv("DCOMM_JOB_TOKEN")) old_ = old;
    set(value);
  }
  scoped_token(const scoped_token&) = delete;
  scoped_token& operator=(const scoped_token&) = delete;
  ~scoped_token() { set(old_); }

 private:
  static void set(const std::optional<std::string>& value) {
    if (value)
      ::setenv("DCOMM_JOB_TOKEN", value->c_str(), 1);
    else
      ::unsetenv("DCOMM_JOB_TOKEN");
  }
  std::optional<std::string> old_;
};

// Each rank's DCOMM_JOB_TOKEN ("none" when unset), in rank order.
std::vector<std::string> rank_tokens(int n, dcomm::spawn_options options = {}) {
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  dcomm::spawn(
      n,
      [&](int rank, int) {
        const char* token = std::getenv("DCOMM_JOB_TOKEN");
        // One short write per rank: atomic on a pipe, so lines never mix.
        std::string line = std::to_string(rank) + " " + (token ? token : "none") + "\n";
        if (::write(fds[1], line.data(), line.size()) != static_cast<ssize_t>(line.size()))
          throw std::runtime_error("write");
      },
      options);
  ::close(fds[1]);
  std::string all;
  char buffer[4096];
  for (ssize_t got; (got = ::read(fds[0], buffer, sizeof buffer)) > 0;)
    all.append(buffer, static_cast<std::size_t>(got));
  ::close(fds[0]);
  std::vector<std::string> tokens(static_cast<std::size_t>(n));
  std::istringstream lines(all);
  for (std::string line; std::getline(lines, line);) {
    auto space = line.find(' ');
    tokens.at(std::stoul(line.substr(0, space))) = line.substr(space + 1);
  }
  return tokens;
}

// Runs `body` in a forked child process, which may lower its own limits
// freely, and returns what body returned. The child dies with this process
// (PR_SET_PDEATHSIG), so a test that runs past its deadline leaves nothing.
std::string in_child_process(const std::function<std::string()>& body) {
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::close(fds[0]);
    std::string result;
    try {
      result = body();
    } catch (const std::exception& e) {
      result = std::string("exception: ") + e.what();
    }
    [[maybe_unused]] auto ignored = ::write(fds[1], result.data(), result.size());
    std::_Exit(0);
  }
  ::close(fds[1]);
  int status = 0;
  ::waitpid(pid, &status, 0);  // bounded by the test's deadline
  // The child has exited: what it wrote is in the pipe. Not a blocking read
  // to end of file: a rank it forked may still hold the write end.
  ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
  std::string result;
  char buffer[4096];
  for (ssize_t got; (got = ::read(fds[0], buffer, sizeof buffer)) > 0;)
    result.append(buffer, static_cast<std::size_t>(got));
  ::close(fds[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    result += " [the child process ended with status " + std::to_string(status) + "]";
  return result;
}

// How many file descriptors below 4096 are open in this process.
int open_descriptors() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) != -1;
  return n;
}

// Calls dcomm::spawn and describes how it failed: the code's name, what(),
// and what it left behind (descriptors, children not reaped).
std::string spawn_failure(int n, dcomm::spawn_options options) {
  const int before = open_descriptors();
  std::string outcome = "no error";
  try {
    // Rank 0 waits to be stopped; the failure comes before rank n-1 runs.
    dcomm::spawn(
        n,
        [](int, int) {
          for (;;) ::pause();
        },
        options);
  } catch (const dcomm::error& e) {
    outcome = e.code().message() + " | " + e.what();
  }
  const int leaked = open_descriptors() - before;
  errno = 0;
  const bool unreaped = ::waitpid(-1, nullptr, WNOHANG) != -1 || errno != ECHILD;
  if (leaked != 0) outcome += " | " + std::to_string(leaked) + " descriptor(s) left open";
  if (unreaped) outcome += " | a child left unreaped";
  return outcome;
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

TEST_CASE("spawn: a failed pipe() is a system error naming the call, and nothing is left behind") {
  DCOMM_TEST_DEADLINE(30s);
  // Room for exactly three more descriptors: the rendezvous socket and rank
  // 0's message pipe. Once rank 0 is forked its pipe's write end is closed,
  // leaving one: rank 1's pipe needs two.
  auto outcome = in_child_process([] {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return std::string("getrlimit failed");
    int highest = 0;
    for (int fd = 0; fd < 4096; ++fd)
      if (::fcntl(fd, F_GETFD) != -1) highest = fd;
    limit.rlim_cur = static_cast<rlim_t>(highest + 64);
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) return std::string("setrlimit failed");
    std::vector<int> filler;
    for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) filler.push_back(fd);
    if (errno != EMFILE || filler.size() < 3) return std::string("could not fill the table");
    for (int i = 0; i < 3; ++i) {
      ::close(filler.back());
      filler.pop_back();
    }
    return spawn_failure(2, {.auth = false});
  });
  CHECK(outcome == "system call failed | dcomm: system call failed in spawn: pipe: " +
                       std::string(std::strerror(EMFILE)) +
                       " (starting rank 1 of 2; the 1 rank(s) already started were stopped)");
}

TEST_CASE("spawn: a failed fork() is a system error naming the call, and nothing is left behind") {
  DCOMM_TEST_DEADLINE(30s);
  auto outcome = in_child_process([] {
    // Root is exempt from RLIMIT_NPROC: become nobody first (this child only).
    if (::geteuid() == 0 && ::setuid(65534) != 0) return std::string("not enforced");
    rlimit none{0, 0};
    if (::setrlimit(RLIMIT_NPROC, &none) != 0) return std::string("setrlimit failed");
    std::fflush(nullptr);
    if (pid_t probe = ::fork(); probe >= 0) {
      if (probe == 0) std::_Exit(0);
      ::waitpid(probe, nullptr, 0);
      return std::string("not enforced");
    }
    return spawn_failure(2, {.auth = false});
  });
  if (outcome == "not enforced") {
    MESSAGE("RLIMIT_NPROC is not enforced here (a privileged user): fork failure not checked");
    return;
  }
  CHECK(outcome == "system call failed | dcomm: system call failed in spawn: fork: " +
                       std::string(std::strerror(EAGAIN)) + " (starting rank 0 of 2)");
}

TEST_CASE("spawn: a rank stopped right after its fork never runs the parent's SIGTERM handler") {
  DCOMM_TEST_DEADLINE(60s);
  // Rank 0 fails at once, so the others get SIGTERM while some are just
  // forked. They must die of it, whatever handler they inherited: here one
  // that marks the pipe and exits. (Before the stop signals were blocked
  // across fork, about a third of such ranks ran it.)
  auto outcome = in_child_process([] {
    static int marker_fd = -1;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return std::string("pipe failed");
    marker_fd = fds[1];
    struct sigaction action {};
    action.sa_handler = [](int) {
      [[maybe_unused]] auto ignored = ::write(marker_fd, "H", 1);
      ::_exit(99);
    };
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGTERM, &action, nullptr);
    for (int round = 0; round < 20; ++round) {
      auto what = spawn_error(6,
                              [](int rank, int) {
                                if (rank == 0) std::_Exit(3);
                                for (;;) ::pause();
                              },
                              {.auth = false});
      if (!contains(what, "(rank 0): exit status 3")) return what;
    }
    char marks[512];
    ssize_t got = ::read(fds[0], marks, sizeof marks);
    return "the handler ran in " + std::to_string(got > 0 ? got : 0) + " rank(s)";
  });
  CHECK(outcome == "the handler ran in 0 rank(s)");
}

TEST_CASE("spawn: the ranks share a fresh job token; another spawn gets another") {
  DCOMM_TEST_DEADLINE(30s);
  scoped_token unset(std::nullopt);
  auto first = rank_tokens(3);
  auto second = rank_tokens(3);
  CHECK(std::set<std::string>(first.begin(), first.end()).size() == 1);
  CHECK(std::set<std::string>(second.begin(), second.end()).size() == 1);
  if (dcomm::detail::have_crypto()) {
    CHECK(is_fresh_token(first[0]));
    CHECK(is_fresh_token(second[0]));
    CHECK(first[0] != second[0]);
  } else {
    // The ranks would refuse a token at start-up: none is made up.
    CHECK(first[0] == "none");
    CHECK(second[0] == "none");
  }
  CHECK(std::getenv("DCOMM_JOB_TOKEN") == nullptr);  // the caller's environment is its own
}

TEST_CASE("spawn: an explicit DCOMM_JOB_TOKEN is passed on unchanged; auth = false gives none") {
  DCOMM_TEST_DEADLINE(30s);
  using list = std::vector<std::string>;
  {
    scoped_token set("shared secret=1");
    CHECK(rank_tokens(2) == list{"shared secret=1", "shared secret=1"});
    CHECK(rank_tokens(2, {.auth = false}) == list{"none", "none"});
  }
  scoped_token unset(std::nullopt);
  CHECK(rank_tokens(2, {.auth = false}) == list{"none", "none"});
}

TEST_CASE("spawn: the job's store refuses a client without the token; the ranks get in") {
  DCOMM_TEST_DEADLINE(60s);
  scoped_token unset(std::nullopt);
  dcomm::spawn(3, [](int rank, int) {
    if (rank == 1) {
      // Knocks on rank 0's store as a stranger would: the same address, no token.
      auto stranger = dcomm::tcp_store::create(
          {.host = std::getenv("MASTER_ADDR"),
           .port = static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT"))),
           .timeout = 20s,
           .job_token = ""});
      try {
        stranger->set("stranger", "was here", dcomm::blocking);
        if (dcomm::detail::have_crypto()) throw std::runtime_error("the stranger was served");
      } catch (const dcomm::error& e) {
        if (e.code() != dcomm::errc::auth_failed) throw;
      }
    }
    auto world = dcomm::rendezvous({.init_method = "env://", .timeout = 30s});
    auto& s = *world.store;
    s.add("sum", rank + 1, dcomm::blocking);
    s.set("added/" + std::to_string(rank), "1", dcomm::blocking);
    std::vector<std::string> all;
    for (int r = 0; r < world.world_size; ++r) all.push_back("added/" + std::to_string(r));
    s.wait(all, dcomm::blocking);  // rank 1's stranger is done by now
    if (s.get("sum", dcomm::blocking) != "6") throw std::runtime_error("wrong sum");
    if (dcomm::detail::have_crypto() &&
        s.check(std::vector<std::string>{"stranger"}, dcomm::blocking))
      throw std::runtime_error("the stranger's key got in");
    dcomm::depart(world, dcomm::blocking);
  });
}

TEST_CASE("spawn: the ranks die with the process that spawned them, even by SIGKILL") {
  DCOMM_TEST_DEADLINE(60s);
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  std::fflush(nullptr);
  pid_t parent = ::fork();
  REQUIRE(parent >= 0);
  if (parent == 0) {
    // The spawning process: its ranks say who they are, then sleep far past
    // the test's limit.
    ::close(fds[0]);
    try {
      dcomm::spawn(3,
                   [&](int, int) {
                     pid_t me = ::getpid();
                     if (::write(fds[1], &me, sizeof me) != sizeof me) return 1;
                     std::this_thread::sleep_for(std::chrono::minutes(1));
                     return 0;
                   },
                   {.timeout = std::chrono::minutes(2)});
    } catch (...) {
    }
    std::_Exit(0);
  }
  ::close(fds[1]);
  std::vector<std::pair<pid_t, std::string>> ranks;  // pid, start time
  auto until = std::chrono::steady_clock::now() + 20s;
  while (ranks.size() < 3 && std::chrono::steady_clock::now() < until) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    pid_t pid = 0;
    if (::read(fds[0], &pid, sizeof pid) != sizeof pid) break;
    ranks.emplace_back(pid, start_time_if_running(pid));
  }
  ::close(fds[0]);
  ::kill(parent, SIGKILL);
  ::waitpid(parent, nullptr, 0);
  REQUIRE(ranks.size() == 3);
  // Not a structured binding: clang 14 cannot capture one in CHECK_MESSAGE.
  for (const auto& rank : ranks) CHECK_MESSAGE(!rank.second.empty(), "rank pid ", rank.first);

  std::vector<pid_t> running;
  until = std::chrono::steady_clock::now() + 10s;
  do {
    running.clear();
    for (const auto& [pid, started] : ranks)
      if (start_time_if_running(pid) == started) running.push_back(pid);
    if (running.empty()) break;
    std::this_thread::sleep_for(20ms);
  } while (std::chrono::steady_clock::now() < until);
  std::string names;
  for (pid_t pid : running) names += " " + std::to_string(pid);
  CHECK_MESSAGE(running.empty(), "ranks still running after their parent died:", names);
  for (pid_t pid : running) ::kill(pid, SIGKILL);  // not left behind by a failed test
}
