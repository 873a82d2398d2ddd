// Remote calls (dcomm/rpc.hpp) between two ranks, beside the send/recv
// ping-pong they are built on. Rank 0 calls, rank 1 serves.
//
//   rpc_bench                          spawns 2 local ranks (env:// underneath)
//   dcomm-run -n 2 rpc_bench --launched
//   DCOMM_TRANSPORT=tcp rpc_bench      over loopback TCP instead of shared memory
//
// Rows (median of --iters timed calls, after --warmup):
//   ping-pong 8 B     send 8 bytes and receive them back (a round trip)
//   call ()->void     an empty remote call's round trip
//   call (i64)->i64   one 8-byte argument and result
//   call (vec) 64 KiB a 64 KiB argument echoed back
//   call (vec) 4 MiB  a 4 MiB float tensor echoed back (beside the payload)
//   in flight K       --in-flight calls kept going: calls per second
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dcomm/command_line.hpp>
#include <dcomm/dcomm.hpp>
#include <dcomm/rpc.hpp>
#include <dcomm/spawn.hpp>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct settings {
  int iters = 20000;
  int warmup = 1000;
  int in_flight = 64;
  bool launched = false;
};

using clock_type = std::chrono::steady_clock;
using comm_t = dcomm::communicator<dcomm::cpu_backend>;

double median_us(std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void row(const char* what, std::size_t bytes, double us, double per_second) {
  std::printf("%18s %10zu %12.2f %14.0f\n", what, bytes, us, per_second);
  std::fflush(stdout);
}

// Times `op` (a coroutine factory) `iters` times after `warmup` untimed runs.
template <class Op>
asio::awaitable<double> timed(const settings& s, Op op) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(s.iters));
  for (int i = 0; i < s.warmup + s.iters; ++i) {
    const auto t0 = clock_type::now();
    co_await op();
    if (i >= s.warmup)
      us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
  }
  co_return median_us(us);
}

asio::awaitable<void> bench(comm_t& comm, const settings& s) {
  const int me = comm.rank();
  // The ping-pong first, on the communicator itself.
  std::vector<std::uint8_t> ball(8);
  const double ping = co_await timed(s, [&]() -> asio::awaitable<void> {
    if (me == 0) {
      co_await comm.send(ball, 1);
      co_await comm.recv(ball, 1);
    } else {
      co_await comm.recv(ball, 0);
      co_await comm.send(ball, 0);
    }
  });
  dcomm::rpc::registry functions;
  functions.add("noop", [] {});
  functions.add("inc", [](std::int64_t x) { return x + 1; });
  functions.add("echo", [](std::vector<std::uint8_t> v) { return v; });
  functions.add("echo_f32", [](std::vector<float> v) { return v; });
  // Rank 1 waits in shutdown while rank 0 measures.
  auto rpc =
      co_await dcomm::rpc::start(comm, functions, {.shutdown_timeout = std::chrono::minutes(10)});
  if (me == 0) {
    std::printf("# rpc_bench: 2 ranks; median of %d calls; %s\n", s.iters,
                std::getenv("DCOMM_TRANSPORT") ? std::getenv("DCOMM_TRANSPORT") : "auto transport");
    std::printf("%18s %10s %12s %14s\n", "what", "bytes", "time (us)", "calls/s");
    row("ping-pong 8 B", 8, ping, 1e6 / ping);
    const double empty = co_await timed(s, [&] { return rpc.call(1, "noop"); });
    row("call ()->void", 0, empty, 1e6 / empty);
    std::int64_t x = 0;
    const double small = co_await timed(
        s, [&]() -> asio::awaitable<void> { x = co_await rpc.call<std::int64_t>(1, "inc", x); });
    row("call (i64)->i64", 8, small, 1e6 / small);
    const std::vector<std::uint8_t> block(64 * 1024, 7);
    settings fewer = s;
    fewer.iters = std::max(1, s.iters / 10);
    fewer.warmup = std::max(1, s.warmup / 10);
    const double large = co_await timed(fewer, [&]() -> asio::awaitable<void> {
      auto back = co_await rpc.call<std::vector<std::uint8_t>>(1, "echo", block);
      if (back.size() != block.size()) throw std::runtime_error("echo: wrong size");
    });
    row("call (vec) 64 KiB", block.size(), large, 1e6 / large);
    // A tensor: sent from the vector, received into the handler's (and back).
    const std::vector<float> tensor(1 << 20, 1.0f);
    fewer.iters = std::max(1, s.iters / 100);
    fewer.warmup = std::max(1, s.warmup / 100);
    const double huge = co_await timed(fewer, [&]() -> asio::awaitable<void> {
      auto back = co_await rpc.call<std::vector<float>>(1, "echo_f32", tensor);
      if (back.size() != tensor.size()) throw std::runtime_error("echo_f32: wrong size");
    });
    row("call (vec) 4 MiB", tensor.size() * sizeof(float), huge, 1e6 / huge);
    // Throughput: keep in_flight calls going until iters have completed.
    auto ex = co_await asio::this_coro::executor;
    int started = 0, done = 0, failed = 0;
    const auto t0 = clock_type::now();
    std::function<void()> launch = [&] {
      ++started;
      asio::co_spawn(ex, rpc.call<std::int64_t>(1, "inc", std::int64_t{started}),
                     [&](std::exception_ptr e, std::int64_t) {
                       ++done;
                       if (e) ++failed;
                       if (started < s.iters) launch();
                     });
    };
    for (int i = 0; i < std::min(s.in_flight, s.iters); ++i) launch();
    asio::steady_timer wait(ex);
    while (done < s.iters) {
      wait.expires_after(std::chrono::microseconds(200));
      co_await wait.async_wait(asio::use_awaitable);
    }
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    const std::string what = "in flight " + std::to_string(s.in_flight);
    row(what.c_str(), 8, seconds * 1e6 / s.iters, s.iters / seconds);
    if (failed) std::printf("# %d calls failed\n", failed);
  }
  co_await rpc.shutdown();
}

int run_rank(const settings& s) {
  asio::io_context context;
  dcomm::init_options<dcomm::cpu_backend> o{.init_method = "env://"};
  dcomm::sync_wait(context, [&]() -> asio::awaitable<void> {
    auto comm = co_await dcomm::init_process_group<dcomm::cpu_backend>(context.get_executor(), o);
    if (comm.size() != 2) throw std::invalid_argument("rpc_bench runs on 2 ranks");
    co_await bench(comm, s);
  }());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  dcomm::command_line cl(
      "rpc_bench",
      "Remote calls between two ranks, beside the send/recv ping-pong they are "
      "built on. Rank 0 calls, rank 1 serves; DCOMM_TRANSPORT=tcp: over loopback "
      "TCP.");
  cl.option("iters", s.iters, "N", "timed calls per row; 20000").at_least(1);
  cl.option("warmup", s.warmup, "N", "untimed calls first; 1000").at_least(0);
  cl.option("in-flight", s.in_flight, "K", "calls kept going in the last row; 64").at_least(1);
  cl.flag("launched", s.launched, "one rank of a job dcomm-run started (else: spawns 2 ranks)");
  cl.parse(argc, argv);
  try {
    if (s.launched) return run_rank(s);
    dcomm::spawn(2, [&](int) { return run_rank(s); });
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_bench: %s\n", e.what());
    return 1;
  }
}
