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
// --elastic (docs/elastic.md) keeps the job through failures: node 0's
// dcomm-store (beside dcomm-run) serves the job's store, so it outlives
// every rank (DCOMM_STORE_SERVED=1), and a rank that fails has its slot
// restarted, the new process told to join the running job (DCOMM_JOINING=1,
// TORCHELASTIC_RESTART_COUNT), up to --max-restarts times while at least
// --min-ranks of this node's ranks run (run/restarts.hpp); then the job
// ends as above. A summary of the failures ends dcomm-run's output.
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
#include "run/output.hpp"
#include "run/restarts.hpp"
#include "run/signals.hpp"
#include "run/store_process.hpp"
#include "run/trace_tool.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

using dcomm_run::deaths;
using dcomm_run::have_trace_tool;
using dcomm_run::monotonic_ns;
using dcomm_run::options;
using dcomm_run::rank_output;
using dcomm_run::received_signal;
using dcomm_run::run_trace_tool;
using dcomm_run::stream;

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

// This node's share of the job: its ranks, their output, and how it ends.
class job {
 public:
  explicit job(const options& o)
      : o_(o),
        ranks_(static_cast<std::size_t>(o.nproc), std::chrono::duration_cast<clock_type::duration>(
                                                      std::chrono::duration<double>(o.grace))),
        outputs_(static_cast<std::size_t>(o.nproc)),
        policy_(o.max_restarts, o.min_ranks) {}

