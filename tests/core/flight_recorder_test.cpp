// The flight recorder (dcomm/trace/flight_recorder.hpp): what a rank's
// operations leave in it, the dump's format, the dump a timeout writes to
// DCOMM_TRACE_DIR, the ring going round, and copies taken while operations
// are being recorded.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/log.hpp"
#include "dcomm/thread_world.hpp"
#include "dcomm/trace/flight_recorder.hpp"
#include "dcomm/trace/op_stats.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::require;
using dcomm::trace::op_phase;

namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The dump parses as JSON (Python's parser: meson's own interpreter) and
// holds what `check` (a Python expression over `d`) says.
bool json_holds(const std::filesystem::path& p, const std::string& check) {
  const auto script = p.string() + ".check.py";
  std::ofstream(script) << "import json, sys\nd = json.load(open(sys.argv[1]))\n"
                        << "sys.exit(0 if (" << check << ") else 1)\n";
  const std::string cmd = "python3 '" + script + "' '" + p.string() + "'";
  return std::system(cmd.c_str()) == 0;
}

struct temporary_dir {
  std::filesystem::path path;
  temporary_dir() {
    path = std::filesystem::temp_directory_path() /
           ("dcomm-trace-test-" + std::to_string(::getpid()) + "-" +
            std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(path);
  }
  ~temporary_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// A temporary directory that DCOMM_TRACE_DIR names while it exists (unset
// again even when the test fails).
struct trace_dir : temporary_dir {
  trace_dir() { ::setenv("DCOMM_TRACE_DIR", path.c_str(), 1); }
  ~trace_dir() { ::unsetenv("DCOMM_TRACE_DIR"); }
};

// DCOMM_TRACE set to `value` while it exists.
struct timeline_variable {
  explicit timeline_variable(const std::string& value) {
    ::setenv("DCOMM_TRACE", value.c_str(), 1);
  }
  ~timeline_variable() { ::unsetenv("DCOMM_TRACE"); }
};

// all_reduce (float32 x 3), broadcast (int64 x 5 from rank 1), barrier, and
// a send from rank 0 to rank 1 (float64 x 4, tag 7): collectives #0-#2.
asio::awaitable<void> four_calls(comm& c) {
  std::vector<float> v{1.0f, 2.0f, 3.0f};
  co_await c.all_reduce(v, dcomm::sum);
  std::vector<std::int64_t> b(5, c.rank());
  co_await c.broadcast(b, 1);
  co_await c.barrier();
  std::vector<double> m(4, 1.0);
  if (c.rank() == 0)
    co_await c.send(m, 1, 7);
  else
    co_await c.recv(m, 0, 7);
}

}  // namespace

TEST_SUITE("flight recorder") {
  TEST_CASE("every operation is recorded: its group, number, shape and end") {
    DCOMM_TEST_DEADLINE(60s);
    temporary_dir dir;
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [&dir](comm& c) -> asio::awaitable<void> {
          co_await four_calls(c);
          std::vector<float> v{1.0f, 2.0f, 3.0f};
          auto pair = co_await c.split(0, c.rank());
          require(pair.has_value(), "split made no group");
          co_await pair->all_reduce(v, dcomm::max);

          const auto ops = c.trace_records();
          // all_reduce, broadcast, barrier, send or recv, split (its own
          // collectives inside are the backend's), the group's all_reduce.
          require(ops.size() >= 6, "fewer records than operations");
          const auto& ar = ops[0];
          require(std::string(ar.operation) == "all_reduce" && ar.brief.collective &&
                      ar.brief.type == dcomm::dtype::float32 && ar.brief.count == 3 &&
                      ar.brief.peer == -1 && ar.seq == 0 && ar.phase == op_phase::done,
                  "the all_reduce's record");
          require(ar.queued_ns > 0 && ar.ended_ns >= ar.queued_ns, "the all_reduce's times");
          const auto& bc = ops[1];
          require(std::string(bc.operation) == "broadcast" && bc.brief.peer == 1 &&
                      bc.brief.type == dcomm::dtype::int64 && bc.brief.count == 5 && bc.seq == 1,
                  "the broadcast's record");
          require(std::string(ops[2].operation) == "barrier" && ops[2].seq == 2,
                  "the barrier's record");
          const auto& p2p = ops[3];
          require(std::string(p2p.operation) == (c.rank() == 0 ? "send" : "recv") &&
                      !p2p.brief.collective && p2p.seq == 7 && p2p.brief.peer == 1 - c.rank() &&
                      p2p.brief.type == dcomm::dtype::float64 && p2p.brief.count == 4,
                  "the send's or recv's record");
          const auto& last = ops.back();
          require(std::string(last.operation) == "all_reduce" && last.seq == 0 &&
                      last.group != ar.group && last.phase == op_phase::done,
                  "the group's all_reduce: its own group and numbers");
          for (const auto& r : ops) require(r.phase == op_phase::done, "an operation not done");

          // The dump on demand parses, and says the same.
          const auto path = dir.path / ("rank" + std::to_string(c.rank()) + ".json");
          c.dump_trace(path.string());
          require(
              json_holds(path, "d['format']=='dcomm-flight-recorder/1' and d['rank']==" +
                                   std::to_string(c.rank()) +
                                   " and d['world_size']==2 and d['ops'][0]['op']=='all_reduce'"
                                   " and d['ops'][0]['count']==3 and d['ops'][0]['state']=='done'"
                                   " and d['ops'][1]['peer']==1 and d['ops'][1]['seq']==1"
                                   " and [o['seq'] for o in d['ops'][:3]]==[0,1,2]"
                                   " and any(g['name']=='the world group' and g['ranks']==[0, 1]"
                                   " for g in d['groups'])"
                                   " and len(d['groups'])==2"),
              "the dump: " + read_file(path));
        },
        o);
  }

