// dcomm::command_line: every kind of value, both spellings of an option,
// positional arguments, "--", the errors a user sees and the --help text,
// checked against the values and words written out here.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <dcomm/command_line.hpp>
#include <initializer_list>
#include <string>
#include <vector>

namespace {

using dcomm::command_line;
using dcomm::usage_error;

// try_parse over `args` (the program's name put first).
bool parse(command_line& cl, std::initializer_list<const char*> args) {
  std::vector<const char*> argv{"prog"};
  argv.insert(argv.end(), args.begin(), args.end());
  return cl.try_parse(static_cast<int>(argv.size()), argv.data());
}

// What try_parse's usage_error says (empty: none).
std::string error_of(command_line& cl, std::initializer_list<const char*> args) {
  try {
    parse(cl, args);
  } catch (const usage_error& e) {
    return e.what();
  }
  return "";
}

enum class mode { latency, batch, both };

// A table with one option of each kind.
struct every_kind {
  int iters = 0;
  std::size_t limit = 0;
  std::int64_t offset = 0;
  double seconds = 5;
  float lr = 0.05f;
  std::string name = "none";
  std::size_t bytes = 8;
  mode m = mode::both;
  bool check = true, verbose = false;
  int custom = 0;
  command_line cl{"prog"};

  every_kind() {
    cl.option("i,iters", iters, "N", "timed calls").at_least(0);
    cl.option("limit", limit, "N", "the first N");
    cl.option("offset", offset, "N", "where to start");
    cl.option("seconds", seconds, "S", "how long").at_least(0);
    cl.option("lr", lr, "RATE", "learning rate");
    cl.option("name", name, "NAME", "a name");
    cl.bytes("b,max-bytes", bytes, "B", "largest message");
    cl.choice("mode", m, {{"latency", mode::latency}, {"batch", mode::batch}, {"both", mode::both}},
              "M", "what to time");
    cl.flag("no-check", check, "skip the check", false);
    cl.flag("v,verbose", verbose, "say more");
    cl.custom("custom", "X", "twice X", [this](std::string_view v) {
      if (v != "7") throw usage_error("takes only 7, not '" + std::string(v) + "'");
      custom = 14;
    });
  }
};

}  // namespace

