// Collectives and point-to-point over dcomm's CPU backend, in nccl-tests
// style rows. Not a test: it times, it does not judge. One translation unit
// of ~650 lines (the options, the timing loop, the raw MPI rows beside the
// backend's): a second would cost every CI build another minute of Asio.
//
//   collective_bench --world 2                      # spawns 2 local ranks
//   dcomm-run -n 4 collective_bench --op all_reduce # ranks from env://
//   collective_bench --world 2 --op all_reduce --min-bytes 4 --max-bytes 64M --factor 4
//
// Options: collective_bench --help (the table is in parse()). With
// --backend mpi, each all_reduce, barrier and sendrecv row is followed by
// the same calls made straight to MPI on the backend's communicator, links
// "raw": blocking, "MPI_Allreduce", and for collectives non-blocking +
// MPI_Wait too, "MPI_Iallreduce", the calls the backend makes: what the
// awaitable wrapper adds. --blocking makes the calls in their plain blocking
// form (dcomm::blocking) from the main thread, on a communicator of the
// blocking init_process_group, whose backend runs on an io thread of its
// own: what an MPI user writes first; compare its rows with a run without it.
//
// Method, the same as ../shared/anchors/gloo_bench.cc so the rows compare:
// before each timed call the ranks meet in a barrier; the row's time is
// rank 0's median. "bytes" is nccl-tests' size: the whole buffer
// (all_gather: the output, reduce_scatter: the input). busbw = algbw times
// nccl-tests' factor: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
// reduce_scatter, all_to_all, gather and scatter, 1 for broadcast and
// reduce. sendrecv is a ping-pong between ranks 0 and 1: time is half the
// round trip (the OSU convention), so "2 x time" compares with the TCP
// round trip of `anchors/run limits`. #wrong counts the elements that
// differ from the computed expectation after an untimed call, summed over
// ranks. allocs/call: rank 0's heap allocations per timed call (malloc and
// friends, interposed: Asio's coroutine frames and handler memory
// included); new/call: the operator new calls among them, which is where
// dcomm's own allocations would show. sendrecv's row counts a coroutine of
// the bench's own around its two operations (Asio's frame cache holds two).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dcomm/command_line.hpp>
#include <dcomm/dcomm.hpp>
#include <dcomm/spawn.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#if DCOMM_HAS_CUDA
#include <dcomm/cuda.hpp>
#endif

// The allocs column counts heap allocations (malloc and friends, so
// operator new and Asio's handler memory too): the CPU backend promises none
// per operation in steady state.
#define DCOMM_HEAP_COUNTER_IMPLEMENT
#include "../tests/support/heap_counter.hpp"

#if DCOMM_HAS_MPI
#include <dcomm/mpi.hpp>
#endif

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

const std::vector<std::string> all_ops = {"all_reduce",     "broadcast",  "reduce", "all_gather",
                                          "reduce_scatter", "all_to_all", "gather", "scatter",
                                          "barrier",        "sendrecv"};

struct settings {
  std::vector<std::string> ops = all_ops;
  int world = 0;  // 0: from env://
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t factor = 2;
  int iters = 0;
  int warmup = 3;
  dcomm::dtype type = dcomm::dtype::float32;
  std::string redop = "sum";
  dcomm::algorithm algo = dcomm::algorithm::automatic;
  bool check = true;
  bool in_place = false;  // all_reduce into its input
  bool confirm = true;    // cpu_backend::options::confirm_rooted
  std::string transport;  // cpu_backend::options::transport; empty: the backend's
  int hosts = 0;          // > 0: ranks play this many hosts (cpu_backend::options::host_id)
  std::size_t chunk_bytes = 0, eager_limit = 0, staging_slice = 0,
              slot_bytes = 0;  // 0: the backend's defaults
  bool cuda = false;           // tensors in GPU memory
  bool mpi = false;            // --backend mpi
  bool blocking = false;       // dcomm::blocking calls from the main thread
};

// The choices of --dtype: every dtype up to float64, by name.
std::vector<std::pair<std::string, dcomm::dtype>> dtypes() {
  std::vector<std::pair<std::string, dcomm::dtype>> all;
  for (int t = 0; t <= static_cast<int>(dcomm::dtype::float64); ++t)
    all.emplace_back(dcomm::name(static_cast<dcomm::dtype>(t)), static_cast<dcomm::dtype>(t));
  return all;
}

