// The NCCL backend: communicator<nccl_backend> runs every collective and
// send/recv on this rank's GPU through NCCL, behind the same front end as the
// tcp backend, so a training loop moves to the GPU by changing one type:
//
//   dcomm::init_options<dcomm::nccl_backend> o{.init_method = "env://"};
//   auto comm = co_await dcomm::init_process_group<dcomm::nccl_backend>(ex, o);
//   dcomm::cuda::device_buffer<float> grads(n);              // on comm.backend().device()
//   co_await comm.all_reduce(grads, dcomm::avg);              // done when the GPU is done
//   co_await comm.all_reduce(grads, dcomm::sum, {.stream = s});  // done once enqueued on s
//
// How it works (docs/gpu.md):
// - The NCCL unique id goes from rank 0 to the others through the store; the
//   communicator is made non-blocking (ncclConfig_t::blocking = 0) and its
//   initialisation polled until it is ready or the deadline passes.
// - new_group and split make their communicators with ncclCommSplit on the
//   parent's (every member of the parent calls it, as dcomm's new_group needs).
// - Calls on one NCCL communicator are issued in the order their operations
//   were started (a turnstile per group): NCCL needs every rank to issue them
//   in the same order, and an operation may have to wait for a communicator
//   still being made.
// - Completion: an event recorded behind the operation's NCCL calls. The
//   awaitable completes when the GPU has passed it: polled for a short
//   while (options::spin, where most small operations finish), then asleep
//   until a host function queued behind the event posts to the backend's
//   executor, so no thread spins for the length of an operation. While it
//   sleeps, the operation polls NCCL's asynchronous error every
//   poll_interval; on an error or the deadline every NCCL communicator of
//   the backend is aborted (ncclCommAbort) and every pending operation
//   fails with a typed error. The stream-ordered form completes once
//   enqueued; a watcher polls its event for the deadline, adding nothing
//   to the stream.
// - Host memory is refused by check_tensor; the front end's own calls that
//   carry host data (split's colours, the object collectives, the counts of
//   the _v collectives) are staged through device memory here.
// - NCCL matches point-to-point messages by order, not by tag: a tag other
//   than 0 is refused. NCCL cannot detect ranks that disagree on a call's
//   size: they hang, and the deadline turns that into errc::timeout.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cuda.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/error.hpp"
#include "dcomm/nccl/completion_estimate.hpp"
#include "dcomm/nccl/staging.hpp"
#include "dcomm/nccl/types.hpp"
#include "dcomm/nccl/wait.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

class nccl_backend : public std::enable_shared_from_this<nccl_backend> {
 public:
  static constexpr std::string_view name = "nccl";
  static constexpr bool supports_custom_reduce = false;
  static constexpr bool supports_bitwise_reduce = false;
  static constexpr bool supports_streams = true;

  struct options {
    // This rank's GPU; -1: $LOCAL_RANK when set, else rank modulo the GPUs
    // this process sees.
    int device = -1;
    // How often an operation waiting for the GPU checks NCCL's asynchronous
    // errors (completion itself wakes it at once).
    std::chrono::milliseconds poll_interval = std::chrono::milliseconds(10);
    // How long an operation polls, on the executor's thread, before it
    // sleeps: for NCCL to finish enqueueing (a non-blocking communicator
    // enqueues on a thread of its own) and for the GPU to finish. Most
    // small operations are done within it, and a wake-up through a host
    // function and the executor costs tens of microseconds; longer ones
    // sleep (no thread spins for the length of an operation). 0: never poll.
    std::chrono::microseconds spin = std::chrono::microseconds(50);
  };

