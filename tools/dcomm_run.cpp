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
// and how: the first to die (a SIGCHLD handler stamps each death, so a
// survivor that exits on the lost peer moments later is not the one named).
// --timeout bounds the whole job (exit 124). Usage errors: exit 2. The
// options (torchrun's spellings too, PET_* defaults) are in run/options.hpp,
// a table for dcomm/command_line.hpp;
// --tee/--redirects copy or move each rank's output to --log-dir. Each rank
// gets a TORCHELASTIC_ERROR_FILE, as under torchrun: the message of the rank
// named as the first to fail is printed (and written to dcomm-run's own).
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

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
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
#include "run/error_files.hpp"
#include "run/folders.hpp"
#include "run/options.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using dcomm_run::options;

// A stream of one rank (stdout or stderr), cut into lines.
struct stream {
  int fd = -1;
  int out = 1;    // where its lines go, with their prefix (-1: nowhere: --redirects)
  int file = -1;  // and as they are (--tee, --redirects; -1: no file)
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

// When each rank was first seen dead, stamped in the SIGCHLD handler: the
// order in which ranks failed, even when the loop reaps several in one
// pass (a rank that died, and a survivor that exited on the lost peer a
// millisecond later). SIGCHLD also cuts the loop's poll short.
struct death_stamps {
  static constexpr std::size_t max_ranks = dcomm_run::max_local_ranks;
  std::atomic<pid_t> pid[max_ranks] = {};
  std::atomic<std::int64_t> ns[max_ranks] = {};  // 0: not seen dead
  std::atomic<std::size_t> count{0};
};
death_stamps deaths;

std::int64_t monotonic_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

void on_child_ended(int) {
  const int saved = errno;  // waitid may change it under the interrupted code
  const std::size_t n = deaths.count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const pid_t pid = deaths.pid[i].load(std::memory_order_relaxed);
    if (pid <= 0 || deaths.ns[i].load(std::memory_order_relaxed) != 0) continue;
    siginfo_t info{};
    // WNOWAIT: seen, not reaped (the loop reaps it).
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == pid)
      deaths.ns[i].store(monotonic_ns(), std::memory_order_relaxed);
  }
  errno = saved;
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

