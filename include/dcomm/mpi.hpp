// The MPI backend: communicator<mpi_backend> runs every operation through
// the MPI library the job was started with (mpirun, srun), behind the same
// front end as the CPU and NCCL backends:
//
//   // mpirun -np 3 ./prog
//   auto comm = dcomm::init_process_group<dcomm::mpi_backend>({});  // rank, world: MPI's
//   comm.all_reduce(grads, dcomm::avg, dcomm::blocking);
//   co_await comm.all_reduce(grads, dcomm::sum);   // in a coroutine
//
// How it works:
// - Start-up needs no store: rank and world size are MPI_COMM_WORLD's (or
//   those of options::comm, a communicator of the program's). dcomm calls
//   MPI_Init_thread if the program has not (asking MPI_THREAD_MULTIPLE,
//   needing at least MPI_THREAD_SERIALIZED: every MPI call of dcomm's is
//   made on the backend's executor, one at a time) and MPI_Finalize at
//   exit (the blocking init_process_group initialises MPI on the calling
//   thread, which should then be the one that exits). A group is an MPI
//   communicator made with MPI_Comm_split.
// - Every operation is one of MPI's non-blocking calls (MPI_Isend,
//   MPI_Iallreduce, ...), then tested on the backend's executor; except
//   that all_reduce and barrier are dcomm's own over MPI_Isend/MPI_Irecv
//   where Open MPI's non-blocking collective is slower than the messages
//   it needs (mpi/impl/all_reduce.hpp: recursive doubling for small
//   ones and the barrier, a ring for large ones). MPI moves
//   data only inside its calls (Open MPI's shared memory transport, a
//   rendezvous), so a pending operation is tested without pause for
//   options::spin, then between the executor's other handlers (each test
//   a turn of the executor; where the host's ranks outnumber its cores,
//   with a sched_yield) for options::busy_poll, and only then asleep on a
//   timer at growing intervals up to options::poll_interval: a long wait
//   for a late peer costs no core. No thread spins while nothing is
//   pending, and the executor is never blocked.
// - fp16 and bf16 travel as 16-bit words and are reduced by dcomm (float
//   accumulation, as on the CPU backend), as are custom functors: through
//   a user op (mpi/types.hpp). avg and premul_sum are MPI's sum, finished
//   here.
// - Deadlines: an operation past its deadline fails with errc::timeout
//   naming it. MPI cannot cancel a collective or a send, so the backend
//   then fails every later operation with errc::aborted; the timed-out
//   call's buffers stay MPI's (do not free them), and at exit dcomm ends
//   the job with MPI_Abort instead of MPI_Finalize (which could wait on
//   the peers for ever). A receive that times out is cancelled
//   (MPI_Cancel) and leaves the backend usable.
// - Mismatches: a receive checks the size that arrived (a larger message
//   is MPI's truncation error, a smaller one dcomm's check): both fail with
//   errc::mismatch naming the sender. Not its dtype: a message is bytes
//   (MPI_BYTE), and MPI libraries do not compare datatypes anyway. MPI
//   does not check that ranks make the same collective call (a small
//   all_reduce's size is checked: every rank fails with
//   errc::mismatch); options::check_calls (or
//   DCOMM_MPI_CHECK_CALLS=1) makes every collective first compare its
//   signature across the group (one MPI_Allreduce of two words), failing
//   every rank with errc::mismatch where they differ.
//
// Where things are: this header is the surface; mpi/types.hpp holds
// dtypes and reductions in MPI's terms, mpi/impl/backend.hpp the member
// functions' bodies (start-up, groups, waiting) and
// mpi/impl/operations.hpp the operations. Include this header.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/error.hpp"
#include "dcomm/mpi/types.hpp"

namespace dcomm {

class mpi_backend : public std::enable_shared_from_this<mpi_backend> {
 public:
  static constexpr std::string_view name = "mpi";
  static constexpr bool supports_custom_reduce = true;
  static constexpr bool supports_bitwise_reduce = true;
  static constexpr bool supports_streams = false;
  // init_process_group makes it with create_world (no store, no
  // init_method: MPI's launcher did that).
  static constexpr bool joins_without_store = true;

