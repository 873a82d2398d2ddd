// How nccl_backend waits for the GPU to pass an operation's event: asleep
// through most of its typical duration, polled for the tail, then asleep
// until a host function wakes it, checking NCCL's asynchronous error and
// the deadline meanwhile; and the watcher of a stream-ordered operation.
// Included by dcomm/nccl.hpp (Asio's style: the surface there, the bodies
// here); how a wait ends is in nccl/wait.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "dcomm/nccl.hpp"
#include "dcomm/nccl/wait.hpp"

namespace dcomm {

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::wait_gpu(cudaEvent_t ev, group& g,
                                                                       const op_context& ctx,
                                                                       const char* operation,
                                                                       std::size_t bytes) {
  const auto start = detail::clock::now();
  detail::clock::duration poll = o_.spin;
  if (o_.spin > detail::clock::duration::zero()) {
    if (auto sleep = g.estimate.sleep_for(operation, bytes); sleep > sleep.zero()) {
      // Other operations' turns cut naps short: sleep on to the time.
      for (const auto until = std::min(ctx.deadline, start + sleep);
           detail::clock::now() < until;) {
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

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::sleep_until_passed(
    cudaEvent_t ev, group& g, const op_context& ctx, const char* operation,
    asio::steady_timer& timer) {
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

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::watch(
    std::shared_ptr<nccl_backend> self, cudaEvent_t ev, std::uint64_t group_id, op_context ctx,
    const char* operation) {
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

}  // namespace dcomm
