// The NCCL backend against raw NCCL calls on the same communicator, in
// nccl-tests style rows. Not a test: it times, it does not judge.
//
//   nccl_bench                         # a world of one on this GPU
//   nccl_bench --world 2               # spawns 2 local ranks (one GPU each)
//   dcomm-run -n 8 nccl_bench --op all_reduce
//
// Options: nccl_bench --help (the table is in parse()).
//
// latency: per size, three ways of doing the same float32 operation,
// interleaved call by call so that drift hits all three alike:
//   raw     ncclXxx on the backend's communicator and stream, then
//           cudaStreamSynchronize (what a program without dcomm does);
//   dcomm   co_await comm.xxx(...): completes when the GPU is done (a host
//           function posts the completion to the executor);
//   stream  co_await comm.xxx(..., {.stream = s}) then
//           cudaStreamSynchronize(s): the stream-ordered form.
// time: rank 0's median per call (us). overhead: dcomm - raw, in us and %.
// algbw and busbw (nccl-tests' factors) from the dcomm column. #wrong: the
// elements that differ from the computed expectation after an untimed
// dcomm call, summed over ranks.
//
// batch: nccl-tests' own method, where a call's time is that of `iters`
// calls issued back to back and waited for once, divided by `iters`: what a
// pipeline that does not wait on every call sees. raw: the NCCL calls, then
// one cudaStreamSynchronize; dcomm: every call started as a request
// (dcomm::as_request), then each awaited; stream: the stream-ordered calls,
// then one cudaStreamSynchronize. Five rounds, interleaved; the median.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dcomm/command_line.hpp>
#include <dcomm/communicator.hpp>
#include <dcomm/cuda.hpp>
#include <dcomm/init_process_group.hpp>
#include <dcomm/nccl.hpp>
#include <dcomm/spawn.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using comm_type = dcomm::communicator<dcomm::nccl_backend>;

const std::vector<std::string> all_ops = {"all_reduce", "broadcast", "reduce", "all_gather",
                                          "reduce_scatter"};

struct settings {
  std::vector<std::string> ops = all_ops;
  int world = 0;  // 0: from env://, or a world of one without it
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t factor = 2;
  int iters = 0;
  int warmup = 5;
  int spin_us = -1;  // -1: nccl_backend's default
  bool latency = true, batch = true;
};

// The options: one line each, in the table --help prints.
settings parse(int argc, char** argv) {
  settings s;
  std::string op = "all", mode = "both";
  dcomm::command_line cl("nccl_bench",
                         "The NCCL backend against raw NCCL calls on the same communicator, in "
                         "nccl-tests style rows.");
  std::vector<std::string> ops = all_ops;
  ops.push_back("all");
  cl.option("op", op, "NAME",
            "the operation (all_reduce broadcast reduce all_gather reduce_scatter), or all")
      .one_of(ops);
  cl.option("world", s.world, "N",
            "spawn N local ranks, a GPU each; 0: one rank of a launched job (env://), or a "
            "world of one without it")
      .at_least(0);
  cl.bytes("min-bytes", s.min_bytes, "B", "the first size: 8, 4K, 64M, 1G; 8");
  cl.bytes("max-bytes", s.max_bytes, "B", "the last size; 256M");
  cl.option("factor", s.factor, "F", "each size is F times the one before; 2").at_least(2);
  cl.option("iters", s.iters, "N",
            "timed calls per size; 0: 200 at small sizes, fewer as sizes grow, at least 10")
      .at_least(0);
  cl.option("warmup", s.warmup, "N", "untimed calls first; 5").at_least(0);
  cl.option("spin", s.spin_us, "US", "nccl_backend::options::spin, in microseconds").at_least(0);
  cl.option("mode", mode, "latency|batch|both", "which tables to print; both")
      .one_of({"latency", "batch", "both"});
  cl.parse(argc, argv);
  if (op != "all") s.ops = {op};
  s.latency = mode != "batch";
  s.batch = mode != "latency";
  return s;
}

float input_value(int rank, std::size_t i) {
  return static_cast<float>(rank + 1) + static_cast<float>(i % 5);
}

struct shape {
  std::size_t in_count, out_count;
  double bus_factor;
};