  TEST_CASE("a timeout writes the dump to DCOMM_TRACE_DIR, naming the call that failed") {
    DCOMM_TEST_DEADLINE(60s);
    trace_dir dir;
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          std::vector<float> v{1.0f};
          co_await c.all_reduce(v, dcomm::sum);
          // Rank 1 never calls the second all_reduce: rank 0's times out
          // (rank 1 stays until then, making no call).
          if (c.rank() == 0) {
            auto [code, what] = co_await dcomm::test::failure_of(
                [&] { return c.with({.timeout = 500ms}).all_reduce(v, dcomm::sum); });
            require(code == dcomm::errc::timeout, "no timeout: " + what);
          } else {
            asio::steady_timer pause(co_await asio::this_coro::executor, 1500ms);
            co_await pause.async_wait(asio::use_awaitable);
          }
        },
        o);
    const auto path = dir.path / "dcomm-trace-rank0.json";
    REQUIRE(std::filesystem::exists(path));
    CHECK(json_holds(path,
                     "d['rank']==0 and 'timed out' in d['reason']"
                     " and [(o['op'],o['seq'],o['state']) for o in d['ops'][:2]]=="
                     "[('all_reduce',0,'done'),('all_reduce',1,'failed')]"
                     " and d['ops'][1]['error']=='timed out'"));
    CHECK_FALSE(std::filesystem::exists(dir.path / "dcomm-trace-rank1.json"));
  }

  TEST_CASE("SIGUSR1 writes every rank's dump to DCOMM_TRACE_DIR, while the calls go on") {
    DCOMM_TEST_DEADLINE(60s);
    trace_dir dir;
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [&dir](comm& c) -> asio::awaitable<void> {
          std::vector<float> v{1.0f};
          co_await c.all_reduce(v, dcomm::sum);
          co_await c.barrier();
          if (c.rank() == 0) ::raise(SIGUSR1);
          // Both ranks' files appear (each rank's executor writes its own).
          const auto mine = dir.path / ("dcomm-trace-rank" + std::to_string(c.rank()) + ".json");
          const auto until = std::chrono::steady_clock::now() + 20s;
          while (!std::filesystem::exists(mine)) {
            require(std::chrono::steady_clock::now() < until, "no dump after SIGUSR1");
            asio::steady_timer pause(co_await asio::this_coro::executor, 10ms);
            co_await pause.async_wait(asio::use_awaitable);
          }
          co_await c.barrier();
          require(json_holds(mine,
                             "d['reason']=='SIGUSR1' and [o['op'] for o in d['ops'][:2]]=="
                             "['all_reduce','barrier']"),
                  "the signal's dump: " + read_file(mine));
        },
        o);
  }

  // Issue 41: dcomm-run asks every rank still running for its dump
  // (SIGUSR1), one that failed and dumped already too: the failure's dump,
  // whose reason located the culprit, stays.
  TEST_CASE("SIGUSR1 after a failure's dump: the failure's stays, SIGUSR1's goes beside it") {
    DCOMM_TEST_DEADLINE(60s);
    trace_dir dir;
    const auto failure = dir.path / "dcomm-trace-rank0.json";
    const auto later = dir.path / "dcomm-trace-rank0-later.json";
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [&](comm& c) -> asio::awaitable<void> {
          std::vector<float> v{1.0f};
          co_await c.all_reduce(v, dcomm::sum);
          if (c.rank() == 1) {  // makes no second call; stays until rank 0 is done
            asio::steady_timer pause(co_await asio::this_coro::executor, 1500ms);
            co_await pause.async_wait(asio::use_awaitable);
            co_return;
          }
          auto [code, what] = co_await dcomm::test::failure_of(
              [&] { return c.with({.timeout = 500ms}).all_reduce(v, dcomm::sum); });
          require(code == dcomm::errc::timeout, "no timeout: " + what);
          require(std::filesystem::exists(failure), "no dump of the failure");
          ::raise(SIGUSR1);
          const auto until = std::chrono::steady_clock::now() + 5s;
          while (!std::filesystem::exists(later)) {
            require(std::chrono::steady_clock::now() < until,
                    "no dump beside the failure's after SIGUSR1; the failure's says: " +
                        read_file(failure));
            asio::steady_timer pause(co_await asio::this_coro::executor, 10ms);
            co_await pause.async_wait(asio::use_awaitable);
          }
        },
        o);
    CHECK(json_holds(failure, "'timed out' in d['reason'] and 'peers rank 1' in d['reason']"));
    CHECK(json_holds(later,
                     "d['reason']=='SIGUSR1' and [(o['op'],o['seq'],o['state']) for o in "
                     "d['ops'][:2]]==[('all_reduce',0,'done'),('all_reduce',1,'failed')]"));
  }

  TEST_CASE("DCOMM_TRACE: each rank's calls as Chrome trace events, one per call, in order") {
    DCOMM_TEST_DEADLINE(60s);
    temporary_dir dir;
    timeline_variable on((dir.path / "job.json").string());
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          co_await four_calls(c);
          std::vector<float> v{1.0f, 2.0f, 3.0f};
          auto single = co_await c.split(c.rank(), 0);  // a group of one each
          require(single.has_value(), "split made no group");
          co_await single->all_reduce(v, dcomm::max);
          // A call that fails is on the timeline too.
          std::vector<float> bad(c.rank() == 0 ? 1 : 2);
          auto [code, what] =
              co_await dcomm::test::failure_of([&] { return c.all_reduce(bad, dcomm::sum); });
          require(code == dcomm::errc::mismatch, "no mismatch: " + what);
          // On the timeline every call is timed for the statistics too.
          for (const auto& s : c.stats().operations)
            require(s.timed == s.calls, "a call on the timeline not timed: " + s.operation);
        },
        o);
    for (int rank = 0; rank < 2; ++rank) {
      const auto path = dir.path / ("job-rank" + std::to_string(rank) + ".json");
      INFO("rank ", rank, ": ", read_file(path));
      REQUIRE(std::filesystem::exists(path));
      const std::string r = std::to_string(rank);
      CHECK(json_holds(
          path,
          "[(e['name'],e['args']['seq'],e['cat'],e['args']['state']) for e in d if e['ph']=='X']=="
          "[('all_reduce',0,'collective','done'),('broadcast',1,'collective','done'),"
          "('barrier',2,'collective','done'),"
          "('" +
              std::string(rank == 0 ? "send" : "recv") +
              "',7,'point_to_point','done'),"
              "('split',3,'collective','done'),('all_reduce',0,'collective','done'),"
              "('all_reduce',4,'collective','failed')]"
              " and all(e['pid']==" +
              r +
              " and e['dur']>=0 and e['ts']>0 for e in d if e['ph']=='X')"
              " and [e['args']['bytes'] for e in d if e['ph']=='X'][:2]==[12,40]"
              " and [e for e in d if e['ph']=='X'][1]['args']['peer']==1"
              " and [e for e in d if e['ph']=='X'][5]['args']['group']!='0x0'"
              " and {e['args']['name'] for e in d if e['name']=='thread_name'}>="
              "{'the world group','the world group: send/recv'}"
              " and [e['args']['name'] for e in d if e['name']=='process_name']==['rank " +
              r +
              "']"
              " and [e for e in d if e['name']=='dcomm_clock'][0]['args']['steady_ns']>0"));
    }
  }

  TEST_CASE("DCOMM_TRACE naming a file that cannot be written: init says so") {
    DCOMM_TEST_DEADLINE(60s);
    timeline_variable on("/nonexistent-dcomm-folder/job.json");
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    try {
      dcomm::run_thread_world<dcomm::cpu_backend>(
          1, [](comm&) -> asio::awaitable<void> { co_return; }, o);
      FAIL("the world started");
    } catch (const dcomm::error& e) {
      // The thread world reports its rank's error (a system_error) as rank_failed.
      CHECK(e.code() == dcomm::errc::rank_failed);
      CHECK(contains(e.what(),
                     "system call failed in DCOMM_TRACE (rank 0): cannot write the "
                     "timeline to /nonexistent-dcomm-folder/job-rank0.json"));
    }
  }

  TEST_CASE("stats(): calls, failures and bytes of every operation; one call in 16 timed") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          std::vector<float> v{1.0f, 2.0f, 3.0f};
          for (int i = 0; i < 40; ++i) co_await c.all_reduce(v, dcomm::sum);
          for (int i = 0; i < 5; ++i) co_await c.barrier();
          std::vector<double> m(4, 1.0);
          for (int i = 0; i < 3; ++i) {
            if (c.rank() == 0)
              co_await c.send(m, 1, i);
            else
              co_await c.recv(m, 0, i);
          }
          std::vector<float> bad(c.rank() == 0 ? 1 : 2);
          auto [code, what] =
              co_await dcomm::test::failure_of([&] { return c.all_reduce(bad, dcomm::sum); });
          require(code == dcomm::errc::mismatch, "no mismatch: " + what);

          const auto all = c.stats();
          const auto& stats = all.operations;
          const auto of = [&](const std::string& op) {
            const auto* s = all.operation(op);
            if (!s) throw std::runtime_error("no figures for " + op);
            return *s;
          };
          const auto ar = of("all_reduce");
          require(ar.calls == 41 && ar.failed == 1, "all_reduce's calls and failures");
          require(ar.bytes == 40 * 12 + bad.size() * 4, "all_reduce's bytes");
          const auto br = of("barrier");
          require(br.calls == 5 && br.failed == 0 && br.bytes == 0, "barrier's figures");
          const auto p2p = of(c.rank() == 0 ? "send" : "recv");
          require(p2p.calls == 3 && p2p.bytes == 3 * 32, "send's or recv's figures");
          std::uint64_t calls = 0, timed = 0;
          for (const auto& s : stats) {
            calls += s.calls;
            timed += s.timed;
            if (s.timed)
              require(s.mean_us > 0 && s.p50_us > 0 && s.p50_us <= s.p90_us &&
                          s.p90_us <= s.p99_us && s.p99_us <= s.max_us,
                      "the quantiles of " + s.operation);
          }
          require(timed == calls / 16, "not one call in 16 timed");
        },
        o);
  }

  TEST_CASE(
      "DCOMM_LOG_LEVEL: info says how each rank started, debug each call; a sink takes them") {
    DCOMM_TEST_DEADLINE(60s);
    std::mutex m;
    std::vector<std::pair<dcomm::log_level, std::string>> lines;
    const dcomm::log_level before = dcomm::get_log_level();
    dcomm::set_log_level(dcomm::log_level::debug);
    dcomm::set_log_sink([&](dcomm::log_level level, std::string_view line) {
      std::lock_guard lock(m);
      lines.emplace_back(level, std::string(line));
    });
    struct restore {
      dcomm::log_level level;
      ~restore() {
        dcomm::set_log_sink({});
        dcomm::set_log_level(level);
      }
    } after{before};
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          std::vector<float> v{1.0f, 2.0f, 3.0f};
          co_await c.all_reduce(v, dcomm::sum);
        },
        o);
    auto said = [&](dcomm::log_level level, const std::string& part) {
      std::lock_guard lock(m);
      for (const auto& [l, text] : lines)
        if (l == level && contains(text, part)) return true;
      return false;
    };
    using dcomm::log_level;
    CHECK(said(log_level::info, "rank 1 of 2 (pid "));
    CHECK(said(log_level::info, "backend cpu: reached at 127.0.0.1; links:"));
    CHECK(said(log_level::info, "links: shared memory to ranks {0}, tcp to none"));
    CHECK(said(log_level::info, "eager limit 65536 B"));
    // The algorithm table in force (cpu/algorithms/dispatch.hpp).
    CHECK(said(log_level::info, "; algorithms: barrier dissemination; "));
    CHECK(said(log_level::info, "all_reduce recursive_doubling up to 65536 B"));
    CHECK(
        said(log_level::debug, "rank 0: all_reduce #0 of group 0x0, float32 x 3 (12 B): done in "));
    CHECK(said(log_level::debug, "over shm (shared_memory); rank "));
    std::lock_guard lock(m);
    INFO(lines.size(), " lines, the first: ", lines.empty() ? "" : lines.front().second);
  }

  TEST_CASE("stats' histogram: buckets a quarter of a power of two wide; quantiles from them") {
    using dcomm::trace::op_stats;
    for (std::uint64_t ns :
         {0ull, 1ull, 3ull, 4ull, 5ull, 7ull, 8ull, 9ull, 1000ull, 123456ull, 1000000000ull}) {
      const auto b = op_stats::bucket_of(ns);
      CHECK(static_cast<double>(ns) < op_stats::bucket_top(b));
      if (b > 0) CHECK(static_cast<double>(ns) >= op_stats::bucket_top(b - 1));
      if (ns >= 4) CHECK(op_stats::bucket_top(b) <= 1.25 * static_cast<double>(ns) + 1);
    }
    op_stats s;
    static const char* const op = "all_reduce";
    for (int i = 0; i < 990; ++i) s.ended(op, 4, false, 1000);
    for (int i = 0; i < 10; ++i) s.ended(op, 4, false, 100000);
    s.ended(op, 4, true, -1);  // not timed
    const auto r = s.summary();
    REQUIRE(r.size() == 1);
    CHECK(r[0].calls == 1001);
    CHECK(r[0].failed == 1);
    CHECK(r[0].bytes == 4004);
    CHECK(r[0].timed == 1000);
    CHECK(r[0].mean_us == doctest::Approx(1.99));
    CHECK(r[0].p50_us >= 1.0);
    CHECK(r[0].p50_us <= 1.25);
    CHECK(r[0].p99_us <= 1.25);
    CHECK(r[0].max_us == doctest::Approx(100.0));
  }

  TEST_CASE("the ring keeps the last operations; capacity rounds up to a power of two") {
    dcomm::trace::flight_recorder r(3);
    CHECK(r.capacity() == 4);
    for (std::uint64_t i = 0; i < 10; ++i) {
      const auto id = r.queued(1, i, "barrier", {}, dcomm::algorithm::automatic, 100);
      r.started(id);
      if (i != 9) r.ended(id, i == 8, i == 8 ? static_cast<int>(dcomm::errc::peer_lost) : 0, 50);
    }
    const auto ops = r.snapshot();
    REQUIRE(ops.size() == 4);
    CHECK(ops.front().seq == 6);
    CHECK(ops.back().seq == 9);
    CHECK(ops[2].phase == op_phase::failed);
    CHECK(ops[2].error == static_cast<int>(dcomm::errc::peer_lost));
    CHECK(ops[2].ended_ns == 100);  // never before it was queued
    CHECK(ops[3].phase == op_phase::started);
    CHECK(ops[3].ended_ns == 0);
    CHECK(contains(r.dump_json(0, 1, "why \"quoted\""), R"("reason": "why \"quoted\"")"));
    // DCOMM_TRACE_BUFFER=0: nothing recorded (what the bench compares with).
    dcomm::trace::flight_recorder off(0);
    CHECK(off.capacity() == 0);
    const auto none = off.queued(1, 0, "barrier", {}, dcomm::algorithm::automatic, 100);
    off.ended(none, false, 0, 200);
    CHECK(off.snapshot().empty());
  }

  TEST_CASE("a copy taken while operations are recorded holds only whole records") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::trace::flight_recorder r(1024);
    std::atomic<bool> stop{false};
    std::thread writer([&] {
      for (std::uint64_t i = 1; !stop.load(std::memory_order_relaxed); ++i) {
        dcomm::trace::op_brief b{.collective = true, .count = i * 3, .peer = 1};
        const auto id = r.queued(i, i * 5, "all_reduce", b, dcomm::algorithm::ring,
                                 static_cast<std::int64_t>(i));
        r.ended(id, false, 0, static_cast<std::int64_t>(i));
        std::this_thread::yield();  // slow enough for a copy to see whole records
      }
    });
    std::size_t seen = 0;
    // Until the writer has gone round the ring many times (it starts late).
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (seen < 100000 && std::chrono::steady_clock::now() < until) {
      for (const auto& op : r.snapshot()) {
        const std::uint64_t i = op.group;
        if (op.seq != i * 5 || op.brief.count != i * 3 ||
            op.queued_ns != static_cast<std::int64_t>(i) ||
            op.algorithm != dcomm::algorithm::ring) {
          stop = true;
          writer.join();
          FAIL("a mixed record: group " << i << ", seq " << op.seq << ", count " << op.brief.count);
        }
        ++seen;
      }
    }
    stop = true;
    writer.join();
    CHECK(seen > 0);
  }
}
