// dcomm-run: starts the ranks of a job on this machine, like torchrun.
//
//   dcomm-run -n 4 PROGRAM ARGS...
//   dcomm-run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 -n 8 PROGRAM
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT (dcomm's env://, and torch's). Without
// --master-port, node 0 listens on a free port and hands the listening
// socket to rank 0 (DCOMM_MASTER_LISTEN_FD), so jobs never race for ports.
// Output lines are prefixed "[rank] " (--no-prefix: left alone). SIGINT and
// SIGTERM are passed on to the ranks. When a rank fails, the others are
// stopped (SIGTERM, SIGKILL after --grace seconds) and dcomm-run exits with
// that rank's status (128 + signal for a signal), saying which rank failed
// and how. --timeout bounds the whole job (exit 124). Usage errors: exit 2.
//
// The job is authenticated: the ranks share DCOMM_JOB_TOKEN, the one in
// dcomm-run's environment or, on a single node, a fresh random one (none
// where dcomm was built without OpenSSL; --no-auth: none at all). The ranks
// die with dcomm-run (PR_SET_PDEATHSIG), even when it is killed by SIGKILL.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/spawn.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct options {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free one (node 0 only)
  bool prefix = true;
  bool auth = true;
  double grace = 5;
  double timeout = 0;  // 0: none
  std::vector<std::string> command;
};

[[noreturn]] void usage(const std::string& problem) {
  if (!problem.empty()) std::fprintf(stderr, "dcomm-run: %s\n", problem.c_str());
  std::fprintf(stderr,
               "usage: dcomm-run [-n N] [--nnodes N --node-rank I] [--master-addr ADDR]\n"
               "                 [--master-port PORT] [--no-prefix] [--no-auth]\n"
               "                 [--grace SECONDS] [--timeout SECONDS] [--] PROGRAM [ARGS...]\n");
  std::exit(problem.empty() ? 0 : 2);
}

int to_int(const std::string& flag, const std::string& v, int low) {
  char* end = nullptr;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end || x < low || x > 1'000'000)
    usage(flag + " needs an integer >= " + std::to_string(low) + ", not '" + v + "'");
  return static_cast<int>(x);
}

double to_seconds(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= 0)) usage(flag + " needs seconds >= 0, not '" + v + "'");
  return x;
}

options parse(int argc, char** argv) {
  options o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.empty() || a[0] != '-') break;  // the program
    if (a == "-h" || a == "--help") usage("");
    if (a == "--no-prefix") {
      o.prefix = false;
      continue;
    }
    if (a == "--no-auth") {
      o.auth = false;
      continue;
    }
    std::string v;
    if (auto eq = a.find('='); eq != std::string::npos && a.starts_with("--")) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= argc) usage(a + " needs a value");
      v = argv[++i];
    }
    if (a == "-n" || a == "--nproc-per-node")
      o.nproc = to_int(a, v, 1);
    else if (a == "--nnodes")
      o.nnodes = to_int(a, v, 1);
    else if (a == "--node-rank")
      o.node_rank = to_int(a, v, 0);
    else if (a == "--master-addr")
      o.master_addr = v;
    else if (a == "--master-port")
      o.master_port = to_int(a, v, 1);
    else if (a == "--grace")
      o.grace = to_seconds(a, v);
    else if (a == "--timeout")
      o.timeout = to_seconds(a, v);
    else
      usage("unknown option " + a);
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) usage("no program to run");
  if (o.node_rank >= o.nnodes)
    usage("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
          std::to_string(o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0 && o.node_rank != 0)
    usage("with --nnodes > 1, the other nodes need --master-port (and --master-addr) of node 0");
  return o;
}

// A stream of one rank (stdout or stderr), cut into lines.
struct stream {
  int fd = -1;
  int out = 1;  // where its lines go
  std::string partial;
};

struct rank_process {
  int rank = 0;
  pid_t pid = -1;
  bool done = false;
  int status = 0;
  stream streams[2];
};

