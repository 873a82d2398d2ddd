// Tests for dcomm::parse_init_method. The environment is always an injected
// map, so the result never depends on the shell that runs the tests.
// Size: one parser's cases (URL forms, launcher environments, precedence),
// each a few lines; they read best side by side in one file.
#include <doctest/doctest.h>
#include <dcomm/init_method.hpp>

#include <functional>
#include <map>
#include <optional>
#include <ostream>  // doctest prints std::error_code with operator<<
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace {

using vars = std::map<std::string, std::string, std::less<>>;

dcomm::env_lookup env_of(vars v) {
  return [v = std::move(v)](std::string_view name) -> std::optional<std::string> {
    const auto it = v.find(name);
    if (it == v.end()) return std::nullopt;
    return it->second;
  };
}

// env:// needs these whatever else a test sets.
dcomm::env_lookup master_env(vars extra = {}) {
  extra.emplace("MASTER_ADDR", "10.0.0.1");
  extra.emplace("MASTER_PORT", "29500");
  return env_of(std::move(extra));
}

const dcomm::env_lookup no_env = env_of({});

dcomm::init_spec parse(std::string_view url, std::optional<int> rank, std::optional<int> world_size,
                       const dcomm::env_lookup& env) {
  return dcomm::parse_init_method(url, rank, world_size, env);
}

struct caught {
  bool thrown = false;
  std::error_code code;
  std::string what;
};

template <class F>
caught capture(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const dcomm::error& e) {
    return {true, e.code(), e.what()};
  }
  return {};
}

}  // namespace