shape shape_of(const std::string& op, std::size_t bytes, int world) {
  const auto n = static_cast<std::size_t>(world);
  const std::size_t count = bytes / sizeof(float);
  const double spread = static_cast<double>(world - 1) / world;
  if (op == "all_reduce") return {count, count, 2 * spread};
  if (op == "broadcast" || op == "reduce") return {count, count, 1};
  const std::size_t block = count / n;
  if (op == "all_gather") return {block, block * n, spread};
  return {block * n, block, spread};  // reduce_scatter
}

void check(cudaError_t e, const char* what) {
  dcomm::cuda::check(e, what);
}

class runner {
 public:
  runner(comm_type comm, const settings& s, std::chrono::microseconds spin)
      : comm_(std::move(comm)), s_(s), spin_(spin) {
    check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  runner(const runner&) = delete;
  runner& operator=(const runner&) = delete;
  ~runner() { (void)cudaStreamDestroy(stream_); }

  // The expected output element i on this rank.
  float expected(const std::string& op, std::size_t i, std::size_t out_count) const {
    const int rank = comm_.rank(), world = comm_.size();
    auto sum = [&](std::size_t j) {
      float acc = 0;
      for (int r = 0; r < world; ++r) acc += input_value(r, j);
      return acc;
    };
    if (op == "all_reduce" || op == "reduce") return sum(i);
    if (op == "broadcast") return input_value(0, i);
    if (op == "all_gather") {
      const std::size_t block = out_count / static_cast<std::size_t>(world);
      return input_value(static_cast<int>(i / block), i % block);
    }
    return sum(static_cast<std::size_t>(rank) * out_count + i);  // reduce_scatter
  }

  asio::awaitable<void> dcomm_call(const std::string& op, dcomm::cuda::device_buffer<float>& in,
                                   dcomm::cuda::device_buffer<float>& out, dcomm::op_options o) {
    if (op == "all_reduce") co_await comm_.all_reduce(in, out, dcomm::sum, o);
    if (op == "broadcast") co_await comm_.broadcast(out, 0, o);
    if (op == "reduce") co_await comm_.reduce(in, out, 0, dcomm::sum, o);
    if (op == "all_gather") co_await comm_.all_gather(in, out, o);
    if (op == "reduce_scatter") co_await comm_.reduce_scatter(in, out, dcomm::sum, o);
  }

  // The same operation, started: the request completes when the GPU is done.
  dcomm::request start_call(const std::string& op, dcomm::cuda::device_buffer<float>& in,
                            dcomm::cuda::device_buffer<float>& out) {
    const dcomm::op_options o{};
    if (op == "all_reduce") return comm_.all_reduce(in, out, dcomm::sum, o, dcomm::as_request);
    if (op == "broadcast") return comm_.broadcast(out, 0, o, dcomm::as_request);
    if (op == "reduce") return comm_.reduce(in, out, 0, dcomm::sum, o, dcomm::as_request);
    if (op == "all_gather") return comm_.all_gather(in, out, o, dcomm::as_request);
    return comm_.reduce_scatter(in, out, dcomm::sum, o, dcomm::as_request);
  }

  // Enqueues the operation on stream_ with NCCL directly.
  void raw_enqueue(const std::string& op, dcomm::cuda::device_buffer<float>& in,
                   dcomm::cuda::device_buffer<float>& out) {
    ncclComm_t comm = comm_.backend().native_handle();
    ncclResult_t r = ncclSuccess;
    if (op == "all_reduce")
      r = ncclAllReduce(in.data(), out.data(), in.size(), ncclFloat32, ncclSum, comm, stream_);
    if (op == "broadcast")
      r = ncclBroadcast(out.data(), out.data(), out.size(), ncclFloat32, 0, comm, stream_);
    if (op == "reduce")
      r = ncclReduce(in.data(), out.data(), in.size(), ncclFloat32, ncclSum, 0, comm, stream_);
    if (op == "all_gather")
      r = ncclAllGather(in.data(), out.data(), in.size(), ncclFloat32, comm, stream_);
    if (op == "reduce_scatter")
      r = ncclReduceScatter(in.data(), out.data(), out.size(), ncclFloat32, ncclSum, comm, stream_);
    // The communicator is non-blocking: wait until NCCL has enqueued.
    ncclResult_t state = r;
    while (state == ncclInProgress) (void)ncclCommGetAsyncError(comm, &state);
    if (state != ncclSuccess)
      throw std::runtime_error(std::string("raw ") + op + ": " + ncclGetErrorString(state));
  }
  void raw_call(const std::string& op, dcomm::cuda::device_buffer<float>& in,
                dcomm::cuda::device_buffer<float>& out) {
    raw_enqueue(op, in, out);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  // One row: the inputs, an untimed call checked against the expectation,
  // then the timed calls of the mode.
  asio::awaitable<void> row(const std::string& op, std::size_t bytes, bool latency) {
    const int rank = comm_.rank(), world = comm_.size();
    const auto sh = shape_of(op, bytes, world);
    const int gpu = comm_.backend().device();
    dcomm::cuda::device_guard on(gpu);
    std::vector<float> host_in(sh.in_count);
    for (std::size_t i = 0; i < host_in.size(); ++i) host_in[i] = input_value(rank, i);
    std::vector<float> host_out(sh.out_count, op == "broadcast" && rank != 0 ? -1.0f : 0.0f);
    if (op == "broadcast" && rank == 0)
      for (std::size_t i = 0; i < host_out.size(); ++i) host_out[i] = input_value(0, i);
    dcomm::cuda::device_buffer<float> in(sh.in_count, gpu), out(sh.out_count, gpu);
    in.copy_from(host_in);
    out.copy_from(host_out);

    co_await dcomm_call(op, in, out, {});
    std::vector<float> result(sh.out_count);
    out.copy_to(result);
    std::int64_t wrong = 0;
    if (op != "reduce" || rank == 0)
      for (std::size_t i = 0; i < result.size(); ++i)
        wrong += result[i] != expected(op, i, sh.out_count);
    std::vector<std::int64_t> total{wrong};
    dcomm::cuda::device_buffer<std::int64_t> total_d(1, gpu);
    total_d.copy_from(total);
    co_await comm_.all_reduce(total_d, dcomm::sum);
    total_d.copy_to(total);

    const int iters =
        s_.iters > 0
            ? s_.iters
            : static_cast<int>(std::clamp<double>(4e9 / std::max<double>(bytes, 1), 10, 200));
    if (latency)
      co_await latency_row(op, sh, in, out, iters, total[0]);
    else
      co_await batch_row(op, sh, in, out, iters, total[0]);
  }

  asio::awaitable<void> latency_row(const std::string& op, const shape& sh,
                                    dcomm::cuda::device_buffer<float>& in,
                                    dcomm::cuda::device_buffer<float>& out, int iters,
                                    std::int64_t wrong) {
    const dcomm::op_options on_stream{.stream = stream_};
    for (int i = 0; i < s_.warmup; ++i) {
      raw_call(op, in, out);
      co_await dcomm_call(op, in, out, {});
      co_await dcomm_call(op, in, out, on_stream);
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    }
    std::vector<double> raw, awaited, ordered;
    auto micros = [](clock_type::time_point t0) {
      return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
    };
    for (int i = 0; i < iters; ++i) {
      auto t0 = clock_type::now();
      raw_call(op, in, out);
      raw.push_back(micros(t0));
      t0 = clock_type::now();
      co_await dcomm_call(op, in, out, {});
      awaited.push_back(micros(t0));
      t0 = clock_type::now();
      co_await dcomm_call(op, in, out, on_stream);
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      ordered.push_back(micros(t0));
    }
    auto median = [](std::vector<double>& v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    print_row(op, sh, median(raw), median(awaited), median(ordered), wrong);
  }

  // nccl-tests' way: `iters` calls back to back, one wait; five rounds.
  asio::awaitable<void> batch_row(const std::string& op, const shape& sh,
                                  dcomm::cuda::device_buffer<float>& in,
                                  dcomm::cuda::device_buffer<float>& out, int iters,
                                  std::int64_t wrong) {
    const dcomm::op_options on_stream{.stream = stream_};
    auto micros_per_call = [iters](clock_type::time_point t0) {
      return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count() / iters;
    };
    std::vector<dcomm::request> pending(static_cast<std::size_t>(iters));
    std::vector<double> raw, awaited, ordered;
    for (int round = -1; round < 5; ++round) {  // round -1: warm-up
      auto t0 = clock_type::now();
      for (int i = 0; i < iters; ++i) raw_enqueue(op, in, out);
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      if (round >= 0) raw.push_back(micros_per_call(t0));

      t0 = clock_type::now();
      for (auto& r : pending) r = start_call(op, in, out);
      for (auto& r : pending) co_await r.async_wait();
      if (round >= 0) awaited.push_back(micros_per_call(t0));

      t0 = clock_type::now();
      for (int i = 0; i < iters; ++i) co_await dcomm_call(op, in, out, on_stream);
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      if (round >= 0) ordered.push_back(micros_per_call(t0));
    }
    auto median = [](std::vector<double>& v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    print_row(op, sh, median(raw), median(awaited), median(ordered), wrong);
  }

  void print_row(const std::string& op, const shape& sh, double t_raw, double t_dcomm,
                 double t_stream, std::int64_t wrong) const {
    if (comm_.rank() != 0) return;
    const std::size_t row_bytes = std::max(sh.in_count, sh.out_count) * sizeof(float);
    const double algbw = static_cast<double>(row_bytes) / (t_dcomm * 1e3);
    std::printf("%14s %12zu %12zu %10.1f %10.1f %10.1f %9.2f %8.1f%% %8.3f %8.3f %7lld\n",
                op.c_str(), row_bytes, std::max(sh.in_count, sh.out_count), t_raw, t_dcomm,
                t_stream, t_dcomm - t_raw, 100.0 * (t_dcomm - t_raw) / t_raw, algbw,
                algbw * sh.bus_factor, static_cast<long long>(wrong));
    std::fflush(stdout);
  }

  asio::awaitable<void> run() {
    for (bool latency : {true, false}) {
      if (!(latency ? s_.latency : s_.batch)) continue;
      if (comm_.rank() == 0) {
        std::printf(
            "# dcomm nccl_bench: nccl_backend vs raw NCCL, world %d, float32, sum, spin %lld us\n"
            "# %s\n",
            comm_.size(), static_cast<long long>(spin_.count()),
            latency ? "latency: each call waited for; rank 0's median per call"
                    : "batch: calls back to back, one wait (nccl-tests' time); median of 5 rounds");
        std::printf("%14s %12s %12s %10s %10s %10s %9s %9s %8s %8s %7s\n", "# op", "size(B)",
                    "count", "raw(us)", "dcomm(us)", "stream(us)", "over(us)", "over(%)", "algbw",
                    "busbw", "#wrong");
        std::fflush(stdout);
      }
      for (const auto& op : s_.ops)
        for (std::size_t bytes = std::max<std::size_t>(s_.min_bytes, sizeof(float));
             bytes <= s_.max_bytes; bytes *= s_.factor) {
          if (shape_of(op, bytes, comm_.size()).out_count == 0) continue;
          co_await row(op, bytes, latency);
        }
    }
  }

 private:
  comm_type comm_;
  const settings& s_;
  std::chrono::microseconds spin_;
  cudaStream_t stream_ = nullptr;
};

int run_rank(const settings& s) {
  asio::io_context context;
  dcomm::init_options<dcomm::nccl_backend> o{.timeout = 120s};
  if (s.spin_us >= 0) o.backend.spin = std::chrono::microseconds(s.spin_us);
  const std::string marker = "/tmp/dcomm-nccl-bench-" + std::to_string(::getpid());
  if (s.world == 0 && !std::getenv("WORLD_SIZE")) {  // alone: a world of one
    o.init_method = "file://" + marker;
    o.rank = 0;
    o.world_size = 1;
  }
  dcomm::sync_wait(context, [&]() -> asio::awaitable<void> {
    auto comm = co_await dcomm::init_process_group<dcomm::nccl_backend>(context.get_executor(), o);
    runner r(comm, s, o.backend.spin);
    co_await r.run();
  }());
  std::remove(marker.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    auto s = parse(argc, argv);
    if (dcomm::cuda::device_count() == 0) {
      std::fprintf(stderr, "nccl_bench: no CUDA device is visible to this process\n");
      return 1;
    }
    if (s.world > 0)
      dcomm::spawn(s.world, [&](int) { return run_rank(s); });
    else
      run_rank(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_bench: %s\n", e.what());
    return 1;
  }
}
