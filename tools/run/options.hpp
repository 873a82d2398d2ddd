// dcomm-run's command line (getopt_long), with torchrun's spellings beside
// dcomm's own, and the defaults a Kubernetes job's PET_* variables give
// (Kubeflow Trainer sets them for torchrun; JobSet's JOB_COMPLETION_INDEX
// is the node rank where PET_NODE_RANK is not set).
#pragma once

#include <getopt.h>
#include <sched.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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
  std::vector<std::string> command;
};

inline constexpr const char* help_text =
    "usage: dcomm-run [OPTIONS] [--] PROGRAM [ARGS...]\n"
    "\n"
    "Starts the ranks of a job on this machine, as torchrun does, and sets for each\n"
    "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and\n"
    "MASTER_PORT (dcomm's and torch's env://). When a rank fails the others are\n"
    "stopped and dcomm-run exits with that rank's status (128 + N for signal N).\n"
    "torchrun's spellings (--nproc_per_node, --node_rank, ...) work too.\n"
    "\n"
    "  -n, --nproc-per-node N   ranks on this node (an integer, or 'cpu'/'auto': one\n"
    "                           per usable core, 'gpu': one per NVIDIA device); 1\n"
    "      --nnodes N           nodes in the job; 1\n"
    "      --node-rank I        this node's index, 0..nnodes-1; 0\n"
    "      --master-addr ADDR   node 0's address, where rank 0's store listens;\n"
    "                           127.0.0.1\n"
    "      --master-port PORT   its port; node 0 picks a free one when not given\n"
    "                           (the other nodes of a multi-node job need it)\n"
    "      --standalone         one node, a free port: the default already\n"
    "      --log-dir DIR        where -t/-r write each rank's output:\n"
    "                           DIR/<rank>/stdout.log and stderr.log\n"
    "  -t, --tee N              also write to DIR: 1 stdout, 2 stderr, 3 both\n"
    "  -r, --redirects N        write to DIR instead of the terminal (as --tee)\n"
    "      --no-prefix          leave the ranks' output alone (no \"[rank] \")\n"
    "      --no-auth            no job token (DCOMM_JOB_TOKEN) for the ranks\n"
    "      --grace SECONDS      how long stopped ranks get before SIGKILL; 5\n"
    "      --timeout SECONDS    stop the job after this long (exit 124); none\n"
    "      --trace-dir DIR      the ranks' flight recorders dump there; on a failure\n"
    "                           dcomm-run asks the survivors for theirs and prints\n"
    "                           dcomm-trace's verdict\n"
    "      --timeline PATH      the ranks write Chrome trace events; merged into PATH\n"
    "  -h, --help               this text\n"
    "\n"
    "Defaults come from a Kubernetes job's PET_NPROC_PER_NODE, PET_NNODES,\n"
    "PET_NODE_RANK (else JOB_COMPLETION_INDEX), PET_MASTER_ADDR and PET_MASTER_PORT\n"
    "where set; the command line wins. Usage errors exit with 2.\n";

[[noreturn]] inline void usage(const std::string& problem) {
  if (problem.empty()) {
    std::fputs(help_text, stdout);
    std::exit(0);
  }
  std::fprintf(stderr, "dcomm-run: %s\n(dcomm-run --help lists the options)\n", problem.c_str());
  std::exit(2);
}

inline int to_int(std::string_view flag, const std::string& v, int low) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end || x < low || x > 1'000'000)
    usage(std::string(flag) + " needs an integer >= " + std::to_string(low) + ", not '" + v + "'");
  return static_cast<int>(x);
}

inline double to_seconds(std::string_view flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= 0))
    usage(std::string(flag) + " needs seconds >= 0, not '" + v + "'");
  return x;
}

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

// --nproc-per-node: an integer, or torchrun's 'cpu', 'auto' and 'gpu'.
inline int to_nproc(std::string_view flag, const std::string& v) {
  if (v == "cpu" || v == "auto") return usable_cores();
  if (v == "gpu") {
    const int gpus = nvidia_devices();
    if (gpus == 0) usage(std::string(flag) + " gpu: this machine shows no NVIDIA device");
    return gpus;
  }
  return to_int(flag, v, 1);
}

// --nnodes: a count; torchrun's elastic MIN:MAX is refused, naming it.
inline int to_nnodes(std::string_view flag, const std::string& v) {
  if (v.find(':') != std::string::npos)
    usage(std::string(flag) + " " + v +
          ": elastic node counts (MIN:MAX) are not supported; give the number of nodes");
  return to_int(flag, v, 1);
}

inline int to_stream_set(std::string_view flag, const std::string& v) {
  const int n = to_int(flag, v, 0);
  if (n > 3) usage(std::string(flag) + " takes 0 (none), 1 (stdout), 2 (stderr) or 3 (both)");
  return n;
}