// The options: one line each, in the table --help prints.
settings parse(int argc, char** argv) {
  settings s;
  std::string op = "all";
  dcomm::command_line cl("collective_bench",
                         "Collectives and point-to-point over dcomm's CPU backend, in nccl-tests "
                         "style rows.");
  std::vector<std::string> ops = all_ops;
  ops.push_back("all");
  cl.option(
        "op", op, "NAME",
        "the operation, or all: " +
            [] {
              std::string names;
              for (const auto& o : all_ops) names += (names.empty() ? "" : " ") + o;
              return names;
            }())
      .one_of(ops);
  cl.option("world", s.world, "N", "spawn N local ranks; 0: one rank of a launched job (env://)")
      .at_least(0);
  cl.bytes("min-bytes", s.min_bytes, "B", "the first size: 8, 4K, 64M, 1G; 8");
  cl.bytes("max-bytes", s.max_bytes, "B", "the last size; 256M");
  cl.option("factor", s.factor, "F", "each size is F times the one before; 2").at_least(2);
  cl.option("iters", s.iters, "N",
            "timed calls per size; 0: 200 at small sizes, fewer as sizes grow, at least 5")
      .at_least(0);
  cl.option("warmup", s.warmup, "N", "untimed calls first; 3").at_least(0);
  cl.choice("dtype", s.type, dtypes(), "T", "the elements' type; float32");
  cl.option("redop", s.redop, "OP", "sum, min or max; sum").one_of({"sum", "min", "max"});
  cl.custom("algo", "A", "the algorithm (ring, recursive_doubling, shared_memory, ...); automatic",
            [&s](std::string_view v) {
              const auto algo = dcomm::parse_algorithm(v);
              if (!algo)
                throw dcomm::usage_error("needs an algorithm, not '" + std::string(v) + "'");
              s.algo = *algo;
            });
  cl.bytes("chunk-bytes", s.chunk_bytes, "B", "cpu_backend's chunk_bytes");
  cl.bytes("slot-bytes", s.slot_bytes, "B", "the shared memory arena's step");
  cl.bytes("eager-limit", s.eager_limit, "B", "cpu_backend's eager_limit");
  cl.bytes("staging-slice", s.staging_slice, "B", "cpu_backend's staging_slice (--device cuda)");
  cl.choice("device", s.cuda, {{"cpu", false}, {"cuda", true}}, "cpu|cuda",
            "where the tensors are: cuda, in GPU memory, staged by the backend through "
            "page-locked host memory (where built with CUDA); cpu");
  cl.option("transport", s.transport, "auto|shm|tcp",
            "the links between ranks of this host (the \"links\" column says which ran)")
      .one_of({"auto", "shm", "tcp"});
  cl.option("hosts", s.hosts, "K",
            "the ranks play K hosts of consecutive ranks: shared memory inside each, TCP "
            "between them, and the hierarchical all_reduce")
      .at_least(1);
  cl.flag("no-confirm", s.confirm, "cpu_backend's confirm_rooted off", false);
  cl.flag("no-check", s.check, "leave the results unchecked", false);
  cl.flag("in-place", s.in_place,
          "all_reduce into its input (as MPI_Allreduce(MPI_IN_PLACE)); the other ops as they are");
  cl.flag("blocking", s.blocking, "the calls in their blocking form, from the main thread");
  cl.choice("backend", s.mpi, {{"cpu", false}, {"mpi", true}}, "cpu|mpi",
            "mpi: under mpirun (where built with MPI), each row beside the raw MPI calls; cpu");
  cl.parse(argc, argv);
  if (op != "all") s.ops = {op};
#if !DCOMM_HAS_CUDA
  if (s.cuda) cl.fail("--device cuda: this build has no CUDA runtime");
#endif
#if !DCOMM_HAS_MPI
  if (s.mpi) cl.fail("--backend mpi: this build has no MPI");
#endif
  if (s.mpi && s.world > 0) cl.fail("--backend mpi takes its ranks from mpirun");
  return s;
}

// Rank r's input element i: small integers, exact in every dtype and
// under every reduction of up to 8 ranks.
double input_value(int rank, std::size_t i) {
  return static_cast<double>(rank + 1) + static_cast<double>(i % 5);
}

// A rank's tensor: in host memory, or with --device cuda in GPU memory
// (`bytes` is then the host copy that is filled and checked).
struct buffer {
  std::vector<std::byte> bytes;
  dcomm::dtype type;
  std::size_t count;
#if DCOMM_HAS_CUDA
  std::optional<dcomm::cuda::device_buffer<std::uint8_t>> device;
#endif

