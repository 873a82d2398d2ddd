// dcomm-run's command line (dcomm/command_line.hpp), with torchrun's spellings beside
// dcomm's own, and the defaults a Kubernetes job's PET_* variables give
// (Kubeflow Trainer sets them for torchrun; JobSet's JOB_COMPLETION_INDEX
// is the node rank where PET_NODE_RANK is not set).
#pragma once

#include <sched.h>
#include <sys/stat.h>

#include <cstdlib>
#include <dcomm/command_line.hpp>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace dcomm_run {

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
  std::string log_dir;    // empty: none
  int tee = 0;            // streams also written to log_dir: 1 stdout, 2 stderr, 3 both
  int redirects = 0;      // streams written to log_dir only
  bool elastic = false;   // serve the store, restart a dead rank's slot (docs/elastic.md)
  int max_restarts = 3;   // with elastic
  int min_ranks = 1;      // with elastic: of this node's ranks
  std::vector<std::string> command;
};

// At most this many ranks on one node (dcomm-run stamps each one's death
// in a table of this size).
inline constexpr int max_local_ranks = 1 << 16;

inline constexpr const char* about =
    "Starts the ranks of a job on this machine, as torchrun does, and sets for each\n"
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and\n"
    "MASTER_PORT (dcomm's and torch's env://). When a rank fails the others are\n"
    "stopped and dcomm-run exits with that rank's status (128 + N for signal N).\n"
    "torchrun's spellings (--nproc_per_node, --node_rank, ...) work too.";

inline constexpr const char* epilog =
    "Defaults come from a Kubernetes job's PET_NPROC_PER_NODE, PET_NNODES,\n"
    "PET_NODE_RANK (else JOB_COMPLETION_INDEX), PET_MASTER_ADDR and PET_MASTER_PORT\n"
    "where set; the command line wins. Usage errors exit with 2.";

// The cores this process may run on.
inline int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return ::sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
}

// NVIDIA devices as the driver lists them (/dev/nvidia0, /dev/nvidia1, ...).
inline int nvidia_devices() {
  int n = 0;
  struct stat s {};
  while (n < 1024 && ::stat(("/dev/nvidia" + std::to_string(n)).c_str(), &s) == 0) ++n;
  return n;
}

// The readers below throw dcomm::usage_error saying what the value should
// be; the command line, or defaults_from_environment, puts the name in front.

// --nproc-per-node: an integer, or torchrun's 'cpu', 'auto' and 'gpu'.
inline int to_nproc(std::string_view v) {
  if (v == "cpu" || v == "auto") return usable_cores();
  if (v == "gpu") {
    const int gpus = nvidia_devices();
    if (gpus == 0) throw dcomm::usage_error("gpu: this machine shows no NVIDIA device");
    return gpus;
  }
  return dcomm::command_line::read<int>(v, 1);
}

// --nnodes: a count; torchrun's elastic MIN:MAX is refused, naming it.
inline int to_nnodes(std::string_view v) {
  if (v.find(':') != std::string_view::npos)
    throw dcomm::usage_error(std::string(v) +
                             ": elastic node counts (MIN:MAX) are not supported; give the "
                             "number of nodes");
  return dcomm::command_line::read<int>(v, 1);
}

// A Kubernetes job's defaults (the command line is read after, and wins).
inline void defaults_from_environment(options& o) {
  auto set = [](const char* name, auto& target, auto read) {
    const char* v = std::getenv(name);
    if (!v || !*v) return false;
    try {
      target = read(v);
    } catch (const dcomm::usage_error& e) {
      throw dcomm::usage_error(std::string(name) + " " + e.what());
    }
    return true;
  };
  using dcomm::command_line;
  set("PET_NPROC_PER_NODE", o.nproc, to_nproc);
  set("PET_NNODES", o.nnodes, to_nnodes);
  if (!set("PET_NODE_RANK", o.node_rank, [](auto v) { return command_line::read<int>(v, 0); }))
    set("JOB_COMPLETION_INDEX", o.node_rank, [](auto v) { return command_line::read<int>(v, 0); });
  set("PET_MASTER_ADDR", o.master_addr, [](auto v) { return std::string(v); });
  set("PET_MASTER_PORT", o.master_port,
      [](auto v) { return command_line::read<int>(v, 1, 65535); });
}

