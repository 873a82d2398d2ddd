// mpi_backend's start-up, groups, failures and waiting (dcomm/mpi.hpp).
#pragma once

#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/task.hpp"
#include "dcomm/mpi.hpp"

namespace dcomm {

namespace mpi {

// Whether dcomm initialised MPI (then it finalizes it at exit), and
// whether a backend failed with operations MPI still holds (then exit
// ends the job with MPI_Abort: MPI_Finalize could wait on the peers).
struct process_state {
  bool initialized_here = false;
  std::atomic<bool> stuck{false};
};
inline process_state& process() {
  static process_state s;
  return s;
}

inline void finish_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (process().stuck.load()) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Finalize();
}

// MPI's thread level, initialising MPI if the program has not.
inline int ensure_initialized() {
  int initialized = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialized);
  if (!initialized) {
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw_error(errc::device_error,
                  {.operation = "init_process_group", .detail = "MPI_Init_thread failed"});
    process().initialized_here = true;
    std::atexit(&finish_at_exit);
  } else {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
      throw_error(errc::invalid_argument,
                  {.operation = "init_process_group", .detail = "MPI was already finalized"});
    MPI_Query_thread(&provided);
  }
  return provided;
}

inline const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    default:
      return "MPI_THREAD_MULTIPLE";
  }
}

// Refuses an MPI_COMM_WORLD of 1 where the launcher started more
// processes: srun without the MPI library's PMI plugin (MPICH needs
// --mpi=pmi2, Open MPI --mpi=pmix) starts every rank as a singleton, and
// each would then train alone, its collectives succeeding on itself.
// The launcher's count: mpirun's (Open MPI), the PMI's (MPICH's hydra,
// Slurm's pmi2), srun's for this step.
inline void check_launcher_world(MPI_Comm world) {
  int size = 0;
  MPI_Comm_size(world, &size);
  if (size != 1) return;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    const char* v = std::getenv(name);
    if (!v || !*v) continue;
    const long launched = std::strtol(v, nullptr, 10);
    if (launched <= 1) return;
    throw_error(errc::mismatch,
                {.operation = "init_process_group",
                 .expected = "an MPI_COMM_WORLD of " + std::to_string(launched) + " (" + name +
                             "=" + v + ")",
                 .seen = "an MPI_COMM_WORLD of 1",
                 .detail = "the launcher started several processes but MPI sees each alone: "
                           "under srun, pass the MPI library's plugin (--mpi=pmix for Open MPI, "
                           "--mpi=pmi2 for MPICH); to run singletons on purpose, pass "
                           "options.comm = MPI_COMM_SELF"});
  }
}

// A group's communicator and the duplicate dcomm's own collectives use
// (MPI_Comm_dup: a collective of the group, made where its communicator
// is, so in the same order on every member). A failed duplicate leaves
// `own` null: the group's operations then fail (comms_of).
inline group_comms with_own_duplicate(MPI_Comm comm) {
  group_comms c{.comm = comm};
  if (MPI_Comm_dup(comm, &c.own) != MPI_SUCCESS) c.own = MPI_COMM_NULL;
  if (c.own != MPI_COMM_NULL) MPI_Comm_set_errhandler(c.own, MPI_ERRORS_RETURN);
  return c;
}

}  // namespace mpi

inline void mpi_backend::prepare_process() {
  mpi::ensure_initialized();
}