  buffer(dcomm::dtype t, std::size_t n, bool cuda)
      : bytes(n * dcomm::size_of(t)), type(t), count(n) {
#if DCOMM_HAS_CUDA
    if (cuda) device.emplace(bytes.size());
#else
    (void)cuda;
#endif
  }
  dcomm::tensor_view view() {
    return block(0, count);
  }
  dcomm::tensor_view block(std::size_t first, std::size_t n) {
    const std::size_t offset = first * dcomm::size_of(type);
#if DCOMM_HAS_CUDA
    if (device) return {device->data() + offset, n, type, dcomm::device::cuda(device->device())};
#endif
    return {bytes.data() + offset, n, type, {}};
  }
  // The host copy to the device, and back (no-ops in host memory).
  void upload() {
#if DCOMM_HAS_CUDA
    if (device)
      device->copy_from({reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()});
#endif
  }
  void download() {
#if DCOMM_HAS_CUDA
    if (device) device->copy_to({reinterpret_cast<std::uint8_t*>(bytes.data()), bytes.size()});
#endif
  }
  void set(std::size_t i, double v) {
    dcomm::visit_dtype(type, [&]<class T>(std::type_identity<T>) {
      reinterpret_cast<T*>(bytes.data())[i] = static_cast<T>(static_cast<float>(v));
    });
  }
  double get(std::size_t i) const {
    return dcomm::visit_dtype(type, [&]<class T>(std::type_identity<T>) {
      return static_cast<double>(static_cast<float>(reinterpret_cast<const T*>(bytes.data())[i]));
    });
  }
  void fill(int rank) {
    for (std::size_t i = 0; i < count; ++i) set(i, input_value(rank, i));
  }
};

struct op_shape {
  std::size_t in_count, out_count;
  double bus_factor;
};

// Counts of one rank's buffers for a row of `bytes`, as nccl-tests sizes them.
op_shape shape_of(const std::string& op, std::size_t bytes, std::size_t elem, int world) {
  auto n = static_cast<std::size_t>(world);
  std::size_t count = bytes / elem;
  double spread = static_cast<double>(world - 1) / world;
  if (op == "all_reduce") return {count, count, 2 * spread};
  if (op == "broadcast" || op == "reduce") return {count, count, 1};
  if (op == "sendrecv") return {count, count, 1};
  if (op == "barrier") return {0, 0, 0};
  std::size_t block = count / n;
  if (op == "all_gather") return {block, block * n, spread};
  if (op == "reduce_scatter") return {block * n, block, spread};
  if (op == "all_to_all") return {block * n, block * n, spread};
  if (op == "gather") return {block, block * n, spread};
  if (op == "scatter") return {block * n, block, spread};
  throw std::invalid_argument("no shape for " + op);
}

double reduced(const std::string& redop, int world, std::size_t i) {
  double acc = input_value(0, i);
  for (int r = 1; r < world; ++r) {
    double v = input_value(r, i);
    acc = redop == "sum" ? acc + v : redop == "min" ? std::min(acc, v) : std::max(acc, v);
  }
  return acc;
}

template <class Backend>
class runner {
 public:
  using comm_type = dcomm::communicator<Backend>;

  runner(comm_type comm, const settings& s) : comm_(std::move(comm)), s_(s) {}

  // The ops call() runs, named once per row: no string compares in the
  // timed region.
  enum class op_kind {
    all_reduce,
    broadcast,
    reduce,
    all_gather,
    reduce_scatter,
    all_to_all,
    gather,
    scatter,
    barrier,
    sendrecv
  };
  static op_kind kind_of(const std::string& op) {
    static const char* const names[] = {"all_reduce", "broadcast",      "reduce",
                                        "all_gather", "reduce_scatter", "all_to_all",
                                        "gather",     "scatter",        "barrier"};
    for (std::size_t i = 0; i < std::size(names); ++i)
      if (op == names[i]) return static_cast<op_kind>(i);
    return op_kind::sendrecv;
  }