  // Forks and execs the ranks. False, having said why and killed the ranks
  // already started, when pipe() or fork() fails.
  bool start(const std::optional<std::string>& token, const dcomm::launch::master_socket& socket) {
    for (const auto& a : o_.command) args_.push_back(const_cast<char*>(a.c_str()));
    args_.push_back(nullptr);
    std::fflush(nullptr);
    deaths.count.store(static_cast<std::size_t>(o_.nproc), std::memory_order_release);
    launcher_ = ::getpid();  // single-threaded: its thread is the process
    errors_.prepare();
    // --elastic: node 0's dcomm-store serves the job's store, on the socket
    // picked for the job or on --master-port; the ranks connect to it.
    if (o_.elastic && o_.node_rank == 0 &&
        !store_.start(socket.fd, socket.fd >= 0 ? 0 : o_.master_port, token, launcher_))
      return false;
    for (int local = 0; local < o_.nproc; ++local) {
      environments_.push_back({.master_addr = o_.master_addr,
                               .master_port = socket.fd >= 0 ? socket.port : o_.master_port,
                               .rank = o_.node_rank * o_.nproc + local,
                               .world_size = o_.nnodes * o_.nproc,
                               .local_rank = local,
                               .local_world_size = o_.nproc,
                               .group_rank = o_.node_rank,
                               .job_token = token,
                               .listen_fd = o_.elastic ? -1 : socket.fd,
                               .store_served = o_.elastic});
      if (!start_rank(static_cast<std::size_t>(local))) {
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
    // Output first, so what a rank printed before failing comes out first.
    while (forward_output()) {
      reap_ranks();
      if (received_signal && !stopping()) pass_on_signal();
      if (o_.timeout > 0 && !stopping() &&
          clock_type::now() - started_ > std::chrono::duration<double>(o_.timeout))
        stop_at_timeout();
      if (o_.elastic) watch_store();
      if (stop_signal_ && dumps_are_in()) {
        ranks_.stop(stop_signal_);
        stop_signal_ = 0;
      }
      ranks_.kill_overdue();
    }
    if (!o_.trace_dir.empty() && exit_code_ != 0) print_verdict();
    if (!o_.timeline.empty()) merge_timeline();
    if (o_.elastic) {
      store_.stop();
      const std::string ending = exit_code_ == 0
                                     ? "the job succeeded"
                                     : "the job ended with status " + std::to_string(exit_code_);
      std::fputs(policy_.summary(ending).c_str(), stderr);
    }
    return exit_code_;
  }

 private:
  // Starts slot `local`'s process with its environment (a restarted one
  // joins: environments_[local].joining).
  bool start_rank(std::size_t local) {
    const auto& environment = environments_[local];
    char** args = args_.data();
    auto& output = outputs_[local];
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
    const pid_t pid = dcomm::launch::fork_child(launcher_, {SIGINT, SIGTERM, SIGPIPE}, [&] {
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
      dcomm_run::write_all(
          2, "dcomm-run: cannot run " + o_.command[0] + ": " + std::strerror(err) + "\n");
      ::_exit(127);
    });
    if (pid < 0) {
      std::perror("dcomm-run: fork");
      return false;
    }
    ranks_[local] = dcomm::launch::child_process{.pid = pid};
    deaths.watch(local, pid);  // the SIGCHLD handler watches it from now on
    if (piped) {
      for (int s = 0; s < 2; ++s) {
        ::close(pipes[s][1]);
        stream& st = output.streams[s];
        st.fd = pipes[s][0];
        const int bit = 1 << s;  // 1: stdout, 2: stderr
        st.out = (o_.redirects & bit) ? -1 : s + 1;
        if ((o_.tee | o_.redirects) & bit)
          st.file = open_log(environment.rank, s, environment.joining);
        ::fcntl(st.fd, F_SETFL, O_NONBLOCK);
      }
    }
    return true;
  }

  // DIR/<rank>/stdout.log or stderr.log (-1, having said why, where it
  // cannot be made: the output still goes where it can); a restarted
  // rank's process appends to its slot's.
  int open_log(int rank, int s, bool append) const {
    const std::string dir = o_.log_dir + "/" + std::to_string(rank);
    ::mkdir(dir.c_str(), 0777);
    const std::string path = dir + (s == 0 ? "/stdout.log" : "/stderr.log");
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0666);
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
    for (auto* outputs : {&outputs_, &retired_})
      for (auto& output : *outputs)
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
      if (!dcomm_run::pump(*s, prefix)) s->close();
    }
    std::erase_if(retired_, [](const rank_output& r) { return !r.open(); });
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
    if (o_.elastic) return restart_or_end(local, r);
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

  // --elastic: a failed rank's slot is restarted (the new process joins the
  // job) while restart_policy allows; otherwise the job ends with that
  // rank's status. The survivors are the program's to keep going.
  void restart_or_end(std::size_t local, const dcomm::launch::child_process& r) {
    const int rank = outputs_[local].rank;
    const std::string what =
        "rank " + std::to_string(rank) + " (pid " + std::to_string(r.pid) + ") " + how_it_ended(r);
    std::fprintf(stderr, "dcomm-run: %s\n", what.c_str());
    // A killed rank wrote nothing at its death: what its file holds is
    // of a failure it came through.
    const std::string why = WIFEXITED(r.status) ? errors_.message_of(rank) : std::string();
    if (!why.empty())
      std::fprintf(stderr, "dcomm-run: rank %d failed with: %s\n", rank, why.c_str());
    const int survivors = ranks_.running();
    std::string ending;
    switch (policy_.decide(survivors)) {
      case dcomm_run::restart_policy::verdict::restart: {
        const int n = policy_.restarted();
        policy_.note(seconds_since_start(), what + "; restarted (" + std::to_string(n) + " of " +
                                                std::to_string(policy_.max()) + ")");
        std::fprintf(stderr,
                     "dcomm-run: restarting rank %d's slot (restart %d of --max-restarts %d): the "
                     "new process joins the job (DCOMM_JOINING=1)\n",
                     rank, n, policy_.max());
        std::fflush(stderr);
        errors_.forget(rank);
        // What the old process wrote and is not yet read still comes out.
        retired_.push_back(outputs_[local]);
        outputs_[local] = rank_output{};
        environments_[local].joining = true;
        environments_[local].restart_count = n;
        if (start_rank(local)) return;
        ending = "its restart failed";
        break;
      }
      case dcomm_run::restart_policy::verdict::no_restarts_left:
        ending = "no restarts left (--max-restarts " + std::to_string(policy_.max()) + ")";
        break;
      case dcomm_run::restart_policy::verdict::too_few_ranks:
        ending = std::to_string(survivors) + " of this node's ranks run, under --min-ranks " +
                 std::to_string(policy_.min_ranks());
        break;
    }
    policy_.note(seconds_since_start(), what + "; " + ending);
    failed_ = true;
    exit_code_ = exit_code_of(r.status);
    const int running = ranks_.running();
    std::fprintf(stderr, "dcomm-run: %s: %s\n", ending.c_str(),
                 running ? ("stopping the other " + std::to_string(running) + " rank(s)").c_str()
                         : "no other rank is running");
    if (!why.empty()) dcomm::trace::write_error_file("rank " + std::to_string(rank) + ": " + why);
    std::fflush(stderr);
    stop_ranks(SIGTERM);
  }

  // --elastic: a store that ends while the ranks run ends the job (they
  // cannot meet without it).
  void watch_store() {
    if (failed_ || stopping() || store_.pid() <= 0) return;
    const auto status = store_.ended();
    if (!status) return;
    failed_ = true;
    exit_code_ = 1;
    const std::string what = "the job's store (dcomm-store, pid " + std::to_string(store_.pid()) +
                             ") ended: " + dcomm::launch::describe_status(*status);
    policy_.note(seconds_since_start(), what);
    std::fprintf(stderr, "dcomm-run: %s; stopping the %d rank(s)\n", what.c_str(),
                 ranks_.running());
    std::fflush(stderr);
    stop_ranks(SIGTERM);
  }

  double seconds_since_start() const {
    return std::chrono::duration<double>(clock_type::now() - started_).count();
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
  const clock_type::time_point started_ = clock_type::now();
  std::vector<char*> args_;  // PROGRAM ARGS, for execvp
  pid_t launcher_ = -1;
  dcomm::launch::child_group ranks_;
  std::vector<dcomm::launch::rank_environment> environments_;  // by local rank, as ranks_
  std::vector<rank_output> outputs_;                           // by local rank, as ranks_
  std::vector<rank_output> retired_;  // of restarted slots' old processes, until read to the end
  dcomm_run::restart_policy policy_;
  dcomm_run::store_process store_;  // --elastic, node 0
  dcomm_run::error_files errors_;   // the ranks' TORCHELASTIC_ERROR_FILEs
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
                     "dcomm-run: node 0 of %d: %s store listens at %s:%d; start the other "
                     "nodes with --master-addr %s --master-port %d\n",
                     o.nnodes, o.elastic ? "the job's" : "rank 0's", o.master_addr.c_str(),
                     socket.port, o.master_addr.c_str(), socket.port);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dcomm-run: %s\n", e.what());
      return 2;
    }
  }
  if (!dcomm_run::prepare_trace_dir(o)) return 2;
  dcomm_run::prepare_timeline(o);
  dcomm_run::pass_signals_to_ranks();
  job j(o);
  if (!j.start(token, socket)) return 1;
  return j.run();
}