// Reads what is there; writes out complete lines, each with its prefix, and
// as they are to the stream's file. Returns false at end of file.
bool pump(stream& s, const std::string& prefix) {
  char buffer[65536];
  ssize_t n = ::read(s.fd, buffer, sizeof buffer);
  if (n < 0) return errno == EINTR || errno == EAGAIN;
  if (n == 0) {
    if (!s.partial.empty()) {
      if (s.out >= 0) write_all(s.out, prefix + s.partial + "\n");
      if (s.file >= 0) write_all(s.file, s.partial + "\n");
    }
    s.partial.clear();
    return false;
  }
  s.partial.append(buffer, static_cast<std::size_t>(n));
  std::string lines;
  std::size_t start = 0;
  for (std::size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
    lines += prefix + s.partial.substr(start, nl + 1 - start);
  if (s.file >= 0 && start > 0) write_all(s.file, s.partial.substr(0, start));
  s.partial.erase(0, start);
  if (!lines.empty() && s.out >= 0) write_all(s.out, lines);
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
  struct sigaction child {};
  child.sa_handler = on_child_ended;
  sigemptyset(&child.sa_mask);
  child.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  ::sigaction(SIGCHLD, &child, nullptr);
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
    deaths.count.store(static_cast<std::size_t>(o_.nproc), std::memory_order_release);
    const pid_t launcher = ::getpid();  // single-threaded: its thread is the process
    errors_.prepare();
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
    // Piped when lines get a prefix or go to files (--tee, --redirects).
    const bool piped = o_.prefix || o_.tee || o_.redirects;
    if (piped)
      for (auto& p : pipes)
        if (::pipe2(p, O_CLOEXEC) != 0) {
          std::perror("dcomm-run: pipe");
          return false;
        }
    const std::string error_file = errors_.path_for(environment.rank);
    const pid_t pid = dcomm::launch::fork_child(launcher, {SIGINT, SIGTERM, SIGPIPE}, [&] {
      if (piped) {
        ::dup2(pipes[0][1], 1);
        ::dup2(pipes[1][1], 2);
      }
      environment.apply();
      if (error_file.empty())
        ::unsetenv(dcomm::trace::error_file_variable);  // dcomm-run's own is not the rank's
      else
        ::setenv(dcomm::trace::error_file_variable, error_file.c_str(), 1);
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
    note_started(local, pid);
    if (piped) {
      for (int s = 0; s < 2; ++s) {
        ::close(pipes[s][1]);
        stream& st = output.streams[s];
        st.fd = pipes[s][0];
        const int bit = 1 << s;  // 1: stdout, 2: stderr
        st.out = (o_.redirects & bit) ? -1 : s + 1;
        if ((o_.tee | o_.redirects) & bit) st.file = open_log(environment.rank, s);
        ::fcntl(st.fd, F_SETFL, O_NONBLOCK);
      }
    }
    return true;
  }

  // DIR/<rank>/stdout.log or stderr.log (-1, having said why, where it
  // cannot be made: the output still goes where it can).
  int open_log(int rank, int s) const {
    const std::string dir = o_.log_dir + "/" + std::to_string(rank);
    ::mkdir(dir.c_str(), 0777);
    const std::string path = dir + (s == 0 ? "/stdout.log" : "/stderr.log");
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0)
      std::fprintf(stderr, "dcomm-run: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return fd;
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
      // Appended, not "[" + ... + "] ": g++ 12 -O2 warns (-Wrestrict) on that
      // operator+ chain, a false positive (GCC bug 105651).
      std::string prefix;
      if (o_.prefix) prefix.append("[").append(std::to_string(owners[i].second)).append("] ");
      if (!pump(*s, prefix)) {
        ::close(s->fd);
        s->fd = -1;
        if (s->file >= 0) ::close(s->file);
        s->file = -1;
      }
    }
    if (!running) {
      if (!drain_until_) drain_until_ = clock_type::now() + std::chrono::seconds(1);
      if (clock_type::now() > *drain_until_) return false;
    }
    return true;
  }

  // Reaps the ranks that ended, in the order they died. The first failure
  // (unless dcomm-run is stopping on a signal) is reported and stops the
  // others.
  void reap_ranks() {
    std::vector<std::pair<std::int64_t, std::size_t>> ended;  // (died, local)
    ranks_.reap_ended([&](std::size_t local, const dcomm::launch::child_process&) {
      const std::int64_t died = deaths.ns[local].load(std::memory_order_relaxed);
      ended.emplace_back(died ? died : monotonic_ns(), local);
    });
    std::sort(ended.begin(), ended.end());
    for (const auto& [died, local] : ended) report_end(local, ranks_[local]);
  }

  void report_end(std::size_t local, const dcomm::launch::child_process& r) {
    const bool ok = WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
    if (ok || failed_ || received_signal) return;
    failed_ = true;
    const std::size_t first = culprit(local);
    const auto& f = ranks_[first];
    exit_code_ = exit_code_of(f.done ? f.status : r.status);
    const int running = ranks_.running();
    const std::string rest = running
                                 ? "; stopping the other " + std::to_string(running) + " rank(s)"
                                 : "; no other rank is running";
    if (first == local) {
      std::fprintf(stderr, "dcomm-run: rank %d (pid %d) %s%s\n", outputs_[local].rank,
                   static_cast<int>(r.pid), how_it_ended(r).c_str(), rest.c_str());
    } else {
      std::fprintf(stderr, "dcomm-run: rank %d (pid %d) %s first (rank %d, which %s, names it)%s\n",
                   outputs_[first].rank, static_cast<int>(f.pid),
                   f.done ? how_it_ended(f).c_str() : "failed", outputs_[local].rank,
                   how_it_ended(r).c_str(), rest.c_str());
    }
    // What it wrote to its TORCHELASTIC_ERROR_FILE, here and to ours.
    const int rank = outputs_[first].rank;
    if (const std::string why = errors_.message_of(rank); !why.empty()) {
      std::fprintf(stderr, "dcomm-run: rank %d failed with: %s\n", rank, why.c_str());
      dcomm::trace::write_error_file("rank " + std::to_string(rank) + ": " + why);
    }
    std::fflush(stderr);
    stop_ranks(SIGTERM);
  }

  static std::string how_it_ended(const dcomm::launch::child_process& r) {
    return WIFEXITED(r.status) ? "exited with status " + std::to_string(WEXITSTATUS(r.status))
                               : "was killed by " + dcomm::launch::describe_status(r.status);
  }

  // The rank to name for the failure of rank `local`. A survivor can die of
  // a lost peer before the kernel reports the peer's own death (its sockets
  // close first), or be reaped in the same pass (dcomm-run itself slow to
  // run), so the order of deaths is not enough: a dcomm error names the
  // peer that caused it ("peers rank P"), and if rank P wrote an error file
  // of its own, or has ended unsuccessfully (killed: no file), P failed
  // first.
  std::size_t culprit(std::size_t local) const {
    std::vector<bool> seen(outputs_.size(), false);
    while (!seen[local]) {
      seen[local] = true;
      const std::string why = errors_.message_of(outputs_[local].rank);
      const std::string mark = ", peers rank ";
      const auto at = why.find(mark);
      if (at == std::string::npos) break;
      const int peer = std::atoi(why.c_str() + at + mark.size());
      std::size_t next = outputs_.size();
      for (std::size_t i = 0; i < outputs_.size(); ++i)
        if (outputs_[i].rank == peer) next = i;
      if (next == outputs_.size()) break;
      const auto& p = ranks_[next];
      const bool ended_badly = p.done && !(WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0);
      if (errors_.message_of(peer).empty() && !ended_badly) break;
      local = next;
    }
    return local;
  }

  // The SIGCHLD handler watches this rank from now on.
  static void note_started(int local, pid_t pid) {
    deaths.pid[static_cast<std::size_t>(local)].store(pid, std::memory_order_relaxed);
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
  // times are coarse: 100 ms of slack), or 2 s have passed. A rank that
  // failed and dumped before writes SIGUSR1's beside that one (-later).
  bool dumps_are_in() const {
    if (std::chrono::system_clock::now() - dumps_asked_ > std::chrono::seconds(2)) return true;
    const auto since = dumps_asked_ - std::chrono::milliseconds(100);
    auto written_since = [since](const std::string& path) {
      struct stat s {};
      if (::stat(path.c_str(), &s) != 0) return false;
      return std::chrono::system_clock::time_point(
                 std::chrono::duration_cast<std::chrono::system_clock::duration>(
                     std::chrono::seconds(s.st_mtim.tv_sec) +
                     std::chrono::nanoseconds(s.st_mtim.tv_nsec))) >= since;
    };
    for (std::size_t local = 0; local < ranks_.size(); ++local) {
      if (!ranks_[local].running()) continue;
      const std::string stem =
          o_.trace_dir + "/dcomm-trace-rank" + std::to_string(outputs_[local].rank);
      if (!written_since(stem + ".json") && !written_since(stem + "-later.json")) return false;
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
  dcomm_run::error_files errors_;     // the ranks' TORCHELASTIC_ERROR_FILEs
  std::optional<clock_type::time_point> drain_until_;
  int exit_code_ = 0;
  bool failed_ = false;
  int stop_signal_ = 0;  // to send once the ranks' dumps are in (--trace-dir)
  std::chrono::system_clock::time_point dumps_asked_{};
};

}  // namespace

int main(int argc, char** argv) {
  options o = dcomm_run::parse(argc, argv);
  if (!dcomm_run::prepare_log_dir(o)) return 2;
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
      // The other nodes need to know where node 0 listens.
      if (o.nnodes > 1)
        std::fprintf(stderr,
                     "dcomm-run: node 0 of %d: rank 0's store listens at %s:%d; start the other "
                     "nodes with --master-addr %s --master-port %d\n",
                     o.nnodes, o.master_addr.c_str(), socket.port, o.master_addr.c_str(),
                     socket.port);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dcomm-run: %s\n", e.what());
      return 2;
    }
  }
  if (!dcomm_run::prepare_trace_dir(o)) return 2;
  dcomm_run::prepare_timeline(o);
  pass_signals_to_ranks();
  job j(o);
  if (!j.start(token, socket)) return 1;
  return j.run();
}