  // One call of `op` on prepared buffers, with `token`: the operation's
  // awaitable (the default token), or nothing once it has completed
  // (dcomm::blocking). Not a coroutine itself: it returns the operation's
  // awaitable, so that the allocs column counts the operation and not a
  // frame of the bench's own (Asio keeps two per thread).
  template <class Token = dcomm::default_token_t>
  auto call(op_kind op, buffer& in, buffer& out, Token token = {}) {
    dcomm::op_options o{.algorithm = s_.algo};
    int rank = comm_.rank();
    switch (op) {
      case op_kind::all_reduce:
        if (s_.in_place)
          return with_redop([&](auto r) { return comm_.all_reduce(out.view(), r, o, token); });
        return with_redop(
            [&](auto r) { return comm_.all_reduce(in.view(), out.view(), r, o, token); });
      case op_kind::broadcast:
        return comm_.broadcast(out.view(), 0, o, token);
      case op_kind::reduce:
        return with_redop(
            [&](auto r) { return comm_.reduce(in.view(), out.view(), 0, r, o, token); });
      case op_kind::all_gather:
        return comm_.all_gather(in.view(), out.view(), o, token);
      case op_kind::reduce_scatter:
        return with_redop(
            [&](auto r) { return comm_.reduce_scatter(in.view(), out.view(), r, o, token); });
      case op_kind::all_to_all:
        return comm_.all_to_all(in.view(), out.view(), o, token);
      case op_kind::gather:
        return comm_.gather(in.view(), rank == 0 ? out.view() : out.block(0, 0), 0, o, token);
      case op_kind::scatter:
        return comm_.scatter(rank == 0 ? in.view() : in.block(0, 0), out.view(), 0, o, token);
      case op_kind::barrier:
        return comm_.barrier(o, token);
      case op_kind::sendrecv:
        break;
    }
    // Two operations: a frame of its own, or two blocking calls.
    if constexpr (std::is_same_v<Token, dcomm::blocking_t>)
      sendrecv_blocking(in, out, o);
    else
      return sendrecv(in, out, o);
  }

  asio::awaitable<void> sendrecv(buffer& in, buffer& out, dcomm::op_options o) {
    if (comm_.rank() == 0) {
      co_await comm_.send(in.view(), 1, 0, o);
      co_await comm_.recv(out.view(), 1, 0, o);
    } else if (comm_.rank() == 1) {
      co_await comm_.recv(out.view(), 0, 0, o);
      co_await comm_.send(out.view(), 0, 0, o);
    }
  }
  void sendrecv_blocking(buffer& in, buffer& out, dcomm::op_options o) {
    if (comm_.rank() == 0) {
      comm_.send(in.view(), 1, 0, o, dcomm::blocking);
      comm_.recv(out.view(), 1, 0, o, dcomm::blocking);
    } else if (comm_.rank() == 1) {
      comm_.recv(out.view(), 0, 0, o, dcomm::blocking);
      comm_.send(out.view(), 0, 0, o, dcomm::blocking);
    }
  }

  // Elements of this rank's result that differ from the expectation.
  std::size_t wrong(const std::string& op, buffer& out) const {
    int rank = comm_.rank(), world = comm_.size();
    auto n = out.count;
    auto bad = [&](std::size_t i, double expected) { return out.get(i) != expected ? 1u : 0u; };
    std::size_t errors = 0;
    if (op == "all_reduce" || (op == "reduce" && rank == 0)) {
      for (std::size_t i = 0; i < n; ++i) errors += bad(i, reduced(s_.redop, world, i));
    } else if (op == "broadcast" || (op == "sendrecv" && rank <= 1)) {
      // sendrecv: rank 1 echoes what rank 0 sent, so both hold rank 0's input.
      for (std::size_t i = 0; i < n; ++i) errors += bad(i, input_value(0, i));
    } else if (op == "all_gather" || (op == "gather" && rank == 0)) {
      std::size_t block = n / static_cast<std::size_t>(world);
      for (std::size_t i = 0; i < n; ++i)
        errors += bad(i, input_value(static_cast<int>(i / block), i % block));
    } else if (op == "reduce_scatter") {
      std::size_t first = static_cast<std::size_t>(rank) * n;
      for (std::size_t i = 0; i < n; ++i) errors += bad(i, reduced(s_.redop, world, first + i));
    } else if (op == "all_to_all") {
      std::size_t block = n / static_cast<std::size_t>(world);
      for (std::size_t i = 0; i < n; ++i)
        errors += bad(i, input_value(static_cast<int>(i / block),
                                     static_cast<std::size_t>(rank) * block + i % block));
    } else if (op == "scatter") {
      std::size_t first = static_cast<std::size_t>(rank) * n;
      for (std::size_t i = 0; i < n; ++i) errors += bad(i, input_value(0, first + i));
    }
    return errors;
  }