inline std::shared_ptr<mpi_backend> mpi_backend::create_world(asio::any_io_executor ex, options o) {
  const int level = mpi::ensure_initialized();
  if (level < MPI_THREAD_SERIALIZED)
    throw_error(errc::invalid_argument,
                {.operation = "init_process_group",
                 .expected = "MPI initialised with MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE",
                 .seen = mpi::thread_level_name(level),
                 .detail = "dcomm calls MPI from its executor's thread (initialise MPI with "
                           "MPI_Init_thread, or let dcomm do it)"});
  if (const char* v = std::getenv("DCOMM_MPI_CHECK_CALLS"); v && std::string(v) == "1")
    o.check_calls = true;
  if (const char* v = std::getenv("DCOMM_MPI_P2P_ALL_REDUCE_LIMIT"); v && *v)
    o.p2p_all_reduce_limit = std::strtoull(v, nullptr, 10);
  if (const char* v = std::getenv("DCOMM_MPI_RING_ALL_REDUCE_BLOCK"); v && *v)
    o.ring_all_reduce_block = std::strtoull(v, nullptr, 10);
  if (o.p2p_all_reduce_limit > mpi::max_p2p_all_reduce_limit)
    throw_error(errc::invalid_argument,
                {.operation = "init_process_group",
                 .expected = "options::p2p_all_reduce_limit of at most " +
                             std::to_string(mpi::max_p2p_all_reduce_limit) + " bytes",
                 .seen = std::to_string(o.p2p_all_reduce_limit),
                 .detail = "larger all_reduces are MPI's own (MPI_Iallreduce)"});
  if (o.comm == MPI_COMM_NULL) mpi::check_launcher_world(MPI_COMM_WORLD);
  MPI_Comm world = MPI_COMM_NULL;
  if (MPI_Comm_dup(o.comm == MPI_COMM_NULL ? MPI_COMM_WORLD : o.comm, &world) != MPI_SUCCESS)
    throw_error(errc::device_error,
                {.operation = "init_process_group", .detail = "MPI_Comm_dup failed"});
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  return std::shared_ptr<mpi_backend>(new mpi_backend(std::move(ex), world, o));
}

inline mpi_backend::mpi_backend(asio::any_io_executor ex, MPI_Comm world, options o)
    : ex_(std::move(ex)), o_(o) {
  MPI_Comm_rank(world, &rank_);
  MPI_Comm_size(world, &world_);
  void* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
  if (found && ub) tag_ub_ = *static_cast<int*>(ub);
  // The ranks of this host (a collective of the world, once) against its
  // cores (not this process's affinity: mpirun binds each rank to one).
  MPI_Comm host = MPI_COMM_NULL;
  int on_host = 1;
  if (MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host) ==
      MPI_SUCCESS) {
    MPI_Comm_size(host, &on_host);
    MPI_Comm_free(&host);
  }
  oversubscribed_ = on_host > std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  comms_[0] = mpi::with_own_duplicate(world);
}

inline std::string mpi_backend::describe() const {
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string v(version, static_cast<std::size_t>(std::max(len, 0)));
  v = v.substr(0, v.find_first_of(",\n"));
  // MPICH says "MPICH Version:\t4.0.2": one line, single spaces.
  for (char& ch : v)
    if (ch == '\t') ch = ' ';
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  return std::string(mpi::thread_level_name(level)) + ", " + v +
         (o_.check_calls ? ", calls checked" : "");
}

inline void mpi_backend::abort() {
  aborted_ = true;
  asio::dispatch(ex_, [self = shared_from_this()] {
    if (!self->failure_)
      self->failure_ = std::make_exception_ptr(
          error(errc::aborted, {.operation = "abort",
                                .rank = self->rank_,
                                .detail = "abort() was called on this rank"}));
  });
}

inline void mpi_backend::close(std::function<void()> closed) {
  asio::dispatch(ex_, [self = shared_from_this(), closed = std::move(closed)] {
    // A communicator with operations MPI still holds stays as it is.
    if (!mpi::process().stuck.load()) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      for (auto& [id, c] : self->comms_)
        for (MPI_Comm* one : {&c.comm, &c.own})
          if (!finalized && *one != MPI_COMM_NULL) MPI_Comm_free(one);
    }
    self->comms_.clear();
    if (!self->failure_)
      self->failure_ =
          std::make_exception_ptr(error(errc::closed, {.operation = "close", .rank = self->rank_}));
    if (closed) closed();
  });
}