// Checks that `call` throws dcomm::error with errc::invalid_argument and that
// what() contains every one of the given strings. A macro, so that failures
// point at the test line.
#define CHECK_INVALID(call, ...)                                                                 \
  do {                                                                                           \
    const caught caught_ = capture([&] { (void)(call); });                                       \
    REQUIRE_MESSAGE(caught_.thrown, "expected dcomm::error from " #call);                        \
    INFO("what(): ", caught_.what);                                                              \
    CHECK(caught_.code == dcomm::errc::invalid_argument);                                        \
    CHECK(caught_.what.find("init_method") != std::string::npos);                                \
    for (std::string_view needle_ : {__VA_ARGS__})                                               \
      CHECK_MESSAGE(caught_.what.find(needle_) != std::string::npos, "message lacks '", needle_, \
                    "'");                                                                        \
  } while (false)

TEST_SUITE("init_method") {
  // ---------------------------------------------------------------- env://

  TEST_CASE("env:// with torchrun variables") {
    const auto s = parse(
        "env://", {}, {},
        master_env(
            {{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}}));
    CHECK(s.kind == dcomm::init_kind::env);
    CHECK(s.url == "env://");
    CHECK(s.host == "10.0.0.1");
    CHECK(s.port == 29500);
    CHECK(s.path.empty());
    CHECK(s.rank == 3);
    CHECK(s.world_size == 8);
    CHECK(s.local_rank == 1);
    CHECK(s.local_world_size == 4);
    CHECK(s.launcher == "RANK/WORLD_SIZE");
    CHECK(s.address() == "tcp://10.0.0.1:29500");
  }

  TEST_CASE("env:// with OpenMPI variables") {
    const auto s = parse("env://", {}, {},
                         master_env({{"OMPI_COMM_WORLD_RANK", "5"},
                                     {"OMPI_COMM_WORLD_SIZE", "6"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}}));
    CHECK(s.rank == 5);
    CHECK(s.world_size == 6);
    CHECK(s.local_rank == 2);
    CHECK(s.local_world_size == 3);
    CHECK(s.launcher == "OpenMPI");
  }

  TEST_CASE("env:// with MPICH/Hydra variables") {
    const auto s = parse("env://", {}, {},
                         master_env({{"PMI_RANK", "1"},
                                     {"PMI_SIZE", "2"},
                                     {"MPI_LOCALRANKID", "0"},
                                     {"MPI_LOCALNRANKS", "1"}}));
    CHECK(s.rank == 1);
    CHECK(s.world_size == 2);
    CHECK(s.local_rank == 0);
    CHECK(s.local_world_size == 1);
    CHECK(s.launcher == "MPICH/Hydra");
  }

  TEST_CASE("env:// with Slurm variables") {
    SUBCASE("plain per-node count") {
      const auto s = parse("env://", {}, {},
                           master_env({{"SLURM_PROCID", "7"},
                                       {"SLURM_NTASKS", "8"},
                                       {"SLURM_LOCALID", "3"},
                                       {"SLURM_NTASKS_PER_NODE", "4"}}));
      CHECK(s.rank == 7);
      CHECK(s.world_size == 8);
      CHECK(s.local_rank == 3);
      CHECK(s.local_world_size == 4);
      CHECK(s.launcher == "Slurm");
    }
    SUBCASE("N(xM) form takes N") {
      const auto s = parse("env://", {}, {},
                           master_env({{"SLURM_PROCID", "4"},
                                       {"SLURM_NTASKS", "6"},
                                       {"SLURM_LOCALID", "0"},
                                       {"SLURM_NTASKS_PER_NODE", "2(x3)"}}));
      CHECK(s.local_rank == 0);
      CHECK(s.local_world_size == 2);
    }
    SUBCASE("uneven or unreadable per-node counts leave the local size unset") {
      for (const char* count : {"2(x2),1", "abc", "", "2(x)", "2(x3", "2(3)", "0", "2(x0)"}) {
        CAPTURE(count);
        const auto s = parse("env://", {}, {},
                             master_env({{"SLURM_PROCID", "4"},
                                         {"SLURM_NTASKS", "5"},
                                         {"SLURM_LOCALID", "0"},
                                         {"SLURM_NTASKS_PER_NODE", count}}));
        CHECK(s.local_rank == 0);
        CHECK_FALSE(s.local_world_size.has_value());
      }
    }
    SUBCASE("the step's layout when --ntasks-per-node was not given") {
      const auto s = parse("env://", {}, {},
                           master_env({{"SLURM_PROCID", "1"},
                                       {"SLURM_NTASKS", "4"},
                                       {"SLURM_LOCALID", "1"},
                                       {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}}));
      CHECK(s.local_world_size == 2);
    }
    SUBCASE("LOCAL_WORLD_SIZE when Slurm has no usable count") {
      const auto s = parse("env://", {}, {},
                           master_env({{"SLURM_PROCID", "1"},
                                       {"SLURM_NTASKS", "4"},
                                       {"SLURM_LOCALID", "1"},
                                       {"SLURM_NTASKS_PER_NODE", "2(x1),2"},
                                       {"LOCAL_WORLD_SIZE", "2"}}));
      CHECK(s.local_world_size == 2);
    }
  }

  TEST_CASE("env:// launcher families are tried in order") {
    const vars torchrun{{"RANK", "1"}, {"WORLD_SIZE", "2"}};
    const vars ompi{{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}};
    const vars hydra{{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}};
    const vars slurm{{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}};
    auto merged = [](std::initializer_list<vars> parts) {
      vars all;
      for (const vars& p : parts) all.insert(p.begin(), p.end());
      return all;
    };

    auto s = parse("env://", {}, {}, master_env(merged({torchrun, ompi, hydra, slurm})));
    CHECK(s.launcher == "RANK/WORLD_SIZE");
    CHECK(s.rank == 1);
    CHECK(s.world_size == 2);

    s = parse("env://", {}, {}, master_env(merged({ompi, hydra, slurm})));
    CHECK(s.launcher == "OpenMPI");
    CHECK(s.rank == 3);
    CHECK(s.world_size == 4);

    s = parse("env://", {}, {}, master_env(merged({hydra, slurm})));
    CHECK(s.launcher == "MPICH/Hydra");
    CHECK(s.rank == 5);
    CHECK(s.world_size == 6);

    s = parse("env://", {}, {}, master_env(slurm));
    CHECK(s.launcher == "Slurm");
    CHECK(s.rank == 7);
    CHECK(s.world_size == 8);

    // The size always comes from the family that gave the rank.
    s = parse(
        "env://", {}, {},
        master_env(
            {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"WORLD_SIZE", "99"}}));
    CHECK(s.world_size == 2);
  }

  TEST_CASE("env:// local rank prefers the family that gave the rank") {
    SUBCASE("OpenMPI rank, both OpenMPI and LOCAL_* set") {
      const auto s = parse("env://", {}, {},
                           master_env({{"OMPI_COMM_WORLD_RANK", "3"},
                                       {"OMPI_COMM_WORLD_SIZE", "4"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                       {"LOCAL_RANK", "0"},
                                       {"LOCAL_WORLD_SIZE", "4"}}));
      CHECK(s.local_rank == 1);
      CHECK(s.local_world_size == 2);
    }
    SUBCASE("Hydra rank without Hydra local variables falls back to LOCAL_*") {
      const auto s = parse("env://", {}, {},
                           master_env({{"PMI_RANK", "3"},
                                       {"PMI_SIZE", "4"},
                                       {"LOCAL_RANK", "1"},
                                       {"LOCAL_WORLD_SIZE", "2"},
                                       {"SLURM_LOCALID", "0"}}));
      CHECK(s.local_rank == 1);
      CHECK(s.local_world_size == 2);
    }
    SUBCASE("torchrun rank ignores the local variables of an outer launcher") {
      const auto s = parse("env://", {}, {},
                           master_env({{"RANK", "3"},
                                       {"WORLD_SIZE", "4"},
                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}}));
      CHECK_FALSE(s.local_rank.has_value());
      CHECK_FALSE(s.local_world_size.has_value());
    }
    SUBCASE("no local variables at all") {
      const auto s = parse("env://", {}, {}, master_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
      CHECK_FALSE(s.local_rank.has_value());
      CHECK_FALSE(s.local_world_size.has_value());
    }
  }

  TEST_CASE("env:// rank and world size: code, then query, then environment") {
    const auto env = master_env({{"RANK", "1"}, {"WORLD_SIZE", "4"}});

    auto s = parse("env://", 2, 3, env);
    CHECK(s.rank == 2);
    CHECK(s.world_size == 3);
    CHECK(s.launcher == "code");

    s = parse("env://?rank=3&world_size=5", {}, {}, env);
    CHECK(s.rank == 3);
    CHECK(s.world_size == 5);
    CHECK(s.launcher == "query");

    // Code and query may repeat each other.
    s = parse("env://?rank=2&world_size=3", 2, 3, env);
    CHECK(s.rank == 2);
    CHECK(s.launcher == "code");

    // Each value is resolved on its own.
    s = parse("env://", {}, 6, env);
    CHECK(s.rank == 1);
    CHECK(s.world_size == 6);
    CHECK(s.launcher == "RANK/WORLD_SIZE");

    s = parse("env://?world_size=7", {}, {}, env);
    CHECK(s.rank == 1);
    CHECK(s.world_size == 7);

    s = parse("env://", 0, {}, env);
    CHECK(s.rank == 0);
    CHECK(s.world_size == 4);
    CHECK(s.launcher == "code");

    // Code values never read, so broken variables do not matter.
    s = parse("env://", 0, 2, master_env({{"RANK", "abc"}, {"WORLD_SIZE", "-3"}}));
    CHECK(s.rank == 0);
    CHECK(s.world_size == 2);

    // Only the size missing: any launcher's size will do.
    s = parse("env://", 1, {}, master_env({{"SLURM_NTASKS", "3"}}));
    CHECK(s.world_size == 3);
    CHECK(s.launcher == "code");

    // No launcher at all, everything explicit.
    s = parse("env://?rank=0&world_size=1", {}, {}, master_env());
    CHECK(s.rank == 0);
    CHECK(s.world_size == 1);
  }

  TEST_CASE("env:// MASTER_ADDR forms") {
    auto addr = [](const char* value) {
      return parse("env://", 0, 1, env_of({{"MASTER_ADDR", value}, {"MASTER_PORT", "1234"}}));
    };
    CHECK(addr("node-7.cluster.local").host == "node-7.cluster.local");
    CHECK(addr("my_host").host == "my_host");
    CHECK(addr("192.168.1.20").host == "192.168.1.20");
    auto s = addr("::1");
    CHECK(s.host == "::1");
    CHECK(s.address() == "tcp://[::1]:1234");
    CHECK(addr("[::1]").host == "::1");
    CHECK(addr("fe80::1%eth0").host == "fe80::1%eth0");
    CHECK(addr("::ffff:10.0.0.1").host == "::ffff:10.0.0.1");
    CHECK(addr("localhost").port == 1234);
    CHECK(parse("env://", 0, 1, env_of({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "65535"}})).port ==
          65535);
    CHECK(parse("env://", 0, 1, env_of({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})).port == 1);
  }

  TEST_CASE("env:// scheme is case-insensitive and takes an empty query") {
    CHECK(parse("ENV://", 0, 1, master_env()).kind == dcomm::init_kind::env);
    CHECK(parse("env://?", 0, 1, master_env()).rank == 0);
    CHECK(parse("env://?rank=0&world_size=1&", {}, {}, master_env()).world_size == 1);
  }

  // ---------------------------------------------------------------- tcp://

  TEST_CASE("tcp:// hosts") {
    auto s = parse("tcp://10.1.2.3:29500", 0, 2, no_env);
    CHECK(s.kind == dcomm::init_kind::tcp);
    CHECK(s.host == "10.1.2.3");
    CHECK(s.port == 29500);
    CHECK(s.rank == 0);
    CHECK(s.world_size == 2);
    CHECK(s.launcher == "code");
    CHECK(s.address() == "tcp://10.1.2.3:29500");

    s = parse("tcp://trainer-0.example.com:1", 0, 1, no_env);
    CHECK(s.host == "trainer-0.example.com");
    CHECK(s.port == 1);

    s = parse("tcp://[::1]:29500", 0, 1, no_env);
    CHECK(s.host == "::1");
    CHECK(s.address() == "tcp://[::1]:29500");

    s = parse("tcp://[fe80::1%eth0]:29500", 0, 1, no_env);
    CHECK(s.host == "fe80::1%eth0");
    CHECK(s.address() == "tcp://[fe80::1%eth0]:29500");

    s = parse("tcp://[2001:db8::42]:65535/", 0, 1, no_env);
    CHECK(s.host == "2001:db8::42");
    CHECK(s.port == 65535);

    CHECK(parse("TCP://h:2", 0, 1, no_env).kind == dcomm::init_kind::tcp);
  }

  TEST_CASE("tcp:// rank and world size from code or query") {
    auto s = parse("tcp://h:2?rank=1&world_size=3", {}, {}, no_env);
    CHECK(s.rank == 1);
    CHECK(s.world_size == 3);
    CHECK(s.launcher == "query");

    s = parse("tcp://h:2?world_size=3&rank=2", {}, {}, no_env);
    CHECK(s.rank == 2);

    s = parse("tcp://h:2?world_size=3", 1, {}, no_env);
    CHECK(s.rank == 1);
    CHECK(s.world_size == 3);
    CHECK(s.launcher == "code");

    s = parse("tcp://h:2?rank=1&world_size=3", 1, 3, no_env);
    CHECK(s.rank == 1);

    // tcp:// never takes rank from the environment...
    CHECK_INVALID(parse("tcp://h:2", {}, {}, env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}})), "rank",
                  "query string");
  }

  TEST_CASE("tcp:// and file:// still read the local layout") {
    auto s =
        parse("tcp://h:2", 1, 4,
              env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
    CHECK(s.local_rank == 1);
    CHECK(s.local_world_size == 2);

    s = parse("file:///tmp/x", 1, 4,
              env_of({{"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "2(x2)"}}));
    CHECK(s.local_rank == 1);
    CHECK(s.local_world_size == 2);

    s = parse("tcp://h:2", 1, 4, env_of({{"LOCAL_RANK", "0"}, {"SLURM_LOCALID", "1"}}));
    CHECK(s.local_rank == 0);

    s = parse("tcp://h:2", 1, 4, {});  // an empty env_lookup is an empty environment
    CHECK_FALSE(s.local_rank.has_value());
  }

  // ---------------------------------------------------------------- file://

  TEST_CASE("file:// paths") {
    auto s = parse("file:///tmp/dcomm_init", 0, 2, no_env);
    CHECK(s.kind == dcomm::init_kind::file);
    CHECK(s.path == "/tmp/dcomm_init");
    CHECK(s.host.empty());
    CHECK(s.address() == "file:///tmp/dcomm_init");

    s = parse("file:///shared/run 1/store?rank=1&world_size=2", {}, {}, no_env);
    CHECK(s.path == "/shared/run 1/store");
    CHECK(s.rank == 1);
    CHECK(s.launcher == "query");

    CHECK(parse("file:/tmp/a", 0, 1, no_env).path == "/tmp/a");
    CHECK(parse("file://localhost/tmp/a", 0, 1, no_env).path == "/tmp/a");
  }

  // ---------------------------------------------------------------- bad input

  TEST_CASE("unparseable URLs and unknown schemes list the supported ones") {
    CHECK_INVALID(parse("", 0, 1, no_env), "env://", "tcp://", "file://", "empty");
    CHECK_INVALID(parse("http://h:80", 0, 1, no_env), "'http://'", "env://", "tcp://", "file://");
    CHECK_INVALID(parse("localhost:29500", 0, 1, no_env), "'localhost://'", "tcp://");
    CHECK_INVALID(parse("29500", 0, 1, no_env), "not a URL", "env://");
    CHECK_INVALID(parse("://h:1", 0, 1, no_env), "not a URL");
    CHECK_INVALID(parse(" env://", 0, 1, master_env()), "blanks");
    CHECK_INVALID(parse("env://\n", 0, 1, master_env()), "blanks", "'env://\\x0a'");
    CHECK_INVALID(parse(std::string_view("tcp://h:1\0x", 11), 0, 1, no_env), "control",
                  "tcp://h:1\\x00x");
    CHECK_INVALID(parse("tcp://h:1#frag", 0, 1, no_env), "'#frag'", "fragment");
    CHECK_INVALID(parse("env://#x", 0, 1, master_env()), "fragment");
    CHECK_INVALID(parse("tcp:h:1", 0, 1, no_env), "two slashes");
    CHECK_INVALID(parse("tcp://h:1/path", 0, 1, no_env), "'/path'");
    CHECK_INVALID(parse("env:", 0, 1, master_env()), "MASTER_ADDR", "tcp://host:port");
    CHECK_INVALID(parse("env://10.0.0.1:29500", 0, 1, master_env()), "MASTER_ADDR", "MASTER_PORT",
                  "tcp://host:port");
    CHECK_INVALID(parse("env:///x", 0, 1, master_env()), "env://");
  }

  TEST_CASE("Slurm host lists expand as scontrol show hostnames does") {
    using dcomm::init::expand_hostlist;
    using list = std::vector<std::string>;
    CHECK(expand_hostlist("node01") == list{"node01"});
    CHECK(expand_hostlist("node[01-03,07],login2") ==
          list{"node01", "node02", "node03", "node07", "login2"});
    CHECK(expand_hostlist("gpu[8-10]") == list{"gpu8", "gpu9", "gpu10"});
    CHECK(expand_hostlist("gpu[08-10]") == list{"gpu08", "gpu09", "gpu10"});
    CHECK(expand_hostlist("rack[1-2]-node[1-2]") ==
          list{"rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"});
    CHECK(expand_hostlist("a,b[2],c-ib") == list{"a", "b2", "c-ib"});
    for (const char* bad : {"", "node[", "node[1-", "node[3-1]", "node]", "a,,b", "n[[1]]", "n[x]"})
      CHECK_MESSAGE(expand_hostlist(bad).empty(), bad);
    CHECK(dcomm::init::slurm_port("4242917") == 17917);
    CHECK(dcomm::init::slurm_port("12") == 15012);
    CHECK_FALSE(dcomm::init::slurm_port("abc").has_value());
  }

  TEST_CASE("env:// under srun: rank 0's host from the node list, the port from the job id") {
    const auto s = parse("env://", {}, {},
                         env_of({{"SLURM_PROCID", "3"},
                                 {"SLURM_NTASKS", "4"},
                                 {"SLURM_JOB_ID", "4242917"},
                                 {"SLURM_JOB_NODELIST", "login1,node[01-04]"},
                                 {"SLURM_STEP_NODELIST", "node[02-03]"}}));
    CHECK(s.host == "node02");  // the step's first node, not the allocation's
    CHECK(s.port == 17917);
    CHECK(s.rank == 3);
    CHECK(s.address_from ==
          "SLURM_STEP_NODELIST (its first host) and SLURM_JOB_ID (15000 + its "
          "last four digits)");
    // What is set wins.
    const auto set = parse("env://", {}, {},
                           env_of({{"SLURM_PROCID", "0"},
                                   {"SLURM_NTASKS", "1"},
                                   {"SLURM_JOB_ID", "7"},
                                   {"SLURM_JOB_NODELIST", "node[01-04]"},
                                   {"MASTER_ADDR", "10.1.1.1"},
                                   {"MASTER_PORT", "29500"}}));
    CHECK(set.host == "10.1.1.1");
    CHECK(set.port == 29500);
    CHECK(set.address_from == "MASTER_ADDR and MASTER_PORT");
    CHECK_INVALID(parse("env://", {}, {},
                        env_of({{"SLURM_PROCID", "0"},
                                {"SLURM_NTASKS", "1"},
                                {"SLURM_JOB_ID", "7"},
                                {"SLURM_JOB_NODELIST", "node[01-"}})),
                  "SLURM_JOB_NODELIST", "node[01-", "MASTER_ADDR");
  }

  TEST_CASE("env:// in a Kubernetes job of one rank per pod: PET_* and JOB_COMPLETION_INDEX") {
    const vars pet{{"PET_NNODES", "4"},
                   {"PET_NODE_RANK", "2"},
                   {"PET_MASTER_ADDR", "job-node-0-0.job"},
                   {"PET_MASTER_PORT", "29400"}};
    auto s = parse("env://", {}, {}, env_of(pet));
    CHECK(s.rank == 2);
    CHECK(s.world_size == 4);
    CHECK(s.launcher == "Kubeflow PET_*");
    CHECK(s.host == "job-node-0-0.job");
    CHECK(s.port == 29400);
    CHECK(s.local_rank == 0);
    CHECK(s.local_world_size == 1);
    vars indexed = pet;
    indexed.erase("PET_NODE_RANK");
    indexed.emplace("JOB_COMPLETION_INDEX", "3");
    s = parse("env://", {}, {}, env_of(indexed));
    CHECK(s.rank == 3);
    CHECK(s.launcher == "JobSet");
    // torchrun's variables, where torchrun started the ranks, win.
    vars torchrun = pet;
    torchrun.insert({{"RANK", "5"}, {"WORLD_SIZE", "8"}});
    CHECK(parse("env://", {}, {}, env_of(torchrun)).rank == 5);
    vars many = pet;
    many.emplace("PET_NPROC_PER_NODE", "4");
    CHECK_INVALID(parse("env://", {}, {}, env_of(many)), "PET_NPROC_PER_NODE", "dcomm-run");
    vars elastic = pet;
    elastic["PET_NNODES"] = "2:4";
    CHECK_INVALID(parse("env://", {}, {}, env_of(elastic)), "PET_NNODES='2:4'");
  }

  TEST_CASE("env:// without MASTER_ADDR or MASTER_PORT") {
    CHECK_INVALID(parse("env://", 0, 1, env_of({{"MASTER_PORT", "29500"}})), "MASTER_ADDR unset",
                  "env:// needs MASTER_ADDR", "MASTER_PORT");
    CHECK_INVALID(parse("env://", 0, 1, env_of({{"MASTER_ADDR", "h"}})), "MASTER_PORT unset",
                  "env:// needs MASTER_ADDR", "MASTER_PORT");
    CHECK_INVALID(parse("env://", 0, 1, no_env), "MASTER_ADDR");
    CHECK_INVALID(parse("env://", 0, 1, {}), "MASTER_ADDR");
  }

  TEST_CASE("bad MASTER_ADDR") {
    auto with_addr = [](const char* value) {
      return env_of({{"MASTER_ADDR", value}, {"MASTER_PORT", "29500"}});
    };
    CHECK_INVALID(parse("env://", 0, 1, with_addr("")), "MASTER_ADDR=''", "empty");
    CHECK_INVALID(parse("env://", 0, 1, with_addr("[]")), "MASTER_ADDR='[]'", "empty");
    CHECK_INVALID(parse("env://", 0, 1, with_addr("10.0.0.1:29500")),
                  "MASTER_ADDR='10.0.0.1:29500'", "MASTER_PORT");
    CHECK_INVALID(parse("env://", 0, 1, with_addr("[10.0.0.1]")), "MASTER_ADDR='[10.0.0.1]'",
                  "IPv6");
    CHECK_INVALID(parse("env://", 0, 1, with_addr("fe80::g")), "MASTER_ADDR='fe80::g'", "IPv6");
    CHECK_INVALID(parse("env://", 0, 1, with_addr("my host")), "MASTER_ADDR='my host'",
                  "letters, digits");
    CHECK_INVALID(parse("env://", 0, 1, with_addr("tcp://h")), "MASTER_ADDR='tcp://h'");
  }

  TEST_CASE("bad ports") {
    auto with_port = [](const char* value) {
      return env_of({{"MASTER_ADDR", "h"}, {"MASTER_PORT", value}});
    };
    CHECK_INVALID(parse("env://", 0, 1, with_port("abc")), "MASTER_PORT='abc'", "1..65535");
    CHECK_INVALID(parse("env://", 0, 1, with_port("")), "MASTER_PORT=''", "1..65535");
    CHECK_INVALID(parse("env://", 0, 1, with_port(" 29500")), "MASTER_PORT=' 29500'");
    CHECK_INVALID(parse("env://", 0, 1, with_port("+29500")), "MASTER_PORT='+29500'");
    CHECK_INVALID(parse("env://", 0, 1, with_port("29500x")), "MASTER_PORT='29500x'", "'x'");
    CHECK_INVALID(parse("env://", 0, 1, with_port("29500 ")), "MASTER_PORT='29500 '");
    CHECK_INVALID(parse("env://", 0, 1, with_port("65536")), "MASTER_PORT='65536'", "1..65535");
    CHECK_INVALID(parse("env://", 0, 1, with_port("-1")), "MASTER_PORT='-1'", "1..65535");
    CHECK_INVALID(parse("env://", 0, 1, with_port("99999999999")), "MASTER_PORT='99999999999'",
                  "does not fit");
    CHECK_INVALID(parse("env://", 0, 1, with_port("0")), "MASTER_PORT='0'", "port 0",
                  "other ranks");

    CHECK_INVALID(parse("tcp://h:abc", 0, 1, no_env), "port 'abc'", "1..65535");
    CHECK_INVALID(parse("tcp://h:0", 0, 1, no_env), "port '0'", "other ranks");
    CHECK_INVALID(parse("tcp://h:65536", 0, 1, no_env), "port '65536'", "1..65535");
    CHECK_INVALID(parse("tcp://h:80x", 0, 1, no_env), "port '80x'", "'x'");
    CHECK_INVALID(parse("tcp://h:-5", 0, 1, no_env), "port '-5'");
    CHECK_INVALID(parse("tcp://h:", 0, 1, no_env), "port ''");
    CHECK_INVALID(parse("tcp://h", 0, 1, no_env), "port is missing");
    CHECK_INVALID(parse("tcp://[::1]", 0, 1, no_env), "port is missing");
    CHECK_INVALID(parse("tcp://[::1]29500", 0, 1, no_env), "port", "'29500'", "tcp://[::1]:PORT");
  }

  TEST_CASE("bad tcp:// hosts") {
    CHECK_INVALID(parse("tcp://:29500", 0, 1, no_env), "host is empty", "tcp://:29500");
    CHECK_INVALID(parse("tcp://", 0, 1, no_env), "host is empty");
    CHECK_INVALID(parse("tcp://?rank=0&world_size=1", {}, {}, no_env), "host is empty");
    CHECK_INVALID(parse("tcp://::1:29500", 0, 1, no_env), "brackets", "[::1]");
    CHECK_INVALID(parse("tcp://[::1:29500", 0, 1, no_env), "']'");
    CHECK_INVALID(parse("tcp://[]:29500", 0, 1, no_env), "IPv6", "''");
    CHECK_INVALID(parse("tcp://[10.0.0.1]:29500", 0, 1, no_env), "IPv6", "'10.0.0.1'");
    CHECK_INVALID(parse("tcp://[fe80::1%]:29500", 0, 1, no_env), "IPv6", "'fe80::1%'");
    CHECK_INVALID(parse("tcp://user@h:29500", 0, 1, no_env), "'user@h:29500'", "user");
    CHECK_INVALID(parse("tcp://h%20x:29500", 0, 1, no_env), "'h%20x'", "letters, digits");
  }

  TEST_CASE("bad file:// paths") {
    CHECK_INVALID(parse("file://relative", 0, 1, no_env), "three slashes", "'relative'",
                  "file:///");
    CHECK_INVALID(parse("file://relative/x", 0, 1, no_env), "three slashes", "'relative'");
    CHECK_INVALID(parse("file:", 0, 1, no_env), "path is missing", "file:///");
    CHECK_INVALID(parse("file://", 0, 1, no_env), "path is missing");
    CHECK_INVALID(parse("file:relative", 0, 1, no_env), "absolute", "'relative'");
    CHECK_INVALID(parse("file:///", 0, 1, no_env), "directory", "'/'");
    CHECK_INVALID(parse("file:///tmp/dir/", 0, 1, no_env), "directory", "'/tmp/dir/'");
    CHECK_INVALID(parse("file:///tmp/x#frag", 0, 1, no_env), "fragment");
  }

  TEST_CASE("bad query strings") {
    CHECK_INVALID(parse("tcp://h:1?rank=0&world_size=1&use_libuv=1", {}, {}, no_env), "'use_libuv'",
                  "rank and world_size");
    CHECK_INVALID(parse("file:///tmp/x?mode=rw", 0, 1, no_env), "'mode'");
    CHECK_INVALID(parse("env://?foo=1", 0, 1, master_env()), "'foo'");
    CHECK_INVALID(parse("tcp://h:1?rank&world_size=1", {}, {}, no_env), "rank", "no value");
    CHECK_INVALID(parse("tcp://h:1?rank=0&rank=0&world_size=1", {}, {}, no_env), "rank",
                  "appears twice");
    CHECK_INVALID(parse("tcp://h:1?rank=&world_size=1", {}, {}, no_env), "rank=''");
    CHECK_INVALID(parse("tcp://h:1?rank=%31&world_size=2", {}, {}, no_env), "rank='%31'");
  }

  TEST_CASE("missing rank or world size") {
    // In the words of init_process_group, the call a user makes.
    CHECK_INVALID(parse("tcp://h:1", {}, {}, no_env), "rank", "world_size", "in code",
                  "init_options{.rank = R, .world_size = N} to init_process_group", "query string",
                  "tcp://...?rank=R&world_size=N");
    CHECK_INVALID(parse("tcp://h:1?rank=0", {}, {}, no_env), "world_size not given");
    CHECK_INVALID(parse("tcp://h:1", 0, {}, no_env), "world_size not given");
    CHECK_INVALID(parse("file:///tmp/x", {}, 2, no_env), "rank not given",
                  "file://...?rank=R&world_size=N");
    CHECK_INVALID(parse("env://", {}, {}, master_env()), "RANK", "torchrun", "srun",
                  "none of them set");
    CHECK_INVALID(parse("env://", 0, {}, master_env()), "WORLD_SIZE", "world size");
    CHECK_INVALID(parse("env://", {}, 4, master_env({{"WORLD_SIZE", "4"}})), "RANK");
  }

  TEST_CASE("a launcher's rank without its size names the missing variable") {
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "0"}})), "WORLD_SIZE",
                  "RANK is set but WORLD_SIZE is not");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"OMPI_COMM_WORLD_RANK", "0"}})),
                  "OMPI_COMM_WORLD_SIZE", "OpenMPI");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"PMI_RANK", "0"}})), "PMI_SIZE",
                  "MPICH/Hydra");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"SLURM_PROCID", "0"}})), "SLURM_NTASKS",
                  "Slurm");
    // A size from another launcher does not complete the pair.
    CHECK_INVALID(
        parse("env://", {}, {}, master_env({{"RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}})),
        "WORLD_SIZE is not");
    // With the size given in code the launcher's size is not needed.
    CHECK(parse("env://", {}, 2, master_env({{"PMI_RANK", "1"}})).rank == 1);
  }

  TEST_CASE("rank and world size that are not integers") {
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "abc"}, {"WORLD_SIZE", "2"}})),
                  "RANK='abc'", "integer");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "0"}, {"WORLD_SIZE", "two"}})),
                  "WORLD_SIZE='two'", "integer");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "12x"}, {"WORLD_SIZE", "20"}})),
                  "RANK='12x'", "'x' after the number");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "1.0"}, {"WORLD_SIZE", "2"}})),
                  "RANK='1.0'", "'.0'");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", ""}, {"WORLD_SIZE", "2"}})),
                  "RANK=''");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "0"}, {"WORLD_SIZE", "0x10"}})),
                  "WORLD_SIZE='0x10'");
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}})),
                  "WORLD_SIZE='99999999999999999999'", "does not fit");
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}})),
                  "OMPI_COMM_WORLD_RANK='x'");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"PMI_RANK", "0"}, {"PMI_SIZE", "2 "}})),
                  "PMI_SIZE='2 '");
    CHECK_INVALID(
        parse("env://", {}, {}, master_env({{"SLURM_PROCID", "-"}, {"SLURM_NTASKS", "2"}})),
        "SLURM_PROCID='-'");
    CHECK_INVALID(parse("tcp://h:1?rank=abc&world_size=2", {}, {}, no_env), "rank='abc'",
                  "query string");
    CHECK_INVALID(parse("tcp://h:1?rank=0&world_size=3x", {}, {}, no_env), "world_size='3x'",
                  "'x'");
    CHECK_INVALID(parse("tcp://h:1?rank=2147483648&world_size=2", {}, {}, no_env),
                  "rank='2147483648'", "does not fit", "2147483647");
  }

  TEST_CASE("negative and zero values") {
    CHECK_INVALID(
        parse("env://", {}, {}, master_env({{"RANK", "-99999999999"}, {"WORLD_SIZE", "2"}})),
        "RANK='-99999999999'", "does not fit");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "-1"}, {"WORLD_SIZE", "2"}})),
                  "RANK='-1'", ">= 0");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "0"}, {"WORLD_SIZE", "-2"}})),
                  "WORLD_SIZE='-2'", ">= 1");
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "0"}, {"WORLD_SIZE", "0"}})),
                  "WORLD_SIZE='0'", "no ranks");
    CHECK_INVALID(parse("tcp://h:1?rank=-1&world_size=2", {}, {}, no_env), "rank='-1'", ">= 0");
    CHECK_INVALID(parse("tcp://h:1?rank=0&world_size=0", {}, {}, no_env), "world_size='0'",
                  "no ranks");
    CHECK_INVALID(parse("tcp://h:1", -1, 2, no_env), "rank=-1 passed in code", "std::nullopt");
    CHECK_INVALID(parse("tcp://h:1", 0, 0, no_env), "world_size=0 passed in code", "no ranks");
    CHECK_INVALID(parse("file:///tmp/x", 0, -4, no_env), "world_size=-4 passed in code");
    CHECK_INVALID(parse("tcp://h:1", 0, 2, env_of({{"LOCAL_RANK", "-1"}})), "LOCAL_RANK='-1'",
                  ">= 0");
    CHECK_INVALID(parse("tcp://h:1", 0, 2, env_of({{"LOCAL_WORLD_SIZE", "0"}})),
                  "LOCAL_WORLD_SIZE='0'", "no ranks");
  }

  TEST_CASE("rank not below world size names both") {
    CHECK_INVALID(parse("env://", {}, {}, master_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}})),
                  "RANK='4'", "WORLD_SIZE='4'", "0..3");
    CHECK_INVALID(
        parse("env://", {}, {}, master_env({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "2"}})),
        "SLURM_PROCID='9'", "SLURM_NTASKS='2'");
    CHECK_INVALID(parse("tcp://h:1?rank=2&world_size=2", {}, {}, no_env), "rank='2'",
                  "world_size='2'");
    CHECK_INVALID(parse("tcp://h:1", 5, 3, no_env), "rank=5 passed in code",
                  "world_size=3 passed in code");
    CHECK_INVALID(parse("env://", 3, {}, master_env({{"RANK", "0"}, {"WORLD_SIZE", "3"}})),
                  "rank=3 passed in code", "WORLD_SIZE='3'");
  }

  TEST_CASE("local rank not below local world size names both") {
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"RANK", "1"},
                                    {"WORLD_SIZE", "8"},
                                    {"LOCAL_RANK", "4"},
                                    {"LOCAL_WORLD_SIZE", "4"}})),
                  "LOCAL_RANK='4'", "LOCAL_WORLD_SIZE='4'", "local rank");
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"OMPI_COMM_WORLD_RANK", "1"},
                                    {"OMPI_COMM_WORLD_SIZE", "8"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})),
                  "OMPI_COMM_WORLD_LOCAL_RANK='2'", "OMPI_COMM_WORLD_LOCAL_SIZE='2'");
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"PMI_RANK", "1"},
                                    {"PMI_SIZE", "8"},
                                    {"MPI_LOCALRANKID", "3"},
                                    {"MPI_LOCALNRANKS", "1"}})),
                  "MPI_LOCALRANKID='3'", "MPI_LOCALNRANKS='1'");
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"SLURM_PROCID", "1"},
                                    {"SLURM_NTASKS", "8"},
                                    {"SLURM_LOCALID", "2"},
                                    {"SLURM_NTASKS_PER_NODE", "2(x4)"}})),
                  "SLURM_LOCALID='2'", "SLURM_NTASKS_PER_NODE='2(x4)'");
    CHECK_INVALID(
        parse("env://", {}, {},
              master_env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "abc"}})),
        "SLURM_LOCALID='abc'", "integer");
    CHECK_INVALID(parse("env://", {}, {},
                        master_env({{"RANK", "1"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1x"}})),
                  "LOCAL_RANK='1x'", "'x'");
  }

  TEST_CASE("code and query string that disagree name both values") {
    CHECK_INVALID(parse("tcp://h:1?rank=1&world_size=4", 2, {}, no_env), "rank=2 passed in code",
                  "rank='1' in the query string");
    CHECK_INVALID(parse("file:///tmp/x?rank=0&world_size=4", 0, 3, no_env),
                  "world_size=3 passed in code", "world_size='4' in the query string");
    CHECK_INVALID(parse("env://?rank=1", 0, 2, master_env()), "rank=0 passed in code",
                  "rank='1' in the query string");
  }

  TEST_CASE("errors carry the URL and the variable in the context") {
    try {
      (void)parse("env://", {}, {}, master_env({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}));
      FAIL("expected an error");
    } catch (const dcomm::error& e) {
      CHECK(e.code() == dcomm::errc::invalid_argument);
      CHECK(e.context().operation == "init_method");
      CHECK(e.context().key == "RANK");
      CHECK(e.context().address == "env://");
      CHECK(e.context().seen == "RANK='abc'");
    }
  }
}