volatile std::sig_atomic_t received_signal = 0;
void on_signal(int sig) {
  received_signal = sig;
}

void write_all(int fd, const std::string& s) {
  std::size_t at = 0;
  while (at < s.size()) {
    ssize_t n = ::write(fd, s.data() + at, s.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    at += static_cast<std::size_t>(n);
  }
}

// Reads what is there; writes out complete lines, each with its prefix.
// Returns false at end of file.
bool pump(stream& s, const std::string& prefix) {
  char buffer[65536];
  ssize_t n = ::read(s.fd, buffer, sizeof buffer);
  if (n < 0) return errno == EINTR || errno == EAGAIN;
  if (n == 0) {
    if (!s.partial.empty()) write_all(s.out, prefix + s.partial + "\n");
    s.partial.clear();
    return false;
  }
  s.partial.append(buffer, static_cast<std::size_t>(n));
  std::string lines;
  std::size_t start = 0;
  for (std::size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
    lines += prefix + s.partial.substr(start, nl + 1 - start);
  s.partial.erase(0, start);
  if (!lines.empty()) write_all(s.out, lines);
  return true;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  const int world = o.nnodes * o.nproc;
  // Only a single node can make the token up: the launchers of other nodes
  // have no safe way to learn it, so a multi-node job brings its own.
  std::optional<std::string> token;
  try {
    token = dcomm::detail::job_token_for_ranks(o.auth, o.nnodes == 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcomm-run: %s\n", e.what());
    return 1;
  }
  if (o.auth && !token && o.nnodes > 1 && dcomm::detail::have_crypto())
    std::fprintf(stderr,
                 "dcomm-run: note: DCOMM_JOB_TOKEN is not set, so this multi-node job is not "
                 "authenticated; set the same token on every node (or pass --no-auth to run it "
                 "open without this note)\n");
  int listen_fd = -1;
  int port = o.master_port;
  if (port == 0) {
    try {
      auto [fd, p] = dcomm::detail::listen_on_free_port(o.master_addr);
      listen_fd = fd;
      port = p;
      ::fcntl(listen_fd, F_SETFD, FD_CLOEXEC);  // rank 0 alone inherits it
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dcomm-run: %s\n", e.what());
      return 2;
    }
  }

  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  std::vector<char*> args;
  for (const auto& a : o.command) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  std::fflush(nullptr);
  const pid_t launcher = ::getpid();  // single-threaded: its thread is the process
  std::vector<rank_process> ranks(static_cast<std::size_t>(o.nproc));
  for (int local = 0; local < o.nproc; ++local) {
    auto& r = ranks[static_cast<std::size_t>(local)];
    r.rank = o.node_rank * o.nproc + local;
    int pipes[2][2] = {{-1, -1}, {-1, -1}};
    if (o.prefix)
      for (auto& p : pipes)
        if (::pipe2(p, O_CLOEXEC) != 0) {
          std::perror("dcomm-run: pipe");
          return 1;
        }
    r.pid = ::fork();
    if (r.pid < 0) {
      std::perror("dcomm-run: fork");
      for (auto& other : ranks)
        if (other.pid > 0) ::kill(other.pid, SIGKILL);
      return 1;
    }
    if (r.pid == 0) {
      dcomm::detail::die_with_parent(launcher);  // no rank outlives a killed launcher
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
      if (o.prefix) {
        ::dup2(pipes[0][1], 1);
        ::dup2(pipes[1][1], 2);
      }
      auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(r.rank));
      set("WORLD_SIZE", std::to_string(world));
      set("LOCAL_RANK", std::to_string(local));
      set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
      set("GROUP_RANK", std::to_string(o.node_rank));
      set("MASTER_ADDR", o.master_addr);
      set("MASTER_PORT", std::to_string(port));
      if (token)
        set("DCOMM_JOB_TOKEN", *token);
      else
        ::unsetenv("DCOMM_JOB_TOKEN");
      if (r.rank == 0 && listen_fd >= 0) {
        ::fcntl(listen_fd, F_SETFD, 0);
        set("DCOMM_MASTER_LISTEN_FD", std::to_string(listen_fd));
      } else {
        ::unsetenv("DCOMM_MASTER_LISTEN_FD");
      }
      ::execvp(args[0], args.data());
      std::string why =
          "dcomm-run: cannot run " + o.command[0] + ": " + std::strerror(errno) + "\n";
      write_all(2, why);
      ::_exit(127);
    }
    if (o.prefix) {
      for (int s = 0; s < 2; ++s) {
        ::close(pipes[s][1]);
        r.streams[s].fd = pipes[s][0];
        r.streams[s].out = s + 1;
        ::fcntl(r.streams[s].fd, F_SETFL, O_NONBLOCK);
      }
    }
  }
  if (listen_fd >= 0) ::close(listen_fd);

  const auto started = clock_type::now();
  std::optional<clock_type::time_point> kill_at;  // set once stopping
  std::optional<clock_type::time_point> drain_until;
  int exit_code = 0;
  bool failed = false;
  auto alive = [&] {
    int n = 0;
    for (auto& r : ranks) n += !r.done;
    return n;
  };
  auto stop_others = [&](int sig) {
    for (auto& r : ranks)
      if (!r.done) ::kill(r.pid, sig);
    if (!kill_at)
      kill_at = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                        std::chrono::duration<double>(o.grace));
  };

  for (;;) {
    // Output first, so what a rank printed before failing comes out first.
    std::vector<pollfd> fds;
    std::vector<stream*> owners;
    for (auto& r : ranks)
      for (auto& s : r.streams)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.push_back(&s);
        }
    const bool running = alive() > 0;
    if (!running && fds.empty()) break;
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), running ? 20 : 0);
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        auto* s = owners[i];
        int rank = 0;
        for (auto& r : ranks)
          if (&r.streams[0] == s || &r.streams[1] == s) rank = r.rank;
        if (!pump(*s, "[" + std::to_string(rank) + "] ")) {
          ::close(s->fd);
          s->fd = -1;
        }
      }
      // The ranks are gone but a descendant of one keeps its pipe open:
      // drain for a moment, not forever.
      if (!running) {
        if (!drain_until) drain_until = clock_type::now() + std::chrono::seconds(1);
        if (clock_type::now() > *drain_until) break;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }

    for (auto& r : ranks) {
      if (r.done) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.done = true;
      r.status = status;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && !failed && !received_signal) {
        failed = true;
        exit_code = exit_code_of(status);
        std::string how = WIFEXITED(status)
                              ? "exited with status " + std::to_string(WEXITSTATUS(status))
                              : "was killed by " + dcomm::detail::describe_status(status);
        int others = alive();
        std::fprintf(stderr, "dcomm-run: rank %d (pid %d) %s; stopping the other %d rank(s)\n",
                     r.rank, static_cast<int>(r.pid), how.c_str(), others);
        std::fflush(stderr);
        stop_others(SIGTERM);
      }
    }
    if (received_signal && !kill_at) {
      std::fprintf(stderr, "dcomm-run: got %s; passing it on to %d rank(s)\n",
                   ::strsignal(received_signal), alive());
      std::fflush(stderr);
      exit_code = 128 + received_signal;
      stop_others(received_signal);
    }
    if (o.timeout > 0 && !kill_at &&
        clock_type::now() - started > std::chrono::duration<double>(o.timeout)) {
      std::string still;
      for (auto& r : ranks)
        if (!r.done) still += " " + std::to_string(r.rank);
      std::fprintf(stderr, "dcomm-run: the job ran past --timeout %g s; stopping rank(s)%s\n",
                   o.timeout, still.c_str());
      std::fflush(stderr);
      exit_code = 124;
      failed = true;
      stop_others(SIGTERM);
    }
    if (kill_at && clock_type::now() > *kill_at) stop_others(SIGKILL);
  }
  return exit_code;
}