  asio::awaitable<void> row(const std::string& op, std::size_t bytes) {
    const op_kind kind = kind_of(op);
    int rank = comm_.rank(), world = comm_.size();
    auto elem = dcomm::size_of(s_.type);
    auto sh = shape_of(op, bytes, elem, world);
    buffer in(s_.type, sh.in_count, s_.cuda), out(s_.type, sh.out_count, s_.cuda);
    auto prepare = [&] {
      in.fill(rank);
      // broadcast is in place: the root's data is its input.
      if (op == "broadcast") rank == 0 ? out.fill(0) : out.fill(world + 7);
      if (op == "all_reduce" && s_.in_place) out.fill(rank);
      in.upload();
      out.upload();
    };

    std::int64_t errors = -1;
    if (s_.check) {
      prepare();
      co_await call(kind, in, out);
      out.download();
      std::vector<std::int64_t> e{static_cast<std::int64_t>(wrong(op, out))};
      co_await comm_.all_reduce(e, dcomm::sum);
      errors = e[0];
    }
    prepare();
    for (int i = 0; i < s_.warmup; ++i) {
      if (s_.blocking)
        call(kind, in, out, dcomm::blocking);
      else
        co_await call(kind, in, out);
    }
    int iters =
        s_.iters > 0
            ? s_.iters
            : static_cast<int>(std::clamp<double>(2e8 / std::max<double>(bytes, 1), 5, 200));
    std::vector<double> us;
    us.reserve(static_cast<std::size_t>(iters));
    std::uint64_t allocations = 0, new_calls = 0;
    for (int i = 0; i < iters; ++i) {
      if (s_.blocking)
        comm_.barrier(dcomm::blocking);
      else
        co_await comm_.barrier();
      auto a0 = dcomm::test::heap_allocations_in_process();
      auto n0 = dcomm::test::new_calls_in_process();
      auto t0 = clock_type::now();
      if (s_.blocking)
        call(kind, in, out, dcomm::blocking);
      else
        co_await call(kind, in, out);
      us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
      allocations += dcomm::test::heap_allocations_in_process() - a0;
      new_calls += dcomm::test::new_calls_in_process() - n0;
    }
    print(op, links_, sh, us, errors, allocations, new_calls);
#if DCOMM_HAS_MPI
    if constexpr (std::is_same_v<Backend, dcomm::mpi_backend>) raw_mpi(kind, in, out, sh, iters);
#endif
  }

