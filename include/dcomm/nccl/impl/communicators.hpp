// nccl_backend's NCCL communicators: the world's made at start-up, the
// groups' split from their parent's, all of them aborted on a failure and
// finalized (or aborted) when the backend is released. Included by
// dcomm/nccl.hpp (Asio's style: the surface there, the bodies here).
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "dcomm/nccl.hpp"
#include "dcomm/nccl/types.hpp"

namespace dcomm {

DCOMM_EMIT_ON_USE_DEFINITION asio::awaitable<std::shared_ptr<nccl_backend>> nccl_backend::create(
    std::shared_ptr<store> s, int rank, int world, std::string job_token, std::string store_host,
    options o, detail::clock::time_point deadline) {
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
      throw_error(errc::protocol_error, {.operation = "nccl_backend",
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
    if (r != ncclSuccess && r != ncclInProgress) b->nccl_check(r, "ncclCommInitRankConfig", g.comm);
  }
  op_context ctx{.deadline = deadline};
  // settle() is a task: awaited from this Asio coroutine through initiate.
  co_await detail::initiate(ex, b->settle(g, ctx, "ncclCommInitRankConfig"), asio::use_awaitable,
                            "ncclCommInitRankConfig",
                            deadline - detail::clock::now() + detail::blocking_grace);
  co_return b;
}

inline void nccl_backend::abort() {
  asio::dispatch(ex_, [self = shared_from_this()] {
    self->abort_all(make_error(
        errc::aborted,
        {.operation = "nccl_backend", .rank = self->rank_, .detail = "abort() was called"}));
  });
}

inline void nccl_backend::close(std::function<void()> closed) {
  asio::dispatch(ex_, [self = shared_from_this(), closed = std::move(closed)] {
    self->release(false);
    if (closed) closed();
  });
}

inline void nccl_backend::group_created(const std::shared_ptr<group_state>& parent,
                                        const std::shared_ptr<group_state>& child, int color,
                                        int key) {
  asio::post(ex_, [self = shared_from_this(), parent_id = parent->id,
                   deadline = detail::clock::now() + parent->timeout, child, color,
                   key] { self->start_split(parent_id, deadline, child, color, key); });
}

inline nccl_backend::group& nccl_backend::add_group(std::uint64_t id, std::string name, int rank,
                                                    int size) {
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

inline nccl_backend::group& nccl_backend::find_group(const op_context& ctx, const char* operation) {
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

inline void nccl_backend::start_split(std::uint64_t parent_id, detail::clock::time_point deadline,
                                      const std::shared_ptr<group_state>& child, int color,
                                      int key) {
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

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> nccl_backend::split(
    std::shared_ptr<nccl_backend> self, group& parent, group* made, std::uint64_t ticket,
    detail::clock::time_point deadline, int color, int key) {
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
        throw_error(errc::device_error,
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

inline void nccl_backend::abort_all(std::exception_ptr why) {
  if (!failure_) failure_ = std::move(why);
  for (auto& [id, g] : groups_)
    if (g->comm) {
      (void)ncclCommAbort(g->comm);
      g->comm = nullptr;
    }
  for (auto* t : sleepers_) t->cancel();
}

inline void nccl_backend::release(bool abort) {
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

}  // namespace dcomm
