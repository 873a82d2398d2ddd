// The NCCL backend: communicator<nccl_backend> runs every collective and
// send/recv on this rank's GPU through NCCL, behind the same front end as the
// CPU backend, so a training loop moves to the GPU by changing one type:
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
//
// Where things are: this header is the backend's surface (what it promises,
// with its doc comments, and the state it keeps). The machinery is in
// dcomm/nccl/, namespace dcomm::nccl: types.hpp (dtypes, ops and errors in
// NCCL's terms, the default GPU), completion_estimate.hpp (how long a wait
// usually takes), staging.hpp (host data through device memory), wait.hpp
// (how a wait for the GPU ends); and, in Asio's style, the member
// functions' bodies in dcomm/nccl/impl/: communicators.hpp (making,
// splitting, aborting and closing NCCL communicators), issue.hpp (an
// operation's turn, its NCCL calls and its event), wait.hpp (waiting for the
// GPU) and operations.hpp (the checks, collectives and send/recv). Include
// this header, not those.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cuda.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/error.hpp"
#include "dcomm/nccl/completion_estimate.hpp"
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
  DCOMM_EMIT_ON_USE static asio::awaitable<std::shared_ptr<nccl_backend>> create(
      std::shared_ptr<store> s, int rank, int world, std::string job_token, std::string store_host,
      options o, detail::clock::time_point deadline);

  nccl_backend(const nccl_backend&) = delete;
  nccl_backend& operator=(const nccl_backend&) = delete;
  ~nccl_backend() { release(true); }

  const asio::any_io_executor& get_executor() const { return ex_; }
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
  void abort();
  // The last communicator handle is gone: finalize and destroy the NCCL
  // communicators (abort those that do not finish within 10 s).
  void close(std::function<void()> closed = {});

  // This rank's GPU only; every dtype of dcomm is one NCCL carries.
  // NCCL picks its algorithms itself (NCCL_ALGO tunes them): a call may
  // not ask for one of dcomm's.
  static void check_algorithm(operation op, algorithm a);
  void check_tensor(const const_tensor_view& v, const char* operation) const;

  // ncclCommSplit of the parent's communicator, issued in the parent's
  // order; the child's operations wait for it.
  void group_created(const std::shared_ptr<group_state>& parent,
                     const std::shared_ptr<group_state>& child, int color, int key);

  // Empty buffers: nothing is handed to NCCL (it may refuse the null
  // pointer of an empty device buffer), and the operation still completes
  // in its place in the stream. Ranks that disagree on emptiness are a size
  // mismatch, which NCCL cannot see: the non-empty ones reach the deadline.

  // --- point to point: matched in order per pair of ranks ---
  DCOMM_EMIT_ON_USE detail::task<void> send(op_context ctx, const_tensor_view in, int peer);
  DCOMM_EMIT_ON_USE detail::task<void> recv(op_context ctx, tensor_view out, int peer);

  // --- collectives ---
  // barrier: an all_reduce of one element.
  DCOMM_EMIT_ON_USE detail::task<void> barrier(op_context ctx);
  DCOMM_EMIT_ON_USE detail::task<void> broadcast(op_context ctx, tensor_view buf, int root);
  DCOMM_EMIT_ON_USE detail::task<void> reduce(op_context ctx, const_tensor_view in, tensor_view out,
                                              reducer r, int root);
  DCOMM_EMIT_ON_USE detail::task<void> all_reduce(op_context ctx, const_tensor_view in,
                                                  tensor_view out, reducer r);
  DCOMM_EMIT_ON_USE detail::task<void> all_gather(op_context ctx, const_tensor_view in,
                                                  tensor_view out);
  DCOMM_EMIT_ON_USE detail::task<void> reduce_scatter(op_context ctx, const_tensor_view in,
                                                      tensor_view out, reducer r);

  // Composed from grouped send/recv, as NCCL has no scatter, gather or
  // all-to-all of its own.
  DCOMM_EMIT_ON_USE detail::task<void> scatter(op_context ctx, const_tensor_view in,
                                               tensor_view out, int root);
  DCOMM_EMIT_ON_USE detail::task<void> gather(op_context ctx, const_tensor_view in, tensor_view out,
                                              int root);
  DCOMM_EMIT_ON_USE detail::task<void> all_to_all(op_context ctx, const_tensor_view in,
                                                  tensor_view out);

  // The counts first (through device memory), then the data. Not
  // stream-ordered: the counts are needed on the host.
  DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> all_gather_v(op_context ctx,
                                                                        const_tensor_view in,
                                                                        output_allocator alloc);
  DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> all_to_all_v(
      op_context ctx, const_tensor_view in, std::vector<std::size_t> send_counts,
      output_allocator alloc);

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

  // --- making and ending NCCL communicators (nccl/impl/communicators.hpp) ---
  // A group's NCCL state without its communicator: its streams and the
  // barrier's element, on this rank's GPU.
  group& add_group(std::uint64_t id, std::string name, int rank, int size);
  // The group of the operation; errc::invalid_argument if it has none.
  group& find_group(const op_context& ctx, const char* operation);
  // On the executor, before any later operation starts: the child's
  // group, holding its first turn, and the parent's turn for the split.
  void start_split(std::uint64_t parent_id, detail::clock::time_point deadline,
                   const std::shared_ptr<group_state>& child, int color, int key);
  // ncclCommSplit in the parent's turn; the child's first turn ends with it.
  DCOMM_EMIT_ON_USE static detail::task<void> split(std::shared_ptr<nccl_backend> self,
                                                    group& parent, group* made,
                                                    std::uint64_t ticket,
                                                    detail::clock::time_point deadline, int color,
                                                    int key);
  // Aborts every communicator, so that no GPU work waits on a peer any
  // longer, and fails what is pending and what comes later with `why`.
  void abort_all(std::exception_ptr why);
  // close() (graceful) or the destructor (abort): communicators, streams
  // and the barrier's elements go.
  void release(bool abort);

  // --- issuing an operation (nccl/impl/issue.hpp) ---
  // Issues the operation's NCCL calls in its turn and records an event
  // behind them, then waits for the GPU to pass it (or, stream-ordered,
  // leaves a watcher that aborts on the deadline). `enqueue(group&,
  // cudaStream_t, nccl::staging&)` makes the NCCL calls and returns NCCL's
  // result. Errors name ctx.operation, the call as the user made it.
  template <class Enqueue>
  detail::task<void> run(const op_context& ctx, std::size_t bytes, Enqueue enqueue);
  // Waits for this operation's turn on g's communicator.
  DCOMM_EMIT_ON_USE detail::task<void> take_turn(group& g, std::uint64_t ticket,
                                                 const op_context& ctx, const char* operation);
  void end_turn(group& g);
  // Until g's communicator has no call in progress (a non-blocking
  // communicator being made, or an enqueue NCCL finishes in the background).
  DCOMM_EMIT_ON_USE detail::task<void> settle(group& g, const op_context& ctx,
                                              const char* operation);
  // NCCL's asynchronous state of g (ncclSuccess or ncclInProgress); an
  // error aborts every communicator and is thrown, naming the operation.
  ncclResult_t async_state(group& g, const char* operation);
  // errc::timeout naming the operation, its sequence number and the group,
  // after aborting every communicator; `where`: what it was waiting for.
  [[noreturn]] void timeout(group& g, const op_context& ctx, const char* operation,
                            const std::string& where);
  // Sleeps on a timer that abort_all can cut short.
  DCOMM_EMIT_ON_USE detail::task<void> nap(detail::clock::time_point until);
  [[noreturn]] void fail(ncclResult_t r, const std::string& what, ncclComm_t comm) const;
  void nccl_check(ncclResult_t r, const std::string& what, ncclComm_t comm) const {
    if (r != ncclSuccess) fail(r, what, comm);
  }
  static std::exception_ptr make_error(errc e, error_context c) {
    return std::make_exception_ptr(error(e, std::move(c)));
  }
  void check_alive() const {
    if (failure_) std::rethrow_exception(failure_);
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
  cudaEvent_t take_event();
  // Re-recording an event that the GPU has not passed yet is fine: a wait
  // on it already issued keeps the work it was recorded behind.
  void give_event(cudaEvent_t e);

  // --- waiting for the GPU (nccl/impl/wait.hpp) ---
  // Until the GPU has passed `ev`: asleep through most of the typical
  // duration of such an operation (completion_estimate), polled for the
  // rest or for options::spin, then asleep until a host function queued
  // behind the event on the group's waker stream wakes it, and at every
  // poll_interval to check NCCL's asynchronous error and the deadline.
  DCOMM_EMIT_ON_USE detail::task<void> wait_gpu(cudaEvent_t ev, group& g, const op_context& ctx,
                                                const char* operation, std::size_t bytes);
  // The last part of wait_gpu, and watch's: asleep on `timer` (woken by the
  // host function, by abort_all, or every poll_interval) until `ev` is
  // passed, failing on NCCL's asynchronous error or the deadline.
  DCOMM_EMIT_ON_USE detail::task<void> sleep_until_passed(cudaEvent_t ev, group& g,
                                                          const op_context& ctx,
                                                          const char* operation,
                                                          asio::steady_timer& timer);
  // A stream-ordered operation's deadline, checked every poll_interval
  // without adding anything to the stream: failures surface in the next
  // operation, as the communicator is aborted.
  DCOMM_EMIT_ON_USE static detail::task<void> watch(std::shared_ptr<nccl_backend> self,
                                                    cudaEvent_t ev, std::uint64_t group_id,
                                                    op_context ctx, const char* operation);

  // --- the operations' helpers (nccl/impl/operations.hpp) ---
  static void check_tag(const op_context& ctx);
  static void no_stream(const op_context& ctx);
  void local_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t s) const;
  // Byte transfers as one NCCL group (sends and receives to many peers
  // proceed together and cannot deadlock on each other).
  ncclResult_t grouped(group& g, cudaStream_t s, const std::vector<transfer>& sends,
                       const std::vector<transfer>& recvs) const;

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

}  // namespace dcomm

#include "dcomm/nccl/impl/communicators.hpp"
#include "dcomm/nccl/impl/issue.hpp"
#include "dcomm/nccl/impl/operations.hpp"
#include "dcomm/nccl/impl/wait.hpp"

namespace dcomm {
static_assert(backend<nccl_backend>);
}  // namespace dcomm