// A Kubernetes job's defaults (the command line is parsed after, and wins).
inline void defaults_from_environment(options& o) {
  auto var = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v && *v ? v : nullptr;
  };
  if (const char* v = var("PET_NPROC_PER_NODE")) o.nproc = to_nproc("PET_NPROC_PER_NODE", v);
  if (const char* v = var("PET_NNODES")) o.nnodes = to_nnodes("PET_NNODES", v);
  if (const char* v = var("PET_NODE_RANK"))
    o.node_rank = to_int("PET_NODE_RANK", v, 0);
  else if (const char* index = var("JOB_COMPLETION_INDEX"))
    o.node_rank = to_int("JOB_COMPLETION_INDEX", index, 0);
  if (const char* v = var("PET_MASTER_ADDR")) o.master_addr = v;
  if (const char* v = var("PET_MASTER_PORT")) o.master_port = to_int("PET_MASTER_PORT", v, 1);
}

inline options parse(int argc, char** argv) {
  options o;
  defaults_from_environment(o);
  enum : int {
    nnodes = 256,
    node_rank,
    master_addr,
    master_port,
    standalone,
    log_dir,
    no_prefix,
    no_auth,
    grace,
    timeout,
    trace_dir,
    timeline
  };
  // Both spellings of every torchrun option (dashes and underscores).
  static const option long_options[] = {{"nproc-per-node", required_argument, nullptr, 'n'},
                                        {"nproc_per_node", required_argument, nullptr, 'n'},
                                        {"nnodes", required_argument, nullptr, nnodes},
                                        {"node-rank", required_argument, nullptr, node_rank},
                                        {"node_rank", required_argument, nullptr, node_rank},
                                        {"master-addr", required_argument, nullptr, master_addr},
                                        {"master_addr", required_argument, nullptr, master_addr},
                                        {"master-port", required_argument, nullptr, master_port},
                                        {"master_port", required_argument, nullptr, master_port},
                                        {"standalone", no_argument, nullptr, standalone},
                                        {"log-dir", required_argument, nullptr, log_dir},
                                        {"log_dir", required_argument, nullptr, log_dir},
                                        {"tee", required_argument, nullptr, 't'},
                                        {"redirects", required_argument, nullptr, 'r'},
                                        {"no-prefix", no_argument, nullptr, no_prefix},
                                        {"no-auth", no_argument, nullptr, no_auth},
                                        {"grace", required_argument, nullptr, grace},
                                        {"timeout", required_argument, nullptr, timeout},
                                        {"trace-dir", required_argument, nullptr, trace_dir},
                                        {"timeline", required_argument, nullptr, timeline},
                                        {"help", no_argument, nullptr, 'h'},
                                        {nullptr, 0, nullptr, 0}};
  bool alone = false, port_given = false;
  ::opterr = 0;  // our messages, not getopt's
  ::optind = 1;
  // "+": stop at the program, whose own options are its own; ":": a missing
  // value is told apart from an unknown option.
  for (int c; (c = ::getopt_long(argc, argv, "+:n:t:r:h", long_options, nullptr)) != -1;) {
    const std::string flag = ::optind > 0 && ::optind <= argc ? argv[::optind - 1] : "";
    const std::string v = ::optarg ? ::optarg : "";
    switch (c) {
      case 'n':
        o.nproc = to_nproc("--nproc-per-node", v);
        break;
      case nnodes:
        o.nnodes = to_nnodes("--nnodes", v);
        break;
      case node_rank:
        o.node_rank = to_int("--node-rank", v, 0);
        break;
      case master_addr:
        if (v.empty()) usage("--master-addr needs an address");
        o.master_addr = v;
        break;
      case master_port:
        o.master_port = to_int("--master-port", v, 1);
        port_given = true;
        break;
      case standalone:
        alone = true;
        break;
      case log_dir:
        if (v.empty()) usage("--log-dir needs a folder");
        o.log_dir = v;
        break;
      case 't':
        o.tee = to_stream_set("--tee", v);
        break;
      case 'r':
        o.redirects = to_stream_set("--redirects", v);
        break;
      case no_prefix:
        o.prefix = false;
        break;
      case no_auth:
        o.auth = false;
        break;
      case grace:
        o.grace = to_seconds("--grace", v);
        break;
      case timeout:
        o.timeout = to_seconds("--timeout", v);
        break;
      case trace_dir:
      case timeline:
        if (v.empty())
          usage(std::string(c == timeline ? "--timeline" : "--trace-dir") + " needs a path");
        (c == timeline ? o.timeline : o.trace_dir) = v;
        break;
      case 'h':
        usage("");
      case ':':
        usage(flag + " needs a value");
      default:
        usage("unknown option " +
              (::optopt ? "-" + std::string(1, static_cast<char>(::optopt)) : flag));
    }
  }
  for (int i = ::optind; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) usage("no program to run");
  if (alone) {  // torchrun's --standalone: one node, a port of its own
    o.nnodes = 1;
    o.node_rank = 0;
    if (!port_given) o.master_port = 0;
  }
  if (o.node_rank >= o.nnodes)
    usage("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
          std::to_string(o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0 && o.node_rank != 0)
    usage("with --nnodes > 1, the other nodes need --master-port (and --master-addr) of node 0");
  if ((o.tee & o.redirects) != 0)
    usage(
        "--tee and --redirects name the same stream: a stream goes to the terminal and its "
        "file (tee), or to its file only (redirects)");
  return o;
}

}  // namespace dcomm_run