inline void mpi_backend::check_algorithm(operation op, algorithm a) {
  if (a != algorithm::automatic)
    throw_error(errc::invalid_argument,
                {.operation = dcomm::name(op),
                 .expected = "algorithm::automatic",
                 .seen = std::string(dcomm::name(a)),
                 .detail = "the MPI backend picks its algorithms itself: MPI's (tune them "
                           "with the MPI library's parameters), and for all_reduce and barrier "
                           "dcomm's over MPI's messages (mpi_backend::options)"});
}

inline void mpi_backend::check_tensor(const const_tensor_view& v, const char* operation) const {
  if (v.device.type != device::kind::cpu)
    throw_error(errc::invalid_argument,
                {.operation = operation,
                 .expected = "a tensor in host memory",
                 .seen = "a CUDA tensor on device " + std::to_string(v.device.index),
                 .detail = "the MPI backend takes host memory; use the nccl backend for GPUs"});
}

inline void mpi_backend::group_created(const std::shared_ptr<group_state>& parent,
                                       const std::shared_ptr<group_state>& child, int color,
                                       int key) {
  // Every member of the parent calls MPI_Comm_split, in the order of the
  // parent's other calls: on the executor, where those are made.
  asio::dispatch(ex_, [self = shared_from_this(), parent_id = parent->id,
                       child_id = child ? child->id : 0, member = child != nullptr, color, key] {
    auto it = self->comms_.find(parent_id);
    if (it == self->comms_.end() || self->failure_) return;  // its operations fail then
    MPI_Comm made = MPI_COMM_NULL;
    if (MPI_Comm_split(it->second.comm, member ? color : MPI_UNDEFINED, key, &made) != MPI_SUCCESS)
      return;  // the group's operations fail: it has no communicator
    if (!member || made == MPI_COMM_NULL) return;
    MPI_Comm_set_errhandler(made, MPI_ERRORS_RETURN);
    self->comms_[child_id] = mpi::with_own_duplicate(made);
  });
}

inline std::string mpi_backend::group_name(const op_context& ctx) const {
  return ctx.group ? ctx.group->name : "the world group";
}

inline std::string mpi_backend::call_name(const op_context& ctx) const {
  return std::string(dcomm::name(ctx.operation)) + " #" + std::to_string(ctx.seq) + " of " +
         group_name(ctx);
}

inline const mpi::group_comms& mpi_backend::comms_of(const op_context& ctx) const {
  auto it = comms_.find(ctx.group ? ctx.group->id : 0);
  if (it == comms_.end() || it->second.own == MPI_COMM_NULL)
    throw_error(errc::invalid_argument,
                {.operation = dcomm::name(ctx.operation),
                 .rank = rank_,
                 .detail = group_name(ctx) + " has no MPI communicator (its MPI_Comm_split "
                                             "or MPI_Comm_dup failed, or the communicator "
                                             "was closed)"});
  return it->second;
}

inline void mpi_backend::check_alive(const op_context& ctx) const {
  if (failure_) std::rethrow_exception(failure_);
  if (aborted_)
    throw_error(errc::aborted,
                {.operation = dcomm::name(ctx.operation),
                 .rank = rank_,
                 .detail = "abort() was called on this rank (" + group_name(ctx) + ")"});
}