  struct options {
    // The communicator whose ranks form dcomm's world (duplicated: dcomm's
    // traffic never matches the program's); MPI_COMM_NULL: MPI_COMM_WORLD.
    MPI_Comm comm = MPI_COMM_NULL;
    // How long an operation tests MPI without pause, then between the
    // executor's other handlers, before it sleeps between tests.
    std::chrono::microseconds spin = std::chrono::microseconds(20);
    std::chrono::microseconds busy_poll = std::chrono::microseconds(100000);
    // The longest sleep between tests of a pending operation.
    std::chrono::microseconds poll_interval = std::chrono::microseconds(1000);
    // Every collective first checks that the group's ranks make the same
    // call (see above); $DCOMM_MPI_CHECK_CALLS=1 turns it on too.
    bool check_calls = false;
    // An all_reduce of up to this many bytes (at most 1 MiB) is recursive
    // doubling over MPI_Isend/MPI_Irecv (mpi/impl/all_reduce.hpp)
    // instead of MPI_Iallreduce, which sets up a schedule per call and
    // takes twice an exchange of messages (docs/performance.md, "Figures
    // behind the code"). 0: always MPI's. $DCOMM_MPI_P2P_ALL_REDUCE_LIMIT
    // sets it too.
    std::size_t p2p_all_reduce_limit = 16 * 1024;
    // A larger all_reduce whose block per rank (its bytes / the group's
    // ranks) is at least this goes around a ring of MPI_Isend/MPI_Irecv
    // (mpi/impl/all_reduce.hpp): reduce-scatter, then all-gather;
    // smaller blocks, MPI_Iallreduce (a ring of n waits 2(n-1) times on
    // the network's latency). Open MPI 4.1's MPI_Iallreduce reduces to one
    // rank and broadcasts below 4 ranks or in place, moving the buffer
    // twice; the ring measured faster than both MPI forms (docs/performance.md,
    // "Figures behind the code"). SIZE_MAX: never. $DCOMM_MPI_RING_ALL_REDUCE_BLOCK sets it too.
    std::size_t ring_all_reduce_block = 8 * 1024;
  };

  // Initialises MPI if needed and makes the world's communicator, on (and
  // staying on) `ex`, a strand or a one-thread context.
  static std::shared_ptr<mpi_backend> create_world(asio::any_io_executor ex, options o);
  // What the blocking init_process_group calls on the caller's thread
  // before the backend's own io thread starts: MPI_Init_thread where the
  // program has not initialised MPI, so that the thread that initialised
  // MPI (MPI's "main thread", MPI_Is_thread_main) is the caller's, which
  // also calls MPI_Finalize at exit, as MPI asks.
  static void prepare_process();

  mpi_backend(const mpi_backend&) = delete;
  mpi_backend& operator=(const mpi_backend&) = delete;
  ~mpi_backend() = default;

