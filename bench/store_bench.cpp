// Store round trips over loopback, in nccl-tests style rows: one tcp_store
// server and one client in this process, the client on its own thread.
//
//   store_bench [max_bytes] [iterations]
//
// Rows: op, value bytes, median and p99 time per operation (us), algbw (GB/s
// of value bytes moved per operation). Compare with ../shared/anchors/run
// limits (TCP 8-byte round trip) measured in the same sitting.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dcomm/command_line.hpp>
#include <dcomm/store/tcp_store.hpp>
#include <string>
#include <vector>

namespace {

struct row {
  double median_us, p99_us;
};

template <typename F>
row measure(int iterations, F&& op) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    op(i);
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]};
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t max_bytes = std::size_t{1} << 20;
  int iterations = 200;
  dcomm::command_line cl("store_bench",
                         "Store round trips over loopback: a tcp_store server and a client in "
                         "this process.");
  cl.argument("MAX_BYTES", max_bytes, "the largest value set and read; 1048576").optional();
  cl.argument("ITERATIONS", iterations, "calls per row; 200").optional().at_least(1);
  cl.parse(argc, argv);
  dcomm::detail::io_thread server_thread;
  auto server =
      dcomm::tcp_store_server::start(server_thread.get_executor(), {.bind_host = "127.0.0.1"});
  auto client = dcomm::tcp_store::create({.host = "127.0.0.1", .port = server->port()});
  client->connect(dcomm::blocking);

  std::printf("# dcomm tcp_store over loopback, %d iterations per row\n", iterations);
  std::printf("# %-6s %12s %12s %12s %10s\n", "op", "bytes", "median_us", "p99_us", "algbw_GBs");
  auto print = [](const char* op, std::size_t bytes, row r) {
    std::printf("  %-6s %12zu %12.1f %12.1f %10.3f\n", op, bytes, r.median_us, r.p99_us,
                static_cast<double>(bytes) / (r.median_us * 1e3));
  };
  print("add", 8, measure(iterations, [&](int) { client->add("counter", 1, dcomm::blocking); }));
  for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 8) {
    std::string value(bytes, 'v');
    print("set", bytes,
          measure(iterations, [&](int) { client->set("k", value, dcomm::blocking); }));
    print("get", bytes, measure(iterations, [&](int) { client->get("k", dcomm::blocking); }));
  }
  return 0;
}