TEST_SUITE("command line") {
  TEST_CASE("every kind of value, in the space and the = forms") {
    every_kind a;
    CHECK(parse(a.cl, {"--iters", "12", "--limit=18446744073709551615", "--offset", "-3",
                       "--seconds=0.25", "--lr", "1e-3", "--name", "x y", "--max-bytes", "64M",
                       "--mode=batch", "--no-check", "--verbose", "--custom", "7"}));
    CHECK(a.iters == 12);
    CHECK(a.limit == 18446744073709551615u);
    CHECK(a.offset == -3);
    CHECK(a.seconds == 0.25);
    CHECK(a.lr == 1e-3f);
    CHECK(a.name == "x y");
    CHECK(a.bytes == std::size_t{64} << 20);
    CHECK(a.m == mode::batch);
    CHECK_FALSE(a.check);
    CHECK(a.verbose);
    CHECK(a.custom == 14);
    CHECK(a.cl.given("iters"));
    CHECK(a.cl.given("limit"));
    every_kind untouched;
    CHECK(parse(untouched.cl, {}));
    CHECK(untouched.iters == 0);
    CHECK(untouched.check);
    CHECK(untouched.name == "none");
    CHECK_FALSE(untouched.cl.given("iters"));
    every_kind sizes;
    CHECK(parse(sizes.cl, {"--max-bytes=4K"}));
    CHECK(sizes.bytes == 4096);
    CHECK(parse(sizes.cl, {"--max-bytes", "1g"}));
    CHECK(sizes.bytes == std::size_t{1} << 30);
  }

  TEST_CASE("one-letter names, clusters and unique prefixes") {
    every_kind a;
    CHECK(parse(a.cl, {"-i5", "-vb", "2K", "--lim", "9", "--max=1M"}));
    CHECK(a.iters == 5);
    CHECK(a.verbose);
    CHECK(a.bytes == std::size_t{1} << 20);
    CHECK(a.limit == 9);
    every_kind b;
    CHECK(parse(b.cl, {"-i", "6", "-b8"}));
    CHECK(b.iters == 6);
    CHECK(b.bytes == 8);
    // --n is no-check or name: neither is taken.
    every_kind c;
    CHECK(error_of(c.cl, {"--n", "x"}) == "unknown option --n (ambiguous: --name, --no-check)");
  }

  TEST_CASE("unknown options, missing values, a value for a flag") {
    every_kind a;
    CHECK(error_of(a.cl, {"--bogus"}) == "unknown option --bogus");
    CHECK(error_of(a.cl, {"--bogus=3"}) == "unknown option --bogus");
    CHECK(error_of(a.cl, {"-x"}) == "unknown option -x");
    CHECK(error_of(a.cl, {"-vx"}) == "unknown option -x");
    CHECK(error_of(a.cl, {"--iters"}) == "--iters needs a value");
    CHECK(error_of(a.cl, {"-i"}) == "--iters needs a value");
    CHECK(error_of(a.cl, {"--name="}) == "--name needs a value");
    CHECK(error_of(a.cl, {"--no-check=1"}) == "--no-check takes no value");
    CHECK(error_of(a.cl, {"--custom", "8"}) == "--custom takes only 7, not '8'");
    CHECK(error_of(a.cl, {"--mode", "fast"}) ==
          "--mode needs one of latency, batch, both, not 'fast'");
  }

  TEST_CASE("numbers are read whole, in range, and finite") {
    for (const char* bad : {"abc", "12abc", "", " 12", "1.5", "0x10", "-1"}) {
      every_kind a;
      CHECK(error_of(a.cl, {"--iters", bad}) ==
            std::string("--iters needs an integer >= 0, not '") + bad + "'");
    }
    every_kind a;
    CHECK(error_of(a.cl, {"--iters", "99999999999"}) ==
          "--iters needs an integer >= 0, not '99999999999'");
    CHECK(error_of(a.cl, {"--limit", "-1"}) == "--limit needs an integer, not '-1'");
    CHECK(error_of(a.cl, {"--limit", "18446744073709551616"}) ==
          "--limit needs an integer, not '18446744073709551616'");
    CHECK(error_of(a.cl, {"--seconds", "-0.5"}) == "--seconds needs a number >= 0, not '-0.5'");
    CHECK(error_of(a.cl, {"--seconds", "inf"}) == "--seconds needs a number >= 0, not 'inf'");
    CHECK(error_of(a.cl, {"--seconds", "nan"}) == "--seconds needs a number >= 0, not 'nan'");
    CHECK(error_of(a.cl, {"--seconds", "5s"}) == "--seconds needs a number >= 0, not '5s'");
    CHECK(error_of(a.cl, {"--lr", "1e300"}) == "--lr needs a number, not '1e300'");  // past float
    for (const char* bad : {"4X", "K", "-4K", "1.5M", "17179869184G"})
      CHECK(error_of(a.cl, {"--max-bytes", bad}) ==
            std::string("--max-bytes needs a size (8, 4K, 64M, 1G), not '") + bad + "'");
    int port = 0;
    command_line ranged("prog");
    ranged.option("port", port, "PORT", "").at_least(1).at_most(65535);
    CHECK(error_of(ranged, {"--port", "65536"}) ==
          "--port needs an integer from 1 to 65535, not '65536'");
    CHECK(parse(ranged, {"--port", "65535"}));
    CHECK(port == 65535);
  }

  TEST_CASE("positional arguments, anywhere, and after --") {
    std::string program;
    int world = 0;
    std::vector<std::string> rest;
    command_line cl("tutorial");
    cl.argument("PROGRAM", program, "what to run").one_of({"ring", "group"});
    cl.option("world", world, "N", "ranks");
    cl.arguments("FILE", rest, "more");
    CHECK(parse(cl, {"--world", "3", "ring", "a", "--", "-b", "--world"}));
    CHECK(program == "ring");
    CHECK(world == 3);
    CHECK(rest == std::vector<std::string>{"a", "-b", "--world"});
    CHECK(cl.given("PROGRAM"));

    command_line after("tutorial");
    std::string p;
    after.argument("PROGRAM", p, "").one_of({"ring", "group"});
    after.option("world", world, "N", "ranks");
    CHECK(parse(after, {"group", "--world", "4"}));  // options after the argument
    CHECK(p == "group");
    CHECK(world == 4);
    CHECK(error_of(after, {"--world", "2"}) == "missing PROGRAM (one of ring, group)");
    CHECK(error_of(after, {"tree"}) == "PROGRAM needs one of ring, group, not 'tree'");
    CHECK(error_of(after, {"ring", "extra"}) == "unexpected argument 'extra'");

    std::size_t max_bytes = 1;
    int iterations = 200;
    command_line optional("store_bench");
    optional.argument("MAX_BYTES", max_bytes, "").optional();
    optional.argument("ITERATIONS", iterations, "").optional().at_least(1);
    CHECK(parse(optional, {}));
    CHECK(iterations == 200);
    CHECK(parse(optional, {"64", "10"}));
    CHECK(max_bytes == 64);
    CHECK(iterations == 10);
    CHECK(error_of(optional, {"64", "0"}) == "ITERATIONS needs an integer >= 1, not '0'");
    CHECK(error_of(optional, {"-"}) == "MAX_BYTES needs an integer, not '-'");
  }

  TEST_CASE("stop_at_first_argument: the program and all after it, options too") {
    int n = 1;
    bool prefix = true;
    std::vector<std::string> command;
    command_line cl("dcomm-run");
    cl.stop_at_first_argument();
    cl.option("n,nproc-per-node,nproc_per_node", n, "N", "ranks").at_least(1);
    cl.flag("no-prefix", prefix, "", false);
    cl.arguments("PROGRAM", command, "").required();
    CHECK(parse(cl, {"-n2", "--no-prefix", "/bin/echo", "-n", "--help", "--", "x"}));
    CHECK(n == 2);
    CHECK_FALSE(prefix);
    CHECK(command == std::vector<std::string>{"/bin/echo", "-n", "--help", "--", "x"});
    command.clear();
    CHECK(parse(cl, {"--nproc_per_node=3", "--", "-weird-name", "-n"}));
    CHECK(n == 3);
    CHECK(command == std::vector<std::string>{"-weird-name", "-n"});
    command.clear();
    CHECK(parse(cl, {"--nproc", "4", "prog"}));  // a prefix of both spellings: one option
    CHECK(n == 4);
    CHECK(error_of(cl, {"-n", "2"}) == "missing PROGRAM");
    CHECK(error_of(cl, {"-n", "0", "prog"}) == "--nproc-per-node needs an integer >= 1, not '0'");
  }

  TEST_CASE("--help: false from try_parse, before any later error; the table") {
    every_kind a;
    CHECK_FALSE(parse(a.cl, {"--help", "--bogus"}));
    CHECK_FALSE(parse(a.cl, {"-vh"}));
    CHECK_FALSE(parse(a.cl, {"--he"}));
    CHECK(error_of(a.cl, {"--bogus", "--help"}) == "unknown option --bogus");

    int n = 1;
    double grace = 5;
    bool prefix = true;
    std::vector<std::string> command;
    command_line cl("dcomm-run", "Starts the ranks of a job.");
    cl.option("n,nproc-per-node,nproc_per_node", n, "N", "ranks on this node; 1");
    cl.option("grace", grace, "SECONDS",
              "how long stopped ranks get before SIGKILL, and some more words to wrap the line "
              "at eighty columns; 5");
    cl.flag("no-prefix", prefix, "leave the ranks' output alone\n(no \"[rank] \")", false);
    cl.option("a-very-long-option-name", n, "VALUE", "its help on a line of its own");
    cl.arguments("PROGRAM", command, "what each rank runs").required();
    cl.epilog("Usage errors exit with 2.");
    CHECK(cl.help() ==
          "usage: dcomm-run [OPTIONS] PROGRAM...\n"
          "\n"
          "Starts the ranks of a job.\n"
          "\n"
          "  -n, --nproc-per-node N      ranks on this node; 1\n"
          "      --grace SECONDS         how long stopped ranks get before SIGKILL, and\n"
          "                              some more words to wrap the line at eighty\n"
          "                              columns; 5\n"
          "      --no-prefix             leave the ranks' output alone\n"
          "                              (no \"[rank] \")\n"
          "      --a-very-long-option-name VALUE\n"
          "                              its help on a line of its own\n"
          "  PROGRAM                     what each rank runs\n"
          "  -h, --help                  this text\n"
          "\n"
          "Usage errors exit with 2.\n");
    command_line named("tutorial");
    std::string program;
    named.argument("PROGRAM", program, "").one_of({"ring", "group"}).optional();
    named.synopsis("PROGRAM [--world N]");
    CHECK(named.help() ==
          "usage: tutorial PROGRAM [--world N]\n"
          "\n"
          "  PROGRAM      one of ring, group\n"
          "  -h, --help   this text\n");
  }

  TEST_CASE("--help wraps the about text and the epilog at 79 columns") {
    command_line cl("prog",
                    "One sentence long enough to need a second line when it is printed in a "
                    "terminal of eighty columns.\nA line of its own.");
    cl.epilog("Usage errors exit with 2.\n");
    CHECK(cl.help() ==
          "usage: prog [OPTIONS]\n"
          "\n"
          "One sentence long enough to need a second line when it is printed in a terminal\n"
          "of eighty columns.\n"
          "A line of its own.\n"
          "\n"
          "  -h, --help   this text\n"
          "\n"
          "Usage errors exit with 2.\n");
  }

  TEST_CASE("read and read_bytes, for values from elsewhere") {
    CHECK(command_line::read<int>("42", 1) == 42);
    CHECK(command_line::read<double>("2.5") == 2.5);
    CHECK(command_line::read<std::string>("x") == "x");
    CHECK_THROWS_WITH_AS(command_line::read<int>("0", 1), "needs an integer >= 1, not '0'",
                         usage_error);
    CHECK(command_line::read_bytes("3k") == 3072);
    CHECK(command_line::read_bytes("16G") == std::uint64_t{16} << 30);
    CHECK_FALSE(command_line::read_bytes("16T"));
    CHECK_FALSE(command_line::read_bytes(""));
  }

  TEST_CASE("parse() says what is wrong and exits with 2; --help exits with 0") {
    auto run = [](std::initializer_list<const char*> args, std::string& out) {
      int pipe_fds[2];
      REQUIRE(::pipe(pipe_fds) == 0);
      std::fflush(nullptr);  // else the child writes out what the parent had buffered
      const pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        ::dup2(pipe_fds[1], 1);
        ::dup2(pipe_fds[1], 2);
        int iters = 0;
        command_line cl("bench");
        cl.option("iters", iters, "N", "timed calls");
        std::vector<const char*> argv{"bench"};
        argv.insert(argv.end(), args.begin(), args.end());
        cl.parse(static_cast<int>(argv.size()), argv.data());
        std::printf("iters %d\n", iters);
        std::fflush(stdout);
        ::_exit(0);
      }
      ::close(pipe_fds[1]);
      char buffer[4096];
      for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;)
        out.append(buffer, static_cast<std::size_t>(n));
      ::close(pipe_fds[0]);
      int status = 0;
      REQUIRE(::waitpid(pid, &status, 0) == pid);
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    };
    std::string out;
    CHECK(run({"--iters", "abc"}, out) == 2);
    CHECK(out == "bench: --iters needs an integer, not 'abc'\n(bench --help lists the options)\n");
    out.clear();
    CHECK(run({"--help"}, out) == 0);
    CHECK(out ==
          "usage: bench [OPTIONS]\n\n      --iters N   timed calls\n  -h, --help      this text\n");
    out.clear();
    CHECK(run({"--iters", "3"}, out) == 0);
    CHECK(out == "iters 3\n");
  }
}