  // The row of `op` from its calls' times (rank 0 prints).
  void print(const std::string& op, const std::string& links, const op_shape& sh,
             std::vector<double>& us, std::int64_t errors, std::uint64_t allocations,
             std::uint64_t new_calls) const {
    if (comm_.rank() != 0) return;
    const auto iters = static_cast<double>(us.size());
    std::sort(us.begin(), us.end());
    double median = us[us.size() / 2];
    if (op == "sendrecv" || op == "MPI_Send/Recv") median /= 2;
    const std::size_t row_bytes = std::max(sh.in_count, sh.out_count) * dcomm::size_of(s_.type);
    const double algbw = static_cast<double>(row_bytes) / (median * 1e3);
    const bool reduces = op == "all_reduce" || op == "reduce" || op == "reduce_scatter" ||
                         op == "MPI_Allreduce" || op == "MPI_Iallreduce";
    // Two decimals below 10 us: small calls are compared with MPI's 0.1-0.2 us.
    std::printf("%14s %12zu %12zu %9s %7s %6s %11.*f %8.3f %8.3f %7s %7.1f %6.1f\n", op.c_str(),
                row_bytes, std::max(sh.in_count, sh.out_count),
                std::string(dcomm::name(s_.type)).c_str(), reduces ? s_.redop.c_str() : "none",
                links.c_str(), median < 10 ? 2 : 1, median, algbw, algbw * sh.bus_factor,
                errors < 0 ? "-" : std::to_string(errors).c_str(),
                static_cast<double>(allocations) / iters, static_cast<double>(new_calls) / iters);
    std::fflush(stdout);
  }

#if DCOMM_HAS_MPI
  // The same calls straight to MPI on the backend's communicator, timed
  // the same way (MPI_Barrier between calls): on this thread, the
  // backend's, while no dcomm operation is pending. Collectives twice:
  // blocking, and non-blocking + MPI_Wait (what the backend calls), which
  // splits MPI's cost of the non-blocking form from dcomm's. fp16 and bf16
  // have no MPI reduction to compare with.
  void raw_mpi(op_kind kind, buffer& in, buffer& out, const op_shape& sh, int iters) {
    if (kind != op_kind::all_reduce && kind != op_kind::barrier && kind != op_kind::sendrecv)
      return;
    if (kind == op_kind::all_reduce &&
        (s_.type == dcomm::dtype::float16 || s_.type == dcomm::dtype::bfloat16))
      return;
    MPI_Comm c = comm_.backend().native_handle();
    const MPI_Datatype dt = dcomm::mpi::datatype_of(s_.type);
    const MPI_Op mop = redop_ == 'i' ? MPI_MIN : redop_ == 'a' ? MPI_MAX : MPI_SUM;
    const int rank = comm_.rank(), n = static_cast<int>(out.count);
    auto timed = [&](const char* name, auto once) {
      for (int i = 0; i < s_.warmup; ++i) once();
      std::vector<double> us;
      us.reserve(static_cast<std::size_t>(iters));
      std::uint64_t allocations = 0, new_calls = 0;
      for (int i = 0; i < iters; ++i) {
        MPI_Barrier(c);
        auto a0 = dcomm::test::heap_allocations_in_process();
        auto n0 = dcomm::test::new_calls_in_process();
        auto t0 = clock_type::now();
        once();
        us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
        allocations += dcomm::test::heap_allocations_in_process() - a0;
        new_calls += dcomm::test::new_calls_in_process() - n0;
      }
      print(name, "raw", sh, us, -1, allocations, new_calls);
    };
    MPI_Request r = MPI_REQUEST_NULL;
    if (kind == op_kind::all_reduce) {
      const void* from = s_.in_place ? MPI_IN_PLACE : static_cast<const void*>(in.bytes.data());
      timed("MPI_Allreduce", [&] { MPI_Allreduce(from, out.bytes.data(), n, dt, mop, c); });
      timed("MPI_Iallreduce", [&] {
        MPI_Iallreduce(from, out.bytes.data(), n, dt, mop, c, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      });
    } else if (kind == op_kind::barrier) {
      timed("MPI_Barrier", [&] { MPI_Barrier(c); });
      timed("MPI_Ibarrier", [&] {
        MPI_Ibarrier(c, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      });
    } else {
      timed("MPI_Send/Recv", [&] {
        if (rank == 0) {
          MPI_Send(in.bytes.data(), n, dt, 1, 0, c);
          MPI_Recv(out.bytes.data(), n, dt, 1, 0, c, MPI_STATUS_IGNORE);
        } else if (rank == 1) {
          MPI_Recv(out.bytes.data(), n, dt, 0, 0, c, MPI_STATUS_IGNORE);
          MPI_Send(out.bytes.data(), n, dt, 0, 0, c);
        }
      });
    }
  }
#endif

  asio::awaitable<void> run() {
    int world = comm_.size();
    // The links rank 0 has to its peers: "shm", "tcp" or "mixed".
    for (int p = 0; p < world; ++p) {
      if (p == comm_.rank()) continue;
      std::string l(Backend::name);
      if constexpr (requires { comm_.backend().link_to(p); }) l = comm_.backend().link_to(p);
      links_ = links_.empty() || links_ == l ? l : "mixed";
    }
    if (links_.empty()) links_ = "-";
    if (comm_.rank() == 0) {
      std::printf("# dcomm collective_bench: %s backend, world %d, dtype %s, algorithm %s%s%s\n",
                  std::string(Backend::name).c_str(), world,
                  std::string(dcomm::name(s_.type)).c_str(),
                  std::string(dcomm::name(s_.algo)).c_str(),
                  s_.cuda ? ", tensors in GPU memory (staged through page-locked host memory)" : "",
                  s_.in_place ? ", all_reduce in place" : "");
      std::printf("# calls: %s\n",
                  s_.blocking ? "dcomm::blocking, from the main thread (the backend on its own "
                                "io thread)"
                              : "co_await, on the backend's thread");
      std::printf("# time: rank 0's median (us) over barrier-separated calls%s\n",
                  std::find(s_.ops.begin(), s_.ops.end(), "sendrecv") != s_.ops.end()
                      ? "; sendrecv: half a round trip"
                      : "");
      std::printf("%14s %12s %12s %9s %7s %6s %11s %8s %8s %7s %7s %6s\n", "# op", "size(B)",
                  "count", "type", "redop", "links", "time(us)", "algbw", "busbw", "#wrong",
                  "allocs", "new");
      std::printf("%14s %12s %12s %9s %7s %6s %11s %8s %8s %7s %7s %6s\n", "#", "", "(elements)",
                  "", "", "", "", "(GB/s)", "(GB/s)", "", "/call", "/call");
      std::fflush(stdout);
    }
    for (const auto& op : s_.ops) {
      if (op == "sendrecv" && world < 2) continue;
      if (op == "barrier") {
        co_await row(op, 0);
        continue;
      }
      auto elem = dcomm::size_of(s_.type);
      for (std::size_t bytes = std::max(s_.min_bytes, elem); bytes <= s_.max_bytes;
           bytes *= s_.factor) {
        // Block-shaped ops need at least one element per rank.
        if (shape_of(op, bytes, elem, world).out_count == 0) continue;
        co_await row(op, bytes);
      }
    }
  }

 private:
  template <class F>
  auto with_redop(F f) {
    if (redop_ == 'i') return f(dcomm::min);
    if (redop_ == 'a') return f(dcomm::max);
    return f(dcomm::sum);
  }

  comm_type comm_;
  const settings& s_;
  std::string links_;
  char redop_ = s_.redop == "min" ? 'i' : s_.redop == "max" ? 'a' : 's';  // with_redop's
};

// --blocking: the backend on its own io thread (the blocking
// init_process_group), the rows' calls made from this thread's coroutine,
// which runs on a context of its own.
template <class Backend>
int run_blocking(const settings& s, dcomm::init_options<Backend> o) {
  auto comm = dcomm::init_process_group<Backend>(std::move(o));
  runner<Backend> r(comm, s);
  dcomm::sync_wait(r.run());
  return 0;
}

#if DCOMM_HAS_MPI
int run_mpi(const settings& s) {
  asio::io_context context{1};  // run by this thread alone: the backend needs no strand
  // A named variable: g++ 12 destroys a temporary in a co_await twice.
  dcomm::init_options<dcomm::mpi_backend> o{.timeout = 120s};
  if (s.blocking) return run_blocking(s, o);
  dcomm::sync_wait(context, [&]() -> asio::awaitable<void> {
    auto comm = co_await dcomm::init_process_group<dcomm::mpi_backend>(context.get_executor(), o);
    runner<dcomm::mpi_backend> r(comm, s);
    co_await r.run();
  }());
  return 0;
}
#endif

int run_rank(const settings& s) {
  asio::io_context context{1};  // run by this thread alone: the backend needs no strand
  dcomm::init_options<dcomm::cpu_backend> o{.timeout = 120s};
  // Spawned ranks share this host: keep the mesh on loopback.
  if (s.world > 0) o.backend.bind_host = "127.0.0.1";
  if (s.chunk_bytes) o.backend.chunk_bytes = s.chunk_bytes;
  if (s.slot_bytes) o.backend.shm_slot_bytes = s.slot_bytes;
  if (s.eager_limit) o.backend.eager_limit = s.eager_limit;
  o.backend.confirm_rooted = s.confirm;
  if (!s.transport.empty()) o.backend.transport = s.transport;
  if (s.staging_slice) o.backend.staging_slice = s.staging_slice;
  if (s.hosts > 0) {
    // Consecutive ranks per host, from the launcher's RANK and WORLD_SIZE.
    const char* rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    const int r = rank ? std::atoi(rank) : 0, n = world ? std::max(1, std::atoi(world)) : 1;
    o.backend.host_id = "bench-host-" + std::to_string(r * s.hosts / n);
  }
  if (s.blocking) return run_blocking(s, o);
  dcomm::sync_wait(context, [&]() -> asio::awaitable<void> {
    auto comm = co_await dcomm::init_process_group<dcomm::cpu_backend>(context.get_executor(), o);
    runner<dcomm::cpu_backend> r(comm, s);
    co_await r.run();
  }());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    auto s = parse(argc, argv);
#if DCOMM_HAS_MPI
    if (s.mpi) return run_mpi(s);
#endif
    if (s.world > 0)
      dcomm::spawn(s.world, [&](int) { return run_rank(s); });
    else
      run_rank(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collective_bench: %s\n", e.what());
    return 1;
  }
}