  // Makes the world's NCCL communicator. Runs on (and stays on) the
  // executor it is awaited from, a strand or a one-thread context.
  static asio::awaitable<std::shared_ptr<nccl_backend>> create(std::shared_ptr<store> s, int rank,
                                                               int world, std::string job_token,
                                                               std::string store_host, options o,
                                                               detail::clock::time_point deadline) {
    static_cast<void>(job_token);   // the store is authenticated already; NCCL's
    static_cast<void>(store_host);  // bootstrap finds its own interfaces
    auto ex = co_await asio::this_coro::executor;
    const int gpus = cuda::device_count();
    if (gpus == 0)
      throw_error(errc::device_error, {.operation = "nccl_backend",
                                       .rank = rank,
                                       .detail = "no CUDA device is visible to this process"});
    const int dev = o.device >= 0 ? o.device : nccl::default_device(rank, gpus);
    if (dev >= gpus)
      throw_error(errc::invalid_argument, {.operation = "nccl_backend",
                                           .rank = rank,
                                           .expected = "a device below " + std::to_string(gpus),
                                           .seen = "device " + std::to_string(dev)});
    auto b = std::shared_ptr<nccl_backend>(new nccl_backend(ex, rank, world, dev, o));
    const std::string key = "dcomm/nccl/world/unique_id";
    ncclUniqueId id{};
    if (rank == 0) {
      b->nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr);
      co_await s->set(key, std::string(id.internal, sizeof id.internal));
    } else {
      auto v = co_await s->get(key, detail::time_left(deadline));
      if (v.size() != sizeof id.internal)
        throw_error(errc::protocol_error,
                    {.operation = "nccl_backend",
                     .rank = rank,
                     .key = key,
                     .expected = std::to_string(sizeof id.internal) + " bytes",
                     .seen = std::to_string(v.size()) + " bytes"});
      std::memcpy(id.internal, v.data(), sizeof id.internal);
    }
    auto& g = b->add_group(0, "the world group", rank, world);
    {
      cuda::device_guard on(dev);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      const auto r = ncclCommInitRankConfig(&g.comm, world, id, rank, &config);
      if (r != ncclSuccess && r != ncclInProgress)
        b->nccl_check(r, "ncclCommInitRankConfig", g.comm);
    }
    op_context ctx{.deadline = deadline};
    // settle() is a task: awaited from this Asio coroutine through initiate.
    co_await detail::initiate(ex, b->settle(g, ctx, "ncclCommInitRankConfig"), asio::use_awaitable,
                              "ncclCommInitRankConfig",
                              deadline - detail::clock::now() + detail::blocking_grace);
    co_return b;
  }

  nccl_backend(const nccl_backend&) = delete;
  nccl_backend& operator=(const nccl_backend&) = delete;
  ~nccl_backend() { release(true); }

  asio::any_io_executor get_executor() const { return ex_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // The GPU this rank's communicators use.
  int device() const { return device_; }
  // The world group's NCCL communicator and the stream its awaited
  // operations run on, for NCCL calls of your own (benchmarks, kernels
  // dcomm lacks). Call them on the backend's executor while no dcomm
  // operation is pending, in the same order on every rank. Null once the
  // communicator is aborted or closed.
  ncclComm_t native_handle() const { return groups_.at(0)->comm; }
  cudaStream_t native_stream() const { return groups_.at(0)->stream; }

  // Aborts every NCCL communicator (ncclCommAbort) and fails every pending
  // and future operation with errc::aborted. Thread-safe.
  void abort() {
    asio::dispatch(ex_, [self = shared_from_this()] {
      self->abort_all(make_error(
          errc::aborted,
          {.operation = "nccl_backend", .rank = self->rank_, .detail = "abort() was called"}));
    });
  }
  // The last communicator handle is gone: finalize and destroy the NCCL
  // communicators (abort those that do not finish within 10 s).
  void close(std::function<void()> closed = {}) {
    asio::dispatch(ex_, [self = shared_from_this(), closed = std::move(closed)] {
      self->release(false);
      if (closed) closed();
    });
  }

  // This rank's GPU only; every dtype of dcomm is one NCCL carries.
  // NCCL picks its algorithms itself (NCCL_ALGO tunes them): a call may
  // not ask for one of dcomm's.
  static void check_algorithm(std::string_view operation, algorithm a) {
    if (a != algorithm::automatic)
      throw_error(errc::invalid_argument,
                  {.operation = std::string(operation),
                   .detail = "algorithm " + std::string(dcomm::name(a)) +
                             " is not available on the nccl backend: NCCL chooses its own "
                             "(set NCCL_ALGO to steer it); leave it automatic"});
  }

  void check_tensor(const const_tensor_view& v, const char* operation) const {
    if (v.count == 0) return;  // never touched: any empty buffer will do
    if (v.device.type != device::kind::cuda)
      throw_error(errc::invalid_argument,
                  {.operation = operation,
                   .rank = rank_,
                   .expected = "a CUDA tensor on device " + std::to_string(device_),
                   .seen = "host memory",
                   .detail = "the nccl backend takes device memory; use the tcp backend for "
                             "host tensors"});
    if (v.device.index != device_)
      throw_error(
          errc::invalid_argument,
          {.operation = operation,
           .rank = rank_,
           .expected = "a CUDA tensor on device " + std::to_string(device_),
           .seen = "a CUDA tensor on device " + std::to_string(v.device.index),
           .detail = "this rank's NCCL communicator runs on device " + std::to_string(device_)});
    static_cast<void>(nccl::data_type(v.type));
  }

  // ncclCommSplit of the parent's communicator, issued in the parent's
  // order; the child's operations wait for it.
  void group_created(const std::shared_ptr<group_state>& parent,
                     const std::shared_ptr<group_state>& child, int color, int key) {
    asio::post(ex_, [self = shared_from_this(), parent_id = parent->id,
                     deadline = detail::clock::now() + parent->timeout, child, color,
                     key] { self->start_split(parent_id, deadline, child, color, key); });
  }

  // Empty buffers: nothing is handed to NCCL (it may refuse the null
  // pointer of an empty device buffer), and the operation still completes
  // in its place in the stream. Ranks that disagree on emptiness are a size
  // mismatch, which NCCL cannot see: the non-empty ones reach the deadline.

  // --- point to point: matched in order per pair of ranks ---
  detail::task<void> send(op_context ctx, const_tensor_view in, int peer) {
    check_tag(ctx, "send");
    co_await run(ctx, "send", in.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
      if (in.count == 0) return ncclSuccess;
      return ncclSend(st.in(in), in.count, nccl::data_type(in.type), peer, g.comm, s);
    });
  }
  detail::task<void> recv(op_context ctx, tensor_view out, int peer) {
    check_tag(ctx, "recv");
    co_await run(ctx, "recv", out.bytes(),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   if (out.count == 0) return ncclSuccess;
                   return ncclRecv(st.out(out), out.count, nccl::data_type(out.type), peer,
                                   g.comm, s);
                 });
  }

  // --- collectives ---
  detail::task<void> barrier(op_context ctx) {
    co_await run(ctx, "barrier", sizeof(float),
                 [&](group& g, cudaStream_t s, nccl::staging&) {
                   return ncclAllReduce(g.scratch, g.scratch, 1, ncclFloat32, ncclSum, g.comm, s);
                 });
  }
  detail::task<void> broadcast(op_context ctx, tensor_view buf, int root) {
    co_await run(
        ctx, "broadcast", buf.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
          if (buf.count == 0) return ncclSuccess;
          void* d = st.out(buf, g.rank == root);
          return ncclBroadcast(d, d, buf.count, nccl::data_type(buf.type), root, g.comm, s);
        });
  }
  detail::task<void> reduce(op_context ctx, const_tensor_view in, tensor_view out, reducer r,
                            int root) {
    co_await run(ctx, "reduce", in.bytes(),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   if (in.count == 0) return ncclSuccess;
                   const void* src = st.in(in);
                   void* dst = g.rank == root ? st.out(out) : const_cast<void*>(src);
                   return ncclReduce(src, dst, in.count, nccl::data_type(in.type),
                                     st.reduce_op(r, g.comm), root, g.comm, s);
                 });
  }
  detail::task<void> all_reduce(op_context ctx, const_tensor_view in, tensor_view out, reducer r) {
    co_await run(ctx, "all_reduce", in.bytes(),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   if (in.count == 0) return ncclSuccess;
                   const bool in_place = in.data == out.data;
                   void* dst = st.out(out, in_place);
                   const void* src = in_place ? dst : st.in(in);
                   return ncclAllReduce(src, dst, in.count, nccl::data_type(in.type),
                                        st.reduce_op(r, g.comm), g.comm, s);
                 });
  }
  detail::task<void> all_gather(op_context ctx, const_tensor_view in, tensor_view out) {
    co_await run(ctx, "all_gather", out.bytes(),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   if (in.count == 0) return ncclSuccess;
                   return ncclAllGather(st.in(in), st.out(out), in.count,
                                        nccl::data_type(in.type), g.comm, s);
                 });
  }
  detail::task<void> reduce_scatter(op_context ctx, const_tensor_view in, tensor_view out,
                                    reducer r) {
    co_await run(ctx, "reduce_scatter", in.bytes(),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   if (out.count == 0) return ncclSuccess;
                   return ncclReduceScatter(st.in(in), st.out(out), out.count,
                                            nccl::data_type(out.type),
                                            st.reduce_op(r, g.comm), g.comm, s);
                 });
  }

  // Composed from grouped send/recv, as NCCL has no scatter, gather or
  // all-to-all of its own.
  detail::task<void> scatter(op_context ctx, const_tensor_view in, tensor_view out, int root) {
    co_await run(ctx, "scatter", std::max(in.bytes(), out.bytes()),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   const std::size_t block = out.bytes();
                   void* dst = st.out(out);
                   if (g.rank != root) return grouped(g, s, {}, {{root, dst, block}});
                   const char* src = static_cast<const char*>(st.in(in));
                   std::vector<transfer> sends;
                   for (int r = 0; r < g.size; ++r)
                     if (r != root)
                       sends.push_back({r, const_cast<char*>(src) + block * unsigned(r), block});
                   local_copy(dst, src + block * unsigned(root), block, s);
                   return grouped(g, s, sends, {});
                 });
  }
  detail::task<void> gather(op_context ctx, const_tensor_view in, tensor_view out, int root) {
    co_await run(ctx, "gather", std::max(in.bytes(), out.bytes()),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   const std::size_t block = in.bytes();
                   const void* src = st.in(in);
                   if (g.rank != root)
                     return grouped(g, s, {{root, const_cast<void*>(src), block}}, {});
                   char* dst = static_cast<char*>(st.out(out));
                   std::vector<transfer> recvs;
                   for (int r = 0; r < g.size; ++r)
                     if (r != root) recvs.push_back({r, dst + block * unsigned(r), block});
                   local_copy(dst + block * unsigned(root), src, block, s);
                   return grouped(g, s, {}, recvs);
                 });
  }
  detail::task<void> all_to_all(op_context ctx, const_tensor_view in, tensor_view out) {
    co_await run(
        ctx, "all_to_all", out.bytes(), [&](group& g, cudaStream_t s, nccl::staging& st) {
          const std::size_t block = out.bytes() / unsigned(g.size);
          char* dst = static_cast<char*>(st.out(out, in.data == out.data));
          const char* src = static_cast<const char*>(st.in(in));
          if (in.data == out.data && out.bytes()) {  // in place: send from a copy
            void* copy = st.allocate(out.bytes());
            local_copy(copy, dst, out.bytes(), s);
            src = static_cast<const char*>(copy);
          }
          std::vector<transfer> sends, recvs;
          for (int r = 0; r < g.size; ++r)
            if (r != g.rank) {
              sends.push_back({r, const_cast<char*>(src) + block * unsigned(r), block});
              recvs.push_back({r, dst + block * unsigned(r), block});
            }
          local_copy(dst + block * unsigned(g.rank), src + block * unsigned(g.rank), block, s);
          return grouped(g, s, sends, recvs);
        });
  }

  // The counts first (through device memory), then the data.
  detail::task<std::vector<std::size_t>> all_gather_v(op_context ctx, const_tensor_view in,
                                                      output_allocator alloc) {
    no_stream(ctx, "all_gather_v");
    std::int64_t mine = static_cast<std::int64_t>(in.count);
    std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.group->size()));
    co_await all_gather(ctx, view(std::span<const std::int64_t>(&mine, 1)), mutable_view(all));
    std::vector<std::size_t> counts(all.begin(), all.end());
    tensor_view out = alloc(counts);
    const std::size_t element = size_of(in.type);
    co_await run(ctx, "all_gather_v", out.bytes(),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   const void* src = st.in(in);
                   char* dst = static_cast<char*>(st.out(out));
                   std::vector<transfer> sends, recvs;
                   std::size_t at = 0;
                   for (int r = 0; r < g.size; ++r) {
                     const std::size_t bytes = counts[unsigned(r)] * element;
                     if (r == g.rank)
                       local_copy(dst + at, src, bytes, s);
                     else {
                       sends.push_back({r, const_cast<void*>(src), in.bytes()});
                       recvs.push_back({r, dst + at, bytes});
                     }
                     at += bytes;
                   }
                   return grouped(g, s, sends, recvs);
                 });
    co_return counts;
  }
  detail::task<std::vector<std::size_t>> all_to_all_v(op_context ctx, const_tensor_view in,
                                                      std::vector<std::size_t> send_counts,
                                                      output_allocator alloc) {
    no_stream(ctx, "all_to_all_v");
    std::vector<std::int64_t> sending(send_counts.begin(), send_counts.end());
    std::vector<std::int64_t> coming(sending.size());
    co_await all_to_all(ctx, view(sending), mutable_view(coming));
    std::vector<std::size_t> counts(coming.begin(), coming.end());
    tensor_view out = alloc(counts);
    const std::size_t element = size_of(in.type);
    co_await run(ctx, "all_to_all_v", std::max(in.bytes(), out.bytes()),
                 [&](group& g, cudaStream_t s, nccl::staging& st) {
                   const char* src = static_cast<const char*>(st.in(in));
                   char* dst = static_cast<char*>(st.out(out));
                   std::vector<transfer> sends, recvs;
                   std::size_t from = 0, to = 0;
                   for (int r = 0; r < g.size; ++r) {
                     const std::size_t out_bytes = send_counts[unsigned(r)] * element;
                     const std::size_t in_bytes = counts[unsigned(r)] * element;
                     if (r == g.rank) {
                       if (out_bytes != in_bytes)
                         throw_error(errc::mismatch,
                                     {.operation = "all_to_all_v",
                                      .rank = rank_,
                                      .detail = "this rank's count to itself changed"});
                       local_copy(dst + to, src + from, in_bytes, s);
                     } else {
                       sends.push_back({r, const_cast<char*>(src) + from, out_bytes});
                       recvs.push_back({r, dst + to, in_bytes});
                     }
                     from += out_bytes;
                     to += in_bytes;
                   }
                   return grouped(g, s, sends, recvs);
                 });
    co_return counts;
  }

 private:
  // One NCCL communicator: the world's or a group's.
  struct group {
    std::uint64_t id = 0;
    std::string name;
    int rank = 0;
    int size = 0;
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;  // the awaited form's
    // Where the host functions that wake waiting operations queue, each
    // behind its operation's event only (not behind later operations).
    cudaStream_t waker = nullptr;
    float* scratch = nullptr;  // barrier's element
    // The turnstile that issues this communicator's calls in start order.
    std::uint64_t next_ticket = 0;
    std::uint64_t serving = 0;
    nccl::completion_estimate estimate;  // of the awaited form's waits
  };

  // A byte range to or from a group rank.
  struct transfer {
    int peer;
    void* data;
    std::size_t bytes;
  };

  nccl_backend(asio::any_io_executor ex, int rank, int world, int device, options o)
      : ex_(std::move(ex)), rank_(rank), world_(world), device_(device), o_(o) {}

  group& add_group(std::uint64_t id, std::string name, int rank, int size) {
    auto g = std::make_unique<group>();
    g->id = id;
    g->name = std::move(name);
    g->rank = rank;
    g->size = size;
    cuda::device_guard on(device_);
    // A blocking stream: ordered after the legacy default stream's work, so
    // that tensors filled there are ready when the collective starts.
    cuda::check(cudaStreamCreate(&g->stream), "cudaStreamCreate");
    if (auto e = cudaStreamCreateWithFlags(&g->waker, cudaStreamNonBlocking); e != cudaSuccess) {
      (void)cudaStreamDestroy(g->stream);
      cuda::check(e, "cudaStreamCreateWithFlags");
    }
    void* p = nullptr;
    if (cudaMalloc(&p, sizeof(float)) != cudaSuccess) {
      (void)cudaStreamDestroy(g->stream);
      (void)cudaStreamDestroy(g->waker);
      cuda::check(cudaGetLastError(), "cudaMalloc of the barrier's element");
    }
    g->scratch = static_cast<float*>(p);
    auto& ref = *g;
    groups_[id] = std::move(g);
    return ref;
  }

  group& find_group(const op_context& ctx, const char* operation) {
    const std::uint64_t id = ctx.group ? ctx.group->id : 0;
    auto it = groups_.find(id);
    if (it == groups_.end())
      throw_error(errc::invalid_argument,
                  {.operation = operation,
                   .rank = rank_,
                   .detail = "no NCCL communicator for " +
                             (ctx.group ? ctx.group->name : std::string("this group"))});
    return *it->second;
  }

  [[noreturn]] void fail(ncclResult_t r, const std::string& what, ncclComm_t comm) const {
    throw_error(nccl::error_for(r),
                {.operation = what, .rank = rank_, .detail = nccl::describe(r, comm)});
  }
  void nccl_check(ncclResult_t r, const std::string& what, ncclComm_t comm) const {
    if (r != ncclSuccess) fail(r, what, comm);
  }
  static std::exception_ptr make_error(errc e, error_context c) {
    return std::make_exception_ptr(error(e, std::move(c)));
  }
  void check_alive() const {
    if (failure_) std::rethrow_exception(failure_);
  }
  static void check_tag(const op_context& ctx, const char* operation) {
    if (ctx.seq != 0)
      throw_error(errc::invalid_argument,
                  {.operation = operation,
                   .seen = "tag " + std::to_string(static_cast<std::int64_t>(ctx.seq)),
                   .detail = "NCCL matches send and recv in order per pair of ranks; tags other "
                             "than 0 are not supported"});
  }
  static void no_stream(const op_context& ctx, const char* operation) {
    if (ctx.stream)
      throw_error(errc::invalid_argument,
                  {.operation = operation,
                   .detail = "the counts are needed on the host before the data moves, so it "
                             "cannot be stream-ordered; leave op_options::stream null"});
  }

  void local_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t s) const {
    if (bytes == 0 || dst == src) return;
    cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync device to device");
  }
  // Byte transfers as one NCCL group (sends and receives to many peers
  // proceed together and cannot deadlock on each other).
  ncclResult_t grouped(group& g, cudaStream_t s, const std::vector<transfer>& sends,
                       const std::vector<transfer>& recvs) const {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (auto& t : sends)
      if (t.bytes && r == ncclSuccess) r = ncclSend(t.data, t.bytes, ncclUint8, t.peer, g.comm, s);
    for (auto& t : recvs)
      if (t.bytes && r == ncclSuccess) r = ncclRecv(t.data, t.bytes, ncclUint8, t.peer, g.comm, s);
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  }

  // Sleeps on a timer that abort_all can cut short.
  detail::task<void> nap(detail::clock::time_point until) {
    asio::steady_timer t(ex_, until);
    sleepers_.push_back(&t);
    co_await t.async_wait(detail::use_task);
    std::erase(sleepers_, &t);
  }

  // Waits for this operation's turn on g's communicator.
  detail::task<void> take_turn(group& g, std::uint64_t ticket, const op_context& ctx,
                               const char* operation) {
    while (g.serving != ticket) {
      check_alive();
      if (detail::clock::now() >= ctx.deadline) timeout(g, ctx, operation, "waiting for its turn");
      co_await nap(std::min(ctx.deadline, detail::clock::now() + std::chrono::milliseconds(1)));
    }
  }
  void end_turn(group& g) {
    ++g.serving;
    for (auto* t : sleepers_) t->cancel();  // the next in line re-checks at once
  }

  // Until g's communicator has no call in progress (a non-blocking
  // communicator being made, or an enqueue NCCL finishes in the background).
  detail::task<void> settle(group& g, const op_context& ctx, const char* operation) {
    const auto spin_until = detail::clock::now() + o_.spin;
    for (auto pause = std::chrono::microseconds(50);;) {
      check_alive();
      if (!g.comm)
        throw_error(errc::aborted, {.operation = operation,
                                    .rank = rank_,
                                    .detail = "the NCCL communicator of " + g.name + " is gone"});
      if (async_state(g, operation) == ncclSuccess) co_return;
      const auto now = detail::clock::now();
      if (now >= ctx.deadline) timeout(g, ctx, operation, "NCCL was still busy");
      // Every call on a non-blocking communicator is enqueued by a thread
      // NCCL starts for it, usually done within microseconds: poll before
      // sleeping.
      if (now < spin_until) continue;
      co_await nap(std::min(ctx.deadline, now + pause));
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(5));
    }
  }

  // NCCL's asynchronous state of g (ncclSuccess or ncclInProgress); an
  // error aborts every communicator and is thrown, naming the operation.
  ncclResult_t async_state(group& g, const char* operation) {
    ncclResult_t state = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(g.comm, &state), "ncclCommGetAsyncError", g.comm);
    if (state == ncclSuccess || state == ncclInProgress) return state;
    auto e = make_error(nccl::error_for(state),
                        {.operation = operation,
                         .rank = rank_,
                         .detail = g.name + ": " + nccl::describe(state, g.comm)});
    abort_all(e);
    std::rethrow_exception(e);
  }

  [[noreturn]] void timeout(group& g, const op_context& ctx, const char* operation,
                            const std::string& where) {
    auto e = make_error(errc::timeout,
                        {.operation = std::string(operation) + " #" + std::to_string(ctx.seq),
                         .rank = rank_,
                         .peers = g.name,
                         .detail = "the deadline passed (" + where +
                                   "); every NCCL communicator of this rank is aborted"});
    abort_all(e);
    std::rethrow_exception(e);
  }

  // Issues the operation's NCCL calls in its turn and records an event
  // behind them, then waits for the GPU to pass it (or, stream-ordered,
  // leaves a watcher that aborts on the deadline).
  template <class Enqueue>
  detail::task<void> run(const op_context& ctx, const char* operation, std::size_t bytes,
                         Enqueue enqueue) {
    check_alive();
    group& g = find_group(ctx, operation);
    const std::uint64_t ticket = g.next_ticket++;
    cudaStream_t s = ctx.stream ? ctx.stream : g.stream;
    nccl::staging st(pinned_, s, !ctx.stream);
    co_await take_turn(g, ticket, ctx, operation);
    pooled_event ev(*this);
    {
      struct turn {
        nccl_backend& b;
        group& g;
        ~turn() { b.end_turn(g); }
      } holding{*this, g};
      co_await settle(g, ctx, operation);
      ncclResult_t r = ncclSuccess;
      {
        cuda::device_guard on(device_);
        r = enqueue(g, s, st);
      }
      if (r != ncclSuccess && r != ncclInProgress) fail(r, operation, g.comm);
      // Until NCCL has put its kernels on the stream, nothing may follow them.
      if (r == ncclInProgress) co_await settle(g, ctx, operation);
      cuda::device_guard on(device_);
      st.finish();
      ev.event = take_event();
      cuda::check(cudaEventRecord(ev.event, s), "cudaEventRecord");
    }
    if (ctx.stream) {
      detail::start(
          ex_, watch(shared_from_this(), std::exchange(ev.event, nullptr), g.id, ctx, operation),
          [](std::exception_ptr) {});
      co_return;
    }
    co_await wait_gpu(ev.event, g, ctx, operation, bytes);
    st.copy_back();
  }

  // An event from the pool, given back when the operation is done with it.
  struct pooled_event {
    nccl_backend& b;
    cudaEvent_t event;
    explicit pooled_event(nccl_backend& backend, cudaEvent_t e = nullptr) : b(backend), event(e) {}
    pooled_event(const pooled_event&) = delete;
    pooled_event& operator=(const pooled_event&) = delete;
    ~pooled_event() {
      if (event) b.give_event(event);
    }
  };
  cudaEvent_t take_event() {
    if (!events_.empty()) {
      cudaEvent_t e = events_.back();
      events_.pop_back();
      return e;
    }
    cuda::device_guard on(device_);
    cudaEvent_t e = nullptr;
    cuda::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return e;
  }
  // Re-recording an event that the GPU has not passed yet is fine: a wait
  // on it already issued keeps the work it was recorded behind.
  void give_event(cudaEvent_t e) {
    if (released_)
      (void)cudaEventDestroy(e);
    else
      events_.push_back(e);
  }

  // Until the GPU has passed `ev`: asleep through most of the typical
  // duration of such an operation (completion_estimate), polled for the
  // rest or for options::spin, then asleep until a host function queued
  // behind the event on the group's waker stream wakes it, and at every
  // poll_interval to check NCCL's asynchronous error and the deadline.
  detail::task<void> wait_gpu(cudaEvent_t ev, group& g, const op_context& ctx,
                              const char* operation, std::size_t bytes) {
    const auto start = detail::clock::now();
    detail::clock::duration poll = o_.spin;
    if (o_.spin > detail::clock::duration::zero()) {
      if (auto sleep = g.estimate.sleep_for(operation, bytes); sleep > sleep.zero()) {
        // Other operations' turns cut naps short: sleep on to the time.
        for (const auto until = std::min(ctx.deadline, start + sleep); detail::clock::now() < until;) {
          co_await nap(until);
          check_alive();
        }
        if (nccl::passed(ev)) {
          g.estimate.overslept(operation, bytes);
          co_return;
        }
      }
      poll = g.estimate.poll_for(operation, bytes, o_.spin);
    }
    for (const auto poll_until = detail::clock::now() + poll;;) {
      if (nccl::passed(ev)) {
        if (o_.spin > detail::clock::duration::zero())
          g.estimate.finished(operation, bytes, detail::clock::now() - start);
        co_return;
      }
      if (detail::clock::now() >= poll_until) break;
    }
    check_alive();  // the waker stream exists until the backend is released
    asio::steady_timer timer(ex_);
    auto wake = std::make_shared<nccl::gpu_wake>();
    wake->executor = ex_;
    wake->waiter = &timer;
    struct unhook {
      nccl::gpu_wake& d;
      ~unhook() { d.waiter = nullptr; }
    } guard{*wake};
    {
      cuda::device_guard on(device_);
      nccl::wake_when_passed(g.waker, ev, wake);
    }
    co_await sleep_until_passed(ev, g, ctx, operation, timer);
    // Late by the wake-up: overslept() brings the estimate back.
    if (o_.spin > detail::clock::duration::zero())
      g.estimate.finished(operation, bytes, detail::clock::now() - start);
  }

  detail::task<void> sleep_until_passed(cudaEvent_t ev, group& g, const op_context& ctx,
                                        const char* operation, asio::steady_timer& timer) {
    sleepers_.push_back(&timer);
    struct unhook {
      nccl_backend& b;
      asio::steady_timer& t;
      ~unhook() { std::erase(b.sleepers_, &t); }
    } guard{*this, timer};
    while (!nccl::passed(ev)) {
      check_alive();
      if (g.comm) async_state(g, operation);
      const auto now = detail::clock::now();
      if (now >= ctx.deadline) timeout(g, ctx, operation, "waiting for the GPU");
      timer.expires_at(std::min(ctx.deadline, now + o_.poll_interval));
      co_await timer.async_wait(detail::use_task);
    }
  }

  // A stream-ordered operation's deadline, checked every poll_interval
  // without adding anything to the stream: failures surface in the next
  // operation, as the communicator is aborted.
  static detail::task<void> watch(std::shared_ptr<nccl_backend> self, cudaEvent_t ev,
                                  std::uint64_t group_id, op_context ctx, const char* operation) {
    pooled_event held(*self, ev);
    auto it = self->groups_.find(group_id);
    if (it == self->groups_.end()) co_return;
    asio::steady_timer timer(self->ex_);
    try {
      co_await self->sleep_until_passed(ev, *it->second, ctx, operation, timer);
    } catch (...) {
      // Recorded by abort_all for every later operation.
    }
  }

  // On the executor, before any later operation starts: the child's
  // group, holding its first turn, and the parent's turn for the split.
  void start_split(std::uint64_t parent_id, detail::clock::time_point deadline,
                   const std::shared_ptr<group_state>& child, int color, int key) {
    auto pit = groups_.find(parent_id);
    if (pit == groups_.end()) return;  // the parent's own split failed: all has failed
    group& parent = *pit->second;
    group* made = nullptr;
    if (child) {
      try {
        made = &add_group(child->id, child->name, child->rank, child->size());
      } catch (...) {
        abort_all(std::current_exception());
        return;
      }
      ++made->next_ticket;  // ticket 0: its operations wait for the split
    }
    const std::uint64_t ticket = parent.next_ticket++;
    detail::start(ex_, split(shared_from_this(), parent, made, ticket, deadline, color, key),
                  [](std::exception_ptr) {});
  }

  static detail::task<void> split(std::shared_ptr<nccl_backend> self, group& parent, group* made,
                                  std::uint64_t ticket, detail::clock::time_point deadline, int color,
                                  int key) {
    op_context ctx{.deadline = deadline};
    try {
      co_await self->take_turn(parent, ticket, ctx, "ncclCommSplit");
      struct turn {
        nccl_backend& b;
        group& g;
        ~turn() { b.end_turn(g); }
      } holding{*self, parent};
      co_await self->settle(parent, ctx, "ncclCommSplit");
      // A non-blocking split returns at once; NCCL's thread writes the new
      // communicator (null for NCCL_SPLIT_NOCOLOR) into *slot when it is
      // made, and the parent is busy until then. The slot outlives this
      // frame: freed once the parent has settled, left behind if it never
      // does (the split was aborted, and NCCL may still write).
      auto* slot = new ncclComm_t(nullptr);
      {
        cuda::device_guard on(self->device_);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        const auto r =
            ncclCommSplit(parent.comm, made ? color : NCCL_SPLIT_NOCOLOR, key, slot, &config);
        if (r != ncclSuccess && r != ncclInProgress) {
          delete slot;  // NCCL has given up on it
          self->fail(r, "ncclCommSplit of " + parent.name, parent.comm);
        }
      }
      co_await self->settle(parent, ctx, "ncclCommSplit");
      ncclComm_t comm = std::atomic_ref<ncclComm_t>(*slot).load(std::memory_order_acquire);
      delete slot;
      if (made) {
        if (!comm)
          throw_error(
              errc::device_error,
              {.operation = "ncclCommSplit of " + parent.name,
               .rank = self->rank_,
               .detail = "NCCL finished the split without a communicator for " + made->name});
        made->comm = comm;
      }
    } catch (...) {
      self->abort_all(std::current_exception());
    }
    if (made) self->end_turn(*made);  // its first operation settles the new communicator
  }

  // Aborts every communicator, so that no GPU work waits on a peer any
  // longer, and fails what is pending and what comes later with `why`.
  void abort_all(std::exception_ptr why) {
    if (!failure_) failure_ = std::move(why);
    for (auto& [id, g] : groups_)
      if (g->comm) {
        (void)ncclCommAbort(g->comm);
        g->comm = nullptr;
      }
    for (auto* t : sleepers_) t->cancel();
  }

  // close() (graceful) or the destructor (abort): communicators, streams
  // and the barrier's elements go.
  void release(bool abort) {
    if (released_) return;
    released_ = true;
    if (!failure_)
      failure_ = make_error(
          errc::closed,
          {.operation = "nccl_backend", .rank = rank_, .detail = "the communicator was closed"});
    int previous = 0;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    for (auto& [id, g] : groups_) {
      if (g->comm) {
        bool finished = false;
        if (!abort && ncclCommFinalize(g->comm) == ncclSuccess) {
          const auto until = detail::clock::now() + std::chrono::seconds(10);
          ncclResult_t state = ncclInProgress;
          while (ncclCommGetAsyncError(g->comm, &state) == ncclSuccess && state == ncclInProgress &&
                 detail::clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          finished = state == ncclSuccess;
        }
        if (finished)
          (void)ncclCommDestroy(g->comm);
        else
          (void)ncclCommAbort(g->comm);
        g->comm = nullptr;
      }
      // Its host functions have run once the stream is drained.
      for (cudaStream_t* st : {&g->stream, &g->waker})
        if (*st) {
          (void)cudaStreamSynchronize(*st);
          (void)cudaStreamDestroy(*st);
          *st = nullptr;
        }
      if (g->scratch) (void)cudaFree(g->scratch);
      g->scratch = nullptr;
    }
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    events_.clear();
    if (switched) (void)cudaSetDevice(previous);
    for (auto* t : sleepers_) t->cancel();
  }

  asio::any_io_executor ex_;
  int rank_;
  int world_;
  int device_;
  options o_;
  std::map<std::uint64_t, std::unique_ptr<group>> groups_;  // by group_state::id
  // Page-locked blocks for staging: CUDA copies from and to them without
  // waiting on the stream (from pageable memory it may wait for the stream's
  // earlier work, which can wait on peers, stalling the executor).
  detail::pinned_blocks pinned_;
  std::vector<asio::steady_timer*> sleepers_;  // timers abort_all cuts short
  std::vector<cudaEvent_t> events_;            // recorded behind operations, reused
  std::exception_ptr failure_;                 // set: every operation fails with it
  bool released_ = false;
};

static_assert(backend<nccl_backend>);

}  // namespace dcomm
