// How a wait for the GPU ends, in the NCCL backend (dcomm/nccl.hpp): the
// operation's event has been passed (polled), or a host function queued
// behind that event wakes the operation asleep on its timer. The waiting
// itself, with its deadline and NCCL's asynchronous errors, is
// nccl_backend::wait_gpu (nccl/impl/wait.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <utility>

#include "dcomm/cuda.hpp"
#include "dcomm/detail/asio.hpp"

namespace dcomm::nccl {

// Whether the GPU has passed `e` (recorded behind an operation's work).
inline bool passed(cudaEvent_t e) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) return false;
  cuda::check(r, "cudaEventQuery");
  return true;
}

// The wake-up of an operation asleep until the GPU passes its event: a host
// function CUDA runs on its own thread once the waker stream gets there
// posts to the executor, which cuts the operation's timer short (if it is
// still waiting: the waiter is unhooked when it stops).
struct gpu_wake {
  asio::any_io_executor executor;
  asio::steady_timer* waiter = nullptr;  // only touched on executor
};

inline void CUDART_CB on_gpu_passed(void* p) {
  auto* holder = static_cast<std::shared_ptr<gpu_wake>*>(p);
  std::shared_ptr<gpu_wake> d = std::move(*holder);
  delete holder;
  // No CUDA call may be made from here; posting to Asio is not one.
  asio::post(d->executor, [d] {
    if (d->waiter) d->waiter->cancel();
  });
}

// Queues on `waker`, behind `ev` only (not behind later operations), the
// host function that wakes `wake`'s waiter. The host function owns a
// reference to `wake` until it has run. The caller makes the device of
// `waker` current.
inline void wake_when_passed(cudaStream_t waker, cudaEvent_t ev,
                             const std::shared_ptr<gpu_wake>& wake) {
  cuda::check(cudaStreamWaitEvent(waker, ev, 0), "cudaStreamWaitEvent");
  auto* holder = new std::shared_ptr<gpu_wake>(wake);
  if (auto e = cudaLaunchHostFunc(waker, &on_gpu_passed, holder); e != cudaSuccess) {
    delete holder;
    cuda::check(e, "cudaLaunchHostFunc");
  }
}

}  // namespace dcomm::nccl
