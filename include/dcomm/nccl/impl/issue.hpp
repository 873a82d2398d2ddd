// How nccl_backend issues an operation: in its turn on the group's NCCL
// communicator (every rank issues a communicator's calls in the same
// order), once the communicator has settled, with an event recorded behind
// its NCCL calls; and what a failure or a passed deadline does (every
// communicator aborted). Included by dcomm/nccl.hpp (Asio's style: the
// surface there, the bodies here).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/nccl.hpp"
#include "dcomm/nccl/staging.hpp"
#include "dcomm/nccl/types.hpp"

namespace dcomm {

template <class Enqueue>
detail::task<void> nccl_backend::run(const op_context& ctx, std::size_t bytes, Enqueue enqueue) {
  const char* operation = dcomm::name(ctx.operation);
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
    if (ctx.report) ctx.report->carried.bits |= transports::nccl;
    // Until NCCL has put its kernels on the stream, nothing may follow them.
    if (r == ncclInProgress) co_await settle(g, ctx, operation);
    cuda::device_guard on(device_);
    st.finish();
    ev.event = take_event();
    cuda::check(cudaEventRecord(ev.event, s), "cudaEventRecord");
  }
  if (ctx.stream) {
    detail::start(ex_,
                  watch(shared_from_this(), std::exchange(ev.event, nullptr), g.id, ctx, operation),
                  [](std::exception_ptr) {});
    co_return;
  }
  co_await wait_gpu(ev.event, g, ctx, operation, bytes);
  st.copy_back();
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::take_turn(group& g,
                                                                        std::uint64_t ticket,
                                                                        const op_context& ctx,
                                                                        const char* operation) {
  while (g.serving != ticket) {
    check_alive();
    if (detail::clock::now() >= ctx.deadline) timeout(g, ctx, operation, "waiting for its turn");
    co_await nap(std::min(ctx.deadline, detail::clock::now() + std::chrono::milliseconds(1)));
  }
}

inline void nccl_backend::end_turn(group& g) {
  ++g.serving;
  for (auto* t : sleepers_) t->cancel();  // the next in line re-checks at once
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::settle(group& g,
                                                                     const op_context& ctx,
                                                                     const char* operation) {
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

inline ncclResult_t nccl_backend::async_state(group& g, const char* operation) {
  ncclResult_t state = ncclSuccess;
  nccl_check(ncclCommGetAsyncError(g.comm, &state), "ncclCommGetAsyncError", g.comm);
  if (state == ncclSuccess || state == ncclInProgress) return state;
  auto e =
      make_error(nccl::error_for(state), {.operation = operation,
                                          .rank = rank_,
                                          .detail = g.name + ": " + nccl::describe(state, g.comm)});
  abort_all(e);
  std::rethrow_exception(e);
}

inline void nccl_backend::timeout(group& g, const op_context& ctx, const char* operation,
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

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::nap(detail::clock::time_point until) {
  asio::steady_timer t(ex_, until);
  sleepers_.push_back(&t);
  co_await t.async_wait(detail::use_task);
  std::erase(sleepers_, &t);
}

inline void nccl_backend::fail(ncclResult_t r, const std::string& what, ncclComm_t comm) const {
  throw_error(nccl::error_for(r),
              {.operation = what, .rank = rank_, .detail = nccl::describe(r, comm)});
}

inline cudaEvent_t nccl_backend::take_event() {
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

inline void nccl_backend::give_event(cudaEvent_t e) {
  if (released_)
    (void)cudaEventDestroy(e);
  else
    events_.push_back(e);
}

}  // namespace dcomm