// The table: every option, its target in `o`, its help line.
inline void declare(dcomm::command_line& cl, options& o, bool& alone) {
  cl.custom("n,nproc-per-node,nproc_per_node", "N",
            "ranks on this node (an integer, or 'cpu'/'auto': one per usable core, 'gpu': one "
            "per NVIDIA device); 1",
            [&o](std::string_view v) { o.nproc = to_nproc(v); });
  cl.custom("nnodes", "N", "nodes in the job; 1",
            [&o](std::string_view v) { o.nnodes = to_nnodes(v); });
  cl.option("node-rank,node_rank", o.node_rank, "I", "this node's index, 0..nnodes-1; 0")
      .at_least(0);
  cl.option("master-addr,master_addr", o.master_addr, "ADDR",
            "node 0's address, where rank 0's store listens; 127.0.0.1");
  cl.option("master-port,master_port", o.master_port, "PORT",
            "its port; node 0 picks a free one when not given (the other nodes of a "
            "multi-node job need it)")
      .at_least(1)
      .at_most(65535);
  cl.flag("standalone", alone, "one node, a free port: the default already");
  cl.option("log-dir,log_dir", o.log_dir, "DIR",
            "where -t/-r write each rank's output: DIR/<rank>/stdout.log and stderr.log");
  cl.option("t,tee", o.tee, "N", "also write to DIR: 1 stdout, 2 stderr, 3 both")
      .at_least(0)
      .at_most(3);
  cl.option("r,redirects", o.redirects, "N", "write to DIR instead of the terminal (as --tee)")
      .at_least(0)
      .at_most(3);
  cl.flag("no-prefix", o.prefix, "leave the ranks' output alone (no \"[rank] \")", false);
  cl.flag("no-auth", o.auth, "no job token (DCOMM_JOB_TOKEN) for the ranks", false);
  cl.option("grace", o.grace, "SECONDS", "how long stopped ranks get before SIGKILL; 5")
      .at_least(0);
  cl.option("timeout", o.timeout, "SECONDS", "stop the job after this long (exit 124); none")
      .at_least(0);
  cl.option("trace-dir", o.trace_dir, "DIR",
            "the ranks' flight recorders dump there; on a failure dcomm-run asks the survivors "
            "for theirs and prints dcomm-trace's verdict");
  cl.option("timeline", o.timeline, "PATH",
            "the ranks write Chrome trace events; merged into PATH");
  cl.flag("elastic", o.elastic,
          "keep the job through failures: serve its store (dcomm-store, beside dcomm-run), "
          "restart a dead rank's slot (DCOMM_JOINING=1: the program joins, docs/elastic.md)");
  cl.option("max-restarts,max_restarts", o.max_restarts, "N",
            "with --elastic: restarts of dead ranks' slots before the job ends; 3")
      .at_least(0);
  cl.option("min-ranks,min_ranks", o.min_ranks, "M",
            "with --elastic: the job ends when fewer of this node's ranks run; 1")
      .at_least(1);
  cl.arguments("PROGRAM", o.command, "the program each rank runs, with its ARGS").required();
}

inline options parse(int argc, char** argv) {
  options o;
  bool alone = false;
  dcomm::command_line cl("dcomm-run", about);
  cl.synopsis("[OPTIONS] [--] PROGRAM [ARGS...]").epilog(epilog);
  // Options end at the program, whose own options are its own.
  cl.stop_at_first_argument();
  declare(cl, o, alone);
  try {
    defaults_from_environment(o);
  } catch (const dcomm::usage_error& e) {
    cl.fail(e.what());
  }
  cl.parse(argc, argv);
  if (alone) {  // torchrun's --standalone: one node, a port of its own
    o.nnodes = 1;
    o.node_rank = 0;
    if (!cl.given("master-port")) o.master_port = 0;
  }
  if (o.nproc > max_local_ranks)
    cl.fail("at most " + std::to_string(max_local_ranks) + " ranks per node");
  if (o.node_rank >= o.nnodes)
    cl.fail("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
            std::to_string(o.nnodes));
  if (static_cast<long long>(o.nnodes) * o.nproc > std::numeric_limits<int>::max())
    cl.fail("--nnodes times --nproc-per-node is over " +
            std::to_string(std::numeric_limits<int>::max()) + " ranks");
  if (o.nnodes > 1 && o.master_port == 0 && o.node_rank != 0)
    cl.fail("with --nnodes > 1, the other nodes need --master-port (and --master-addr) of node 0");
  if (!o.elastic && (cl.given("max-restarts") || cl.given("min-ranks")))
    cl.fail("--max-restarts and --min-ranks apply to --elastic jobs");
  if (o.elastic && o.min_ranks > o.nproc)
    cl.fail("--min-ranks " + std::to_string(o.min_ranks) + " is over the " +
            std::to_string(o.nproc) + " rank(s) of this node");
  if ((o.tee & o.redirects) != 0)
    cl.fail(
        "--tee and --redirects name the same stream: a stream goes to the terminal and its "
        "file (tee), or to its file only (redirects)");
  return o;
}

}  // namespace dcomm_run
