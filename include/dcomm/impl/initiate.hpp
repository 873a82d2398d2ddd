// How a communicator operation is started once its arguments are checked
// and its identity taken (impl/call_identity.hpp): the backend's coroutine
// runs on the backend's executor, kept alive by the runtime it holds, and
// completes through the caller's token, or as a dcomm::request. A refused
// call runs no backend code: it completes with its refusal the same way.
#pragma once

#include <chrono>
#include <cstdio>
#include <exception>
#include <future>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "dcomm/backend.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/request.hpp"
#include "dcomm/trace/error_file.hpp"
#include "dcomm/trace/flight_recorder.hpp"
#include "dcomm/trace/op_stats.hpp"
#include "dcomm/trace/signal_dump.hpp"
#include "dcomm/trace/stragglers.hpp"
#include "dcomm/trace/timeline.hpp"

namespace dcomm {
class store;
}  // namespace dcomm

namespace dcomm::detail {

// What every handle of every group made from one init_process_group shares.
template <backend Backend>
struct comm_runtime {
  std::shared_ptr<Backend> backend;
  std::shared_ptr<io_thread> thread;  // when the backend runs on our own thread
  std::shared_ptr<store> rendezvous_store;
  // The store joiners reach, where grow() made this world (elastic.hpp):
  // rendezvous_store is then the generation's, under a prefix.
  std::shared_ptr<store> job_store;
  // This process's last operations, every group's; shared with the
  // SIGUSR1 dump, which may outlive the rest.
  std::shared_ptr<trace::flight_recorder> recorder = std::make_shared<trace::flight_recorder>();
  std::shared_ptr<trace::signal_dump> on_signal;  // where DCOMM_TRACE_DIR is set
  std::shared_ptr<trace::timeline> timeline;      // where DCOMM_TRACE is set
  trace::op_stats stats;                          // communicator::stats()
  trace::straggler_stats stragglers;              // communicator::stats(), and the warning
};

// What a call's end tells the statistics (trace/op_stats.hpp).
struct call_note {
  const char* operation = "";
  std::uint64_t bytes = 0;
  std::int64_t issued_ns = 0;
  bool collective = true;
};

// Closes the connections when the last handle of every group is gone.
template <backend Backend>
struct comm_closer {
  std::shared_ptr<comm_runtime<Backend>> rt;
  ~comm_closer() {
    if (rt->on_signal) rt->on_signal->stop();
    auto done = std::make_shared<std::promise<void>>();
    auto future = done->get_future();
    rt->backend->close([done] { done->set_value(); });
    if (rt->thread) rt->thread->drive().hand_back();  // no blocking call will run the close
    // Our own io thread: let the close finish (links flushed and closed,
    // bounded by the backend) before the thread and its context stop.
    if (rt->thread && !detail::running_in_this_thread(rt->backend->get_executor()))
      future.wait_for(std::chrono::seconds(5));
    if (rt->timeline) rt->timeline->close();
  }
};

// DCOMM_LOG_LEVEL=debug's line for an operation that ended: "rank 0:
// all_reduce #3 of group 0x0, float32 x 1024 (4096 B): done in 12.3 us
// over shm (shared_memory); rank 2 called last, 3.1 us after the first".
template <backend Backend>
void log_operation(const comm_runtime<Backend>& rt, std::uint64_t trace_id, const call_note& note,
                   const op_report& said, std::int64_t end_ns, int code) {
  char text[512];
  const auto r = rt.recorder->record(trace_id);
  std::string what = note.operation;
  if (r) {
    std::snprintf(text, sizeof text, "%s%llu of group 0x%llx, %s x %llu",
                  r->brief.collective ? " #" : " tag ", static_cast<unsigned long long>(r->seq),
                  static_cast<unsigned long long>(r->group),
                  std::string(name(r->brief.type)).c_str(),
                  static_cast<unsigned long long>(r->brief.count));
    what += text;
  }
  std::snprintf(text, sizeof text, "rank %d: %s (%llu B): %s in %.1f us over %s (%s)",
                rt.backend->rank(), what.c_str(), static_cast<unsigned long long>(note.bytes),
                code >= 0 ? "failed" : "done", static_cast<double>(end_ns - note.issued_ns) / 1e3,
                said.carried.names().c_str(), std::string(name(said.ran)).c_str());
  std::string line = text;
  if (said.arrivals.others && said.arrivals.known()) {
    std::snprintf(text, sizeof text, "; rank %d called last, %.1f us after the first",
                  said.arrivals.last_rank, static_cast<double>(said.arrivals.spread_ns()) / 1e3);
    line += text;
  }
  log(log_level::debug, line);
}

// The end of an operation in the flight recorder, the statistics and,
// where DCOMM_TRACE is set, the timeline. A timed call (every call on the
// timeline, one in 16 otherwise) reads the precise clock; the recorder
// makes do with the coarse one otherwise. `code`: -1 for success, else
// the errc of the failure (0: not a dcomm::error). `said`: the backend's
// report of the call.
template <backend Backend>
void record_end(comm_runtime<Backend>& rt, std::uint64_t trace_id, const call_note& note,
                trace::timeline_event& ev, const op_report& said, int code = -1) {
  const bool failed = code >= 0;
  const bool debug = log_enabled(log_level::debug);
  const bool timed = rt.timeline || rt.stats.sample() || debug;
  const std::int64_t end =
      timed ? trace::steady_ns(std::chrono::steady_clock::now()) : trace::coarse_steady_ns();
  const call_arrivals& a = said.arrivals;
  if (rt.timeline) {
    ev.end_ns = end;
    ev.failed = failed;
    ev.carried = said.carried.bits;
    ev.ran = said.ran;
    if (a.others && a.known()) {
      ev.last_caller = a.last_rank;
      ev.first_call_ns = a.first_ns;
      ev.last_call_ns = a.last_ns;
    }
    rt.timeline->add(ev);
  }
  rt.stats.ended(note.operation, note.bytes, failed, timed ? end - note.issued_ns : -1);
  if (note.collective && !failed && a.others && rt.stragglers.measured(a, note.issued_ns, end))
    detail::log(detail::log_level::warning, rt.stragglers.warning());
  rt.recorder->ended(trace_id, failed, failed ? code : 0, end, said);
  if (debug) log_operation(rt, trace_id, note, said, end, code);
}

// A failed operation's end in the flight recorder, and the dump that a
// timeout, a lost peer, a mismatch or an abort writes to DCOMM_TRACE_DIR.
template <backend Backend>
void record_failure(comm_runtime<Backend>& rt, std::uint64_t trace_id, const call_note& note,
                    trace::timeline_event& ev, const op_report& said, std::exception_ptr e) {
  int code = 0;
  std::string reason = "failed";
  try {
    std::rethrow_exception(e);
  } catch (const dcomm::error& x) {
    if (x.code().category() == dcomm::error_category()) code = x.code().value();
    reason = x.what();
  } catch (...) {
  }
  record_end(rt, trace_id, note, ev, said, code);
  const auto c = static_cast<errc>(code);
  if (c != errc::timeout && c != errc::peer_lost && c != errc::mismatch && c != errc::aborted)
    return;
  trace::note_first_failure(reason);  // TORCHELASTIC_ERROR_FILE
  try {
    rt.recorder->dump_to_trace_dir(rt.backend->rank(), rt.backend->world_size(), reason, true);
  } catch (const std::exception&) {
    // The call's own failure is what the caller hears of.
  }
}

// What the timeline will say of a call (where DCOMM_TRACE is set).
template <backend Backend>
trace::timeline_event timeline_entry(const comm_runtime<Backend>& rt, const char* operation,
                                     const op_context& ctx, const trace::op_brief& brief) {
  if (!rt.timeline) return {};
  return {operation, ctx.group->id, ctx.seq, brief, ctx.algorithm, trace::steady_ns(ctx.issued)};
}

// Keeps the runtime (and so the backend) alive while the operation runs,
// and tells the flight recorder (and the timeline) when it starts and ends,
// with what the backend said of it.
template <class R, backend Backend, class F>
task<R> hold(std::shared_ptr<comm_runtime<Backend>> rt, op_context ctx, std::uint64_t trace_id,
             call_note note, trace::timeline_event ev, F f) {
  rt->recorder->started(trace_id);
  op_report said;
  ctx.report = &said;
  std::exception_ptr failure;
  try {
    if constexpr (std::is_void_v<R>) {
      co_await f(*rt->backend, std::move(ctx));
      record_end(*rt, trace_id, note, ev, said);
      co_return;
    } else {
      R result = co_await f(*rt->backend, std::move(ctx));
      record_end(*rt, trace_id, note, ev, said);
      co_return result;
    }
  } catch (...) {
    failure = std::current_exception();
  }
  record_failure(*rt, trace_id, note, ev, said, failure);
  std::rethrow_exception(failure);
}

// An accepted operation in the flight recorder.
template <backend Backend>
std::uint64_t record_queued(comm_runtime<Backend>& rt, const char* operation, const op_context& ctx,
                            const trace::op_brief& brief) {
  return rt.recorder->queued(ctx.group->id, ctx.seq, operation, brief, ctx.algorithm,
                             trace::steady_ns(ctx.issued));
}

template <class R>
task<R> refuse_any(std::exception_ptr e) {
  if constexpr (std::is_void_v<R>) {
    std::rethrow_exception(e);
    co_return;
  } else {
    std::rethrow_exception(e);
    co_return R{};
  }
}

template <backend Backend, class F>
request start_request(const std::shared_ptr<comm_runtime<Backend>>& rt, const char* operation,
                      std::exception_ptr bad, op_context ctx, F f, const trace::op_brief& brief) {
  const auto deadline = ctx.deadline;
  const std::uint64_t trace_id = bad ? 0 : record_queued(*rt, operation, ctx, brief);
  auto ev = timeline_entry(*rt, operation, ctx, brief);
  const call_note note{operation, brief.count * size_of(brief.type), trace::steady_ns(ctx.issued),
                       brief.collective};
  auto op = bad ? refuse_any<void>(bad)
                : hold<void>(rt, std::move(ctx), trace_id, note, ev, std::move(f));
  auto req = request_access::start(rt->backend->get_executor(), operation, deadline, std::move(op));
  if (rt->thread) rt->thread->drive().hand_back();  // its io thread runs it (io_drive)
  return req;
}

template <class R, backend Backend, class Token, class F>
auto initiate_op(const std::shared_ptr<comm_runtime<Backend>>& rt, const char* operation,
                 Token&& token, std::exception_ptr bad, op_context ctx, F f,
                 const trace::op_brief& brief) {
  // How long a blocking call may wait.
  const auto blocking_deadline = ctx.deadline + detail::blocking_grace;
  const std::uint64_t trace_id = bad ? 0 : record_queued(*rt, operation, ctx, brief);
  auto ev = timeline_entry(*rt, operation, ctx, brief);
  const call_note note{operation, brief.count * size_of(brief.type), trace::steady_ns(ctx.issued),
                       brief.collective};
  auto op =
      bad ? refuse_any<R>(bad) : hold<R>(rt, std::move(ctx), trace_id, note, ev, std::move(f));
  const auto& ex = rt->backend->get_executor();
  if constexpr (std::is_same_v<std::decay_t<Token>, blocking_t>) {
    // Run by this thread where an io thread of ours runs the backend.
    return detail::run_blocking(ex, std::move(op), operation, blocking_deadline,
                                rt->thread ? &rt->thread->drive() : io_drive::of(ex));
  } else {
    // An operation that no blocking call runs goes to the io thread at
    // once, if blocking calls had it parked (io_drive).
    if (rt->thread) rt->thread->drive().hand_back();
    return detail::initiate(ex, std::move(op), std::forward<Token>(token), operation,
                            clock::duration{});
  }
}

// Starts f(backend, ctx) (a coroutine returning task<R>), or completes with
// `bad`, through the token: a completion token, or dcomm::as_request.
// `brief`: what the flight recorder keeps of the call besides its identity
// (ctx.operation, its name).
template <class R, backend Backend, class Token, class F>
auto launch(const std::shared_ptr<comm_runtime<Backend>>& rt, Token&& token, std::exception_ptr bad,
            op_context ctx, F f, const trace::op_brief& brief = {}) {
  const char* operation = name(ctx.operation);
  if constexpr (std::is_same_v<std::decay_t<Token>, as_request_t>) {
    static_assert(std::is_void_v<R>, "dcomm::as_request: only for operations without a result");
    return start_request(rt, operation, bad, std::move(ctx), std::move(f), brief);
  } else {
    return initiate_op<R>(rt, operation, std::forward<Token>(token), bad, std::move(ctx),
                          std::move(f), brief);
  }
}

// Builds the reducer where the functor lives (this coroutine's frame) and
// runs f(backend, ctx, reducer).
template <class E, backend Backend, class Op, class F>
task<void> run_reduction(Backend& b, op_context c, Op op, dtype type, F f) {
  reducer r;
  if constexpr (std::is_void_v<E>)
    r = make_reducer(op, type);  // refers to `op`, alive in this frame
  else
    r = make_reducer<E>(op);  // refers to `op`, alive in this frame
  co_await f(b, std::move(c), r);
}

// The compile-time half of a reduction's checks: what the backend and the
// element type allow.
template <class E, backend Backend, class Op>
void check_reduction_statically() {
  static_assert(reduce_kind_of_v<Op> != reduce_kind::custom || Backend::supports_custom_reduce,
                "dcomm: this backend does not support custom reduce functors");
  static_assert(!detail::is_bitwise(reduce_kind_of_v<Op>) || Backend::supports_bitwise_reduce,
                "dcomm: this backend does not support bitwise reduce ops");
  if constexpr (std::is_void_v<E>) {
    static_assert(reduce_kind_of_v<Op> != reduce_kind::custom,
                  "dcomm: a custom reduce functor needs a tensor whose element type is known at "
                  "compile time");
  } else {
    check_reduce_op<E, Op>();
  }
}

}  // namespace dcomm::detail

// Separate compilation (detail/asio.hpp): the refusal every operation
// returns nothing through, compiled once in the library. Written by hand:
// a template of the result type.
// clang-format off
DCOMM_INSTANTIATE(dcomm::detail::task<void> dcomm::detail::refuse_any<void>(std::exception_ptr))
// clang-format on
