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
//
// --trace-dir DIR sets DCOMM_TRACE_DIR for the ranks (their flight recorders
// dump there: docs/communicator.md). When the job fails, times out or is
// interrupted, the ranks still running first get SIGUSR1 (each dumps what it
// was doing; up to 2 s for their files), then the stop; once all have ended,
// dcomm-run prints dcomm-trace's verdict over the dumps.
//
// --timeline PATH sets DCOMM_TRACE for the ranks (each writes its calls as
// Chrome trace events when its communicator closes); once the job has
// ended, dcomm-trace merges this node's ranks' files into PATH.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
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

#include "dcomm/detail/hmac.hpp"
#include "dcomm/launch/child_group.hpp"
#include "dcomm/launch/child_process.hpp"
#include "dcomm/launch/job_token.hpp"
#include "dcomm/launch/master_socket.hpp"
#include "dcomm/launch/rank_environment.hpp"

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
  double timeout = 0;     // 0: none
  std::string trace_dir;  // empty: none
  std::string timeline;   // empty: none
  std::vector<std::string> command;
};

[[noreturn]] void usage(const std::string& problem) {
  if (!problem.empty()) std::fprintf(stderr, "dcomm-run: %s\n", problem.c_str());
  std::fprintf(stderr,
               "usage: dcomm-run [-n N] [--nnodes N --node-rank I] [--master-addr ADDR]\n"
               "                 [--master-port PORT] [--no-prefix] [--no-auth]\n"
               "                 [--grace SECONDS] [--timeout SECONDS] [--trace-dir DIR]\n"
               "                 [--timeline PATH] [--] PROGRAM [ARGS...]\n");
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
    else if (a == "--trace-dir" || a == "--timeline") {
      if (v.empty()) usage(a + " needs a path");
      (a == "--timeline" ? o.timeline : o.trace_dir) = v;
    } else
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

// What dcomm-run keeps of a rank besides its process: the global rank for
// the prefix, and its stdout and stderr (fd -1: not piped, or closed).
struct rank_output {
  int rank = 0;
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

// A program installed (or built) in dcomm-run's own folder.
std::string beside_this_program(const std::string& name) {
  char path[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  std::string self(path, n > 0 ? static_cast<std::size_t>(n) : 0);
  const auto slash = self.rfind('/');
  return slash == std::string::npos ? name : self.substr(0, slash + 1) + name;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The DCOMM_JOB_TOKEN for the ranks. Only a single node can make one up: the
// launchers of other nodes have no safe way to learn it, so a multi-node job
// brings its own (and is told when it has none).
std::optional<std::string> job_token_for(const options& o) {
  std::optional<std::string> token = dcomm::launch::job_token_for_ranks(o.auth, o.nnodes == 1);
  if (o.auth && !token && o.nnodes > 1 && dcomm::detail::have_crypto())
    std::fprintf(stderr,
                 "dcomm-run: note: DCOMM_JOB_TOKEN is not set, so this multi-node job is not "
                 "authenticated; set the same token on every node (or pass --no-auth to run it "
                 "open without this note)\n");
  return token;
}

// SIGINT and SIGTERM are only noted here (received_signal); the job's loop
// passes them on. SIGPIPE is ignored: a closed stdout must not kill the
// launcher while its ranks run (they get the default back, fork_child).
void pass_signals_to_ranks() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
}

// This node's share of the job: its ranks, their output, and how it ends.
class job {
 public:
  explicit job(const options& o)
      : o_(o),
        ranks_(static_cast<std::size_t>(o.nproc), std::chrono::duration_cast<clock_type::duration>(
                                                      std::chrono::duration<double>(o.grace))),
        outputs_(static_cast<std::size_t>(o.nproc)) {}

  // Forks and execs the ranks. False, having said why and killed the ranks
  // already started, when pipe() or fork() fails.
  bool start(const std::optional<std::string>& token, const dcomm::launch::master_socket& socket) {
    std::vector<char*> args;
    for (const auto& a : o_.command) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::fflush(nullptr);
    const pid_t launcher = ::getpid();  // single-threaded: its thread is the process
    for (int local = 0; local < o_.nproc; ++local) {
      const dcomm::launch::rank_environment environment{
          .master_addr = o_.master_addr,
          .master_port = socket.fd >= 0 ? socket.port : o_.master_port,
          .rank = o_.node_rank * o_.nproc + local,
          .world_size = o_.nnodes * o_.nproc,
          .local_rank = local,
          .local_world_size = o_.nproc,
          .group_rank = o_.node_rank,
          .job_token = token,
          .listen_fd = socket.fd};
      if (!start_rank(local, environment, args.data(), launcher)) {
        ranks_.signal(SIGKILL);
        return false;
      }
    }
    if (socket.fd >= 0) ::close(socket.fd);
    return true;
  }

  // Until every rank has ended and its output is forwarded; returns
  // dcomm-run's exit status.
  int run() {
    const auto started = clock_type::now();
    // Output first, so what a rank printed before failing comes out first.
    while (forward_output()) {
      reap_ranks();
      if (received_signal && !stopping()) pass_on_signal();
      if (o_.timeout > 0 && !stopping() &&
          clock_type::now() - started > std::chrono::duration<double>(o_.timeout))
        stop_at_timeout();
      if (stop_signal_ && dumps_are_in()) {
        ranks_.stop(stop_signal_);
        stop_signal_ = 0;
      }
      ranks_.kill_overdue();
    }
    if (!o_.trace_dir.empty() && exit_code_ != 0) print_verdict();
    if (!o_.timeline.empty()) merge_timeline();
    return exit_code_;
  }

 private:
  bool start_rank(int local, const dcomm::launch::rank_environment& environment, char** args,
                  pid_t launcher) {
    auto& output = outputs_[static_cast<std::size_t>(local)];
    output.rank = environment.rank;
    int pipes[2][2] = {{-1, -1}, {-1, -1}};
    if (o_.prefix)
      for (auto& p : pipes)
        if (::pipe2(p, O_CLOEXEC) != 0) {
          std::perror("dcomm-run: pipe");
          return false;
        }
    const pid_t pid = dcomm::launch::fork_child(launcher, {SIGINT, SIGTERM, SIGPIPE}, [&] {
      if (o_.prefix) {
        ::dup2(pipes[0][1], 1);
        ::dup2(pipes[1][1], 2);
      }
      environment.apply();
      ::execvp(args[0], args);
      const int err = errno;
      write_all(2, "dcomm-run: cannot run " + o_.command[0] + ": " + std::strerror(err) + "\n");
      ::_exit(127);
    });
    if (pid < 0) {
      std::perror("dcomm-run: fork");
      return false;
    }
    ranks_[static_cast<std::size_t>(local)].pid = pid;
    if (o_.prefix) {
      for (int s = 0; s < 2; ++s) {
        ::close(pipes[s][1]);
        output.streams[s].fd = pipes[s][0];
        output.streams[s].out = s + 1;
        ::fcntl(output.streams[s].fd, F_SETFL, O_NONBLOCK);
      }
    }
    return true;
  }

  // Forwards what the ranks wrote, waiting up to 20 ms for it while a rank
  // runs. False once there is nothing left to wait for: every rank has ended
  // and its pipes are closed, or a descendant of one keeps a pipe open after
  // the ranks are gone (drained for a second, not forever).
  bool forward_output() {
    std::vector<pollfd> fds;
    std::vector<std::pair<stream*, int>> owners;  // stream, rank
    for (auto& output : outputs_)
      for (auto& s : output.streams)
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.emplace_back(&s, output.rank);
        }
    const bool running = ranks_.running() > 0;
    if (!running && fds.empty()) return false;
    if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return true;
    }
    ::poll(fds.data(), fds.size(), running ? 20 : 0);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto* s = owners[i].first;
      if (!pump(*s, "[" + std::to_string(owners[i].second) + "] ")) {
        ::close(s->fd);
        s->fd = -1;
      }
    }
    if (!running) {
      if (!drain_until_) drain_until_ = clock_type::now() + std::chrono::seconds(1);
      if (clock_type::now() > *drain_until_) return false;
    }
    return true;
  }

  // Reaps the ranks that ended. The first failure (unless dcomm-run is
  // stopping on a signal) is reported and stops the others.
  void reap_ranks() {
    ranks_.reap_ended([&](std::size_t local, const dcomm::launch::child_process& r) {
      const bool ok = WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
      if (ok || failed_ || received_signal) return;
      failed_ = true;
      exit_code_ = exit_code_of(r.status);
      std::string how = WIFEXITED(r.status)
                            ? "exited with status " + std::to_string(WEXITSTATUS(r.status))
                            : "was killed by " + dcomm::launch::describe_status(r.status);
      std::fprintf(stderr, "dcomm-run: rank %d (pid %d) %s; stopping the other %d rank(s)\n",
                   outputs_[local].rank, static_cast<int>(r.pid), how.c_str(), ranks_.running());
      std::fflush(stderr);
      stop_ranks(SIGTERM);
    });
  }

  bool stopping() const { return stop_signal_ != 0 || ranks_.stopping(); }

  // Stops the ranks with `sig`; with --trace-dir, SIGUSR1 first, and `sig`
  // once their dumps are in (run's loop).
  void stop_ranks(int sig) {
    if (o_.trace_dir.empty()) {
      ranks_.stop(sig);
      return;
    }
    dumps_asked_ = std::chrono::system_clock::now();
    ranks_.signal(SIGUSR1);
    stop_signal_ = sig;
  }

  // Whether each running rank has written its dump since SIGUSR1 (file
  // times are coarse: 100 ms of slack), or 2 s have passed.
  bool dumps_are_in() const {
    if (std::chrono::system_clock::now() - dumps_asked_ > std::chrono::seconds(2)) return true;
    const auto since = dumps_asked_ - std::chrono::milliseconds(100);
    for (std::size_t local = 0; local < ranks_.size(); ++local) {
      if (!ranks_[local].running()) continue;
      struct stat s {};
      const std::string path =
          o_.trace_dir + "/dcomm-trace-rank" + std::to_string(outputs_[local].rank) + ".json";
      if (::stat(path.c_str(), &s) != 0) return false;
      const auto written = std::chrono::system_clock::time_point(
          std::chrono::duration_cast<std::chrono::system_clock::duration>(
              std::chrono::seconds(s.st_mtim.tv_sec) +
              std::chrono::nanoseconds(s.st_mtim.tv_nsec)));
      if (written < since) return false;
    }
    return true;
  }

  // dcomm-trace (beside dcomm-run) over the dumps, to stderr.
  void print_verdict() const {
    if (!have_trace_tool()) {
      std::fprintf(stderr,
                   "dcomm-run: the ranks' flight recorder dumps are in %s (read them with "
                   "dcomm-trace)\n",
                   o_.trace_dir.c_str());
      return;
    }
    std::fprintf(stderr, "dcomm-run: what the ranks' flight recorders say (dcomm-trace %s):\n",
                 o_.trace_dir.c_str());
    run_trace_tool({o_.trace_dir});
  }

  // dcomm-trace --merge-timeline over this node's ranks' timelines.
  void merge_timeline() const {
    if (!have_trace_tool()) {
      std::fprintf(stderr,
                   "dcomm-run: the ranks' timelines are beside %s (merge them with dcomm-trace "
                   "--merge-timeline)\n",
                   o_.timeline.c_str());
      return;
    }
    run_trace_tool({"--merge-timeline", o_.timeline});
  }

  static bool have_trace_tool() {
    return ::access(beside_this_program("dcomm-trace").c_str(), X_OK) == 0;
  }

  // Runs dcomm-trace with `args`, its output to stderr, and waits for it.
  static void run_trace_tool(std::vector<std::string> args) {
    const std::string tool = beside_this_program("dcomm-trace");
    args.insert(args.begin(), tool);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(2, 1);
      ::execv(tool.c_str(), argv.data());
      ::_exit(127);
    }
    if (pid > 0) {
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }

  void pass_on_signal() {
    std::fprintf(stderr, "dcomm-run: got %s; passing it on to %d rank(s)\n",
                 ::strsignal(received_signal), ranks_.running());
    std::fflush(stderr);
    exit_code_ = 128 + received_signal;
    stop_ranks(received_signal);
  }

  void stop_at_timeout() {
    std::string still;
    for (std::size_t local = 0; local < ranks_.size(); ++local)
      if (ranks_[local].running()) still += " " + std::to_string(outputs_[local].rank);
    std::fprintf(stderr, "dcomm-run: the job ran past --timeout %g s; stopping rank(s)%s\n",
                 o_.timeout, still.c_str());
    std::fflush(stderr);
    exit_code_ = 124;
    failed_ = true;
    stop_ranks(SIGTERM);
  }

  const options& o_;
  dcomm::launch::child_group ranks_;
  std::vector<rank_output> outputs_;  // by local rank, as ranks_
  std::optional<clock_type::time_point> drain_until_;
  int exit_code_ = 0;
  bool failed_ = false;
  int stop_signal_ = 0;  // to send once the ranks' dumps are in (--trace-dir)
  std::chrono::system_clock::time_point dumps_asked_{};
};