  const asio::any_io_executor& get_executor() const { return ex_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // The world group's MPI communicator (dcomm's duplicate), for MPI calls
  // of your own on the backend's executor.
  MPI_Comm native_handle() const { return comms_.at(0).comm; }
  // "MPI_THREAD_MULTIPLE, Open MPI v4.1.4, ...": for the start-up log line.
  std::string describe() const;

  // Fails every pending operation (at its next test) and every later one
  // with errc::aborted. MPI cannot stop what it has started: end the job
  // with MPI_Abort where peers wait on this rank. Thread-safe.
  void abort();
  // The last handle went away: the groups' communicators are freed.
  void close(std::function<void()> closed = {});

  // The backend picks its algorithms itself (MPI's, tuned with MPI's own
  // parameters, e.g. OMPI_MCA_coll_tuned_*; for all_reduce and barrier
  // dcomm's over messages, set by options): a call may not ask for one.
  static void check_algorithm(operation op, algorithm a);
  // Host memory only.
  void check_tensor(const const_tensor_view& v, const char* operation) const;
  // MPI_Comm_split of the parent's communicator, in the parent's order.
  void group_created(const std::shared_ptr<group_state>& parent,
                     const std::shared_ptr<group_state>& child, int color, int key);

  // --- point to point: tags are MPI tags (0 to MPI_TAG_UB) ---
  DCOMM_EMIT_ON_USE detail::task<void> send(op_context ctx, const_tensor_view in, int peer);
  DCOMM_EMIT_ON_USE detail::task<void> recv(op_context ctx, tensor_view out, int peer);

  // --- collectives: MPI's own, one non-blocking call each ---
  DCOMM_EMIT_ON_USE detail::task<void> barrier(op_context ctx);
  DCOMM_EMIT_ON_USE detail::task<void> broadcast(op_context ctx, tensor_view buf, int root);
  DCOMM_EMIT_ON_USE detail::task<void> reduce(op_context ctx, const_tensor_view in, tensor_view out,
                                              reducer r, int root);
  DCOMM_EMIT_ON_USE detail::task<void> all_reduce(op_context ctx, const_tensor_view in,
                                                  tensor_view out, reducer r);
  DCOMM_EMIT_ON_USE detail::task<void> scatter(op_context ctx, const_tensor_view in,
                                               tensor_view out, int root);
  DCOMM_EMIT_ON_USE detail::task<void> gather(op_context ctx, const_tensor_view in, tensor_view out,
                                              int root);
  DCOMM_EMIT_ON_USE detail::task<void> all_gather(op_context ctx, const_tensor_view in,
                                                  tensor_view out);
  DCOMM_EMIT_ON_USE detail::task<void> reduce_scatter(op_context ctx, const_tensor_view in,
                                                      tensor_view out, reducer r);
  DCOMM_EMIT_ON_USE detail::task<void> all_to_all(op_context ctx, const_tensor_view in,
                                                  tensor_view out);
  // The counts first (MPI_Iallgather, MPI_Ialltoall), then the data.
  DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> all_gather_v(op_context ctx,
                                                                        const_tensor_view in,
                                                                        output_allocator alloc);
  DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> all_to_all_v(
      op_context ctx, const_tensor_view in, std::vector<std::size_t> send_counts,
      output_allocator alloc);

 private:
  mpi_backend(asio::any_io_executor ex, MPI_Comm world, options o);

  // --- mpi/impl/backend.hpp ---
  // The operation's group's communicators; errc::invalid_argument if none.
  // Errors name the call as the user made it (ctx.operation) and its number.
  const mpi::group_comms& comms_of(const op_context& ctx) const;
  MPI_Comm comm_of(const op_context& ctx) const { return comms_of(ctx).comm; }
  // Before an operation's first MPI call: a failed backend refuses it.
  void check_alive(const op_context& ctx) const;
  // Throws a dcomm::error for an MPI error code (device_error: MPI
  // failed; mismatch: it truncated a message).
  [[noreturn]] void fail(int code, const op_context& ctx, std::string peers = "") const;
  void check(int code, const op_context& ctx) const {
    if (code != MPI_SUCCESS) fail(code, ctx);
  }
  // Until the requests are complete (statuses: one per request, or null),
  // polling, then sleeping between tests; at the deadline, a timeout.
  DCOMM_EMIT_ON_USE detail::task<void> wait(MPI_Request* requests, int n, const op_context& ctx,
                                            MPI_Status* statuses = nullptr, std::string peers = "");
  // The deadline passed with `requests` pending: receives are cancelled,
  // anything else leaves the backend failed. Throws errc::timeout.
  [[noreturn]] void timed_out(MPI_Request* requests, int n, bool receives_only,
                              const op_context& ctx, const std::string& peers);
  // options::check_calls: the group's ranks compare (op, dtype, count,
  // root, reduce op) before the call.
  DCOMM_EMIT_ON_USE detail::task<void> check_signature(const op_context& ctx,
                                                       std::uint64_t signature);
  std::string group_name(const op_context& ctx) const;
  // "all_reduce #3 of group {0,1}": the call as its errors name it.
  std::string call_name(const op_context& ctx) const;
  // --- mpi/impl/all_reduce.hpp: dcomm's all_reduce over messages ---
  // (A barrier is one of nothing.)
  DCOMM_EMIT_ON_USE detail::task<void> doubling_all_reduce(op_context ctx, const_tensor_view in,
                                                           tensor_view out, reducer r);
  DCOMM_EMIT_ON_USE detail::task<void> ring_all_reduce(op_context ctx, const_tensor_view in,
                                                       tensor_view out, reducer r);

  asio::any_io_executor ex_;
  int rank_ = 0;
  int world_ = 1;
  int tag_ub_ = 32767;
  bool oversubscribed_ = false;  // more ranks on this host than cores to run them
  options o_;
  std::map<std::uint64_t, mpi::group_comms> comms_;  // by group_state::id
  class scratch_lease;
  class doubling_exchange;                       // detail::recursive_doubling over MPI's messages
  std::vector<std::vector<std::byte>> scratch_;  // all_reduce.hpp's, free
  std::atomic<bool> aborted_{false};
  std::exception_ptr failure_;  // set: every later operation fails with it
};

}  // namespace dcomm

#include "dcomm/mpi/impl/all_reduce.hpp"
#include "dcomm/mpi/impl/backend.hpp"
#include "dcomm/mpi/impl/operations.hpp"

namespace dcomm {
static_assert(backend<mpi_backend>);
}  // namespace dcomm