inline void mpi_backend::fail(int code, const op_context& ctx, std::string peers) const {
  int cls = code;
  MPI_Error_class(code, &cls);
  const bool truncated = cls == MPI_ERR_TRUNCATE;
  throw_error(truncated ? errc::mismatch : errc::device_error,
              {.operation = call_name(ctx),
               .rank = rank_,
               .peers = std::move(peers),
               .detail = truncated ? "the message that arrived is larger than the receive "
                                     "buffer (a receive never truncates): " +
                                         mpi::error_string(code)
                                   : "MPI failed: " + mpi::error_string(code)});
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::wait(MPI_Request* requests, int n,
                                                                  const op_context& ctx,
                                                                  MPI_Status* statuses,
                                                                  std::string peers) {
  auto test = [&] {
    int done = 0;
    const int rc = MPI_Testall(n, requests, &done, statuses ? statuses : MPI_STATUSES_IGNORE);
    if (rc == MPI_ERR_IN_STATUS && statuses)
      for (int i = 0; i < n; ++i)
        if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING)
          fail(statuses[i].MPI_ERROR, ctx, peers);
    if (rc != MPI_SUCCESS) fail(rc, ctx, peers);
    return done != 0;
  };
  const auto start = detail::clock::now();
  std::optional<asio::steady_timer> timer;  // made only for a long wait
  auto nap = std::chrono::microseconds(10);
  for (;;) {
    if (test()) co_return;
    const auto now = detail::clock::now();
    if (aborted_ || now >= ctx.deadline) break;
    if (now - start < o_.spin) continue;
    if (now - start < o_.busy_poll) {
      // A turn of the executor: its other handlers run before the next test.
      if (oversubscribed_) ::sched_yield();
      co_await asio::post(ex_, detail::use_task);
      continue;
    }
    if (!timer) timer.emplace(ex_);
    timer->expires_at(std::min(now + nap, ctx.deadline));
    auto [ec] = co_await timer->async_wait(detail::use_task);
    (void)ec;
    nap = std::min(nap * 2, o_.poll_interval);
  }
  // A receive's request is cancelled; anything else MPI keeps.
  const bool receives_only = ctx.operation == operation::recv || ctx.operation == operation::irecv;
  timed_out(requests, n, receives_only, ctx, peers);
}

inline void mpi_backend::timed_out(MPI_Request* requests, int n, bool receives_only,
                                   const op_context& ctx, const std::string& peers) {
  bool cancelled = receives_only;
  if (receives_only) {
    for (int i = 0; i < n; ++i) MPI_Cancel(&requests[i]);
    // A cancel completes at once unless the message was matched meanwhile;
    // then it completes as the message arrives: a few tests, bounded.
    for (int tries = 0; tries < 1000; ++tries) {
      int done = 0;
      MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE);
      if (done) break;
      if (tries == 999) cancelled = false;
    }
  }
  const std::string what = call_name(ctx);
  if (!cancelled) {
    // MPI holds the call's buffers and cannot give them back: nothing else
    // may run on this backend, and exit must not wait for MPI_Finalize.
    mpi::process().stuck = true;
    if (!failure_)
      failure_ = std::make_exception_ptr(error(
          errc::aborted, {.operation = what,
                          .rank = rank_,
                          .detail = "an earlier call timed out, and MPI cannot cancel it: end "
                                    "the job (exit calls MPI_Abort)"}));
  }
  if (aborted_)
    throw_error(errc::aborted, {.operation = what,
                                .rank = rank_,
                                .peers = peers,
                                .detail = "abort() was called on this rank"});
  throw_error(errc::timeout,
              {.operation = what,
               .rank = rank_,
               .peers = peers,
               .detail = "the deadline passed before MPI completed it" +
                         std::string(cancelled ? " (the receive was cancelled)" : "")});
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> mpi_backend::check_signature(
    const op_context& ctx, std::uint64_t signature) {
  if (!o_.check_calls) co_return;
  std::uint64_t words[2] = {signature, ~signature};
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, words, 2, MPI_UINT64_T, MPI_MAX, comm_of(ctx), &request), ctx);
  co_await wait(&request, 1, ctx);
  if (words[0] != signature || words[1] != ~signature)
    throw_error(errc::mismatch,
                {.operation = call_name(ctx),
                 .rank = rank_,
                 .detail = "the group's ranks made different collective calls (operation, "
                           "dtype, count, root or reduce op differ; DCOMM_MPI_CHECK_CALLS)"});
}

}  // namespace dcomm