// --trace-dir: made if missing, this node's ranks' old dumps removed (so
// the verdict reads this job's), and named to the ranks.
bool prepare_trace_dir(const options& o) {
  if (o.trace_dir.empty()) return true;
  if (::mkdir(o.trace_dir.c_str(), 0777) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "dcomm-run: cannot make --trace-dir %s: %s\n", o.trace_dir.c_str(),
                 std::strerror(errno));
    return false;
  }
  for (int local = 0; local < o.nproc; ++local)
    std::remove((o.trace_dir + "/dcomm-trace-rank" + std::to_string(o.node_rank * o.nproc + local) +
                 ".json")
                    .c_str());
  ::setenv("DCOMM_TRACE_DIR", o.trace_dir.c_str(), 1);
  return true;
}

// --timeline: this node's ranks' old timelines removed (the merge reads
// this job's), and the path named to the ranks.
void prepare_timeline(const options& o) {
  if (o.timeline.empty()) return;
  std::string stem = o.timeline;
  if (stem.ends_with(".json")) stem.resize(stem.size() - 5);
  for (int local = 0; local < o.nproc; ++local)
    std::remove((stem + "-rank" + std::to_string(o.node_rank * o.nproc + local) + ".json").c_str());
  ::setenv("DCOMM_TRACE", o.timeline.c_str(), 1);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  std::optional<std::string> token;
  try {
    token = job_token_for(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcomm-run: %s\n", e.what());
    return 1;
  }
  dcomm::launch::master_socket socket;  // none when --master-port is given
  if (o.master_port == 0) {
    try {
      socket = dcomm::launch::listen_on_free_port(o.master_addr);
      ::fcntl(socket.fd, F_SETFD, FD_CLOEXEC);  // rank 0 alone inherits it
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dcomm-run: %s\n", e.what());
      return 2;
    }
  }
  if (!prepare_trace_dir(o)) return 2;
  prepare_timeline(o);
  pass_signals_to_ranks();
  job j(o);
  if (!j.start(token, socket)) return 1;
  return j.run();
}
