// CUDA tensors on the CPU backend, which works in host memory: staged
// through page-locked host memory (Gloo's way for GPUs without NCCL's
// connectivity), either whole around a host call, or slice by slice within
// one call with the copies to and from the device overlapped with the
// network. The backend's operations decide which (cpu_backend.hpp); the
// copies themselves are detail/device_memory.hpp's.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <type_traits>
#include <utility>

#include "dcomm/cpu/call.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/detail/task.hpp"
#include "dcomm/error.hpp"

namespace dcomm::cpu {

// Slice k, on the host: bytes [begin, end) of the tensor, at `host`.
struct slice {
  char* host;
  std::size_t count;  // elements
  std::size_t begin, end;
  std::size_t bytes() const { return end - begin; }
};

// How a tensor is cut: slices of `slice_bytes` (whole elements), at most
// 255 of them (a collective's slice k has steps k << 24).
struct slice_plan {
  slice_plan(const const_tensor_view& v, std::size_t slice_bytes)
      : es(size_of(v.type)),
        count(v.count),
        per(std::max({slice_bytes / es, std::size_t{1}, (count + 254) / 255})),
        slices((count + per - 1) / per) {}
  // Slice k of a tensor whose host copy is at `block`.
  slice at(std::size_t k, char* block) const {
    const std::size_t begin = k * per * es, end = std::min(count, (k + 1) * per) * es;
    return {block + begin, (end - begin) / es, begin, end};
  }
  std::size_t es, count, per, slices;
};

// How whole() makes the host copy of an operation's output.
struct staged_output {
  // With the tensor's contents (parts the operation leaves alone on this
  // rank, or a root's data); else uninitialised.
  bool initial = false;
  // The input is the output (in.data == out.data, for operations whose host
  // algorithm works in place): one host copy, with the contents, serves as
  // both. Else the input gets a host copy of its own even if it is the
  // output (all_to_all's in-place form: its algorithm needs two buffers).
  bool in_place = false;
};

// The staging of one backend: its page-locked blocks and its copy thread.
// On the backend's executor, like the backend.
class staging {
 public:
  // CUDA tensors over `slice_bytes` go slice by slice (where the operation
  // can); `rank` names this rank in errors.
  staging(asio::any_io_executor ex, std::size_t slice_bytes, int rank)
      : ex_(std::move(ex)), slice_bytes_(slice_bytes), rank_(rank) {}
  staging(const staging&) = delete;
  staging& operator=(const staging&) = delete;

  // A CUDA tensor that goes slice by slice.
  bool sliced(const const_tensor_view& v) const {
    return detail::on_device(v) && v.bytes() > slice_bytes_;
  }
  // `v` cut in slices of this backend's size.
  slice_plan plan(const const_tensor_view& v) const { return slice_plan(v, slice_bytes_); }

  // Either of an operation's tensors in device memory: it runs staged.
  static bool needed(const const_tensor_view& in, const const_tensor_view& out = {}) {
    return detail::on_device(in) || detail::on_device(out);
  }

  // Runs `op(host_in, host_out)` (a task) once, on host copies of whichever
  // of `in` and `out` is a CUDA tensor (the others as they are), then copies
  // the output back to the device if the operation succeeded. An operation
  // with one tensor passes an empty view for the other. The copies are
  // synchronous (cudaMemcpy), in the order of the legacy default stream:
  // work queued there before the call is in the data.
  template <class Op>
  auto whole(const_tensor_view in, tensor_view out, staged_output how, Op op)
      -> std::invoke_result_t<Op&, const_tensor_view, tensor_view> {
    detail::host_staging st(pinned_);
    const_tensor_view host_in;
    tensor_view host_out;
    if (how.in_place) {
      host_out = st.out(out, true);
      host_in = host_out;
    } else {
      host_in = st.in(in);
      host_out = st.out(out, how.initial);
    }
    using result = typename std::invoke_result_t<Op&, const_tensor_view, tensor_view>::value_type;
    if constexpr (std::is_void_v<result>) {
      co_await op(host_in, host_out);
      st.copy_back();
    } else {
      result r = co_await op(host_in, host_out);
      st.copy_back();
      co_return r;
    }
  }

  static void no_start(char*, std::size_t) {}

  // One operation on a CUDA tensor, slice by slice within the one call `c`
  // (which it runs): all its input slices are queued to the copy thread at
  // once; start(block, slice_bytes) runs before anything is awaited (a
  // send or receive posts its one message there, so that it keeps its
  // order); each slice runs `body(slice)` in its part of a page-locked
  // block as soon as it is on the host, and its result is queued back to
  // the device at once, so copies in both directions overlap the network.
  // `src`: the device data this rank reads (null: none); `dst`: where its
  // result goes (null: nowhere). A collective's slices run its algorithm
  // with steps of their own (call::set_step_base).
  template <class Start, class Body>
  detail::task<void> sliced_call(call& c, detail::clock::time_point deadline,
                                 const slice_plan& plan, const void* src, void* dst, int device,
                                 const char* operation, Start start, Body body) {
    auto copies = std::make_shared<detail::copy_thread::batch>();
    // Back to the pool once no copy touches it; if this frame is destroyed
    // before (its executor went away mid-operation), the batch frees it
    // after the copy that may be running.
    struct lease {
      detail::pinned_blocks& pool;
      detail::pinned_blocks::block block;
      detail::copy_thread::batch& copies;
      bool given = false;
      void give() {
        pool.give(block);
        given = true;
      }
      ~lease() {
        if (!given) copies.adopt(block.data, detail::device_memory()->free_pinned);
      }
    } block{pinned_, pinned_.take(plan.count * plan.es), *copies};
    char* host = static_cast<char*>(block.block.data);
    std::size_t queued = 0;
    if (src)
      for (std::size_t k = 0; k < plan.slices; ++k, ++queued) {
        const slice s = plan.at(k, host);
        copies_.to_host(copies, s.host, static_cast<const char*>(src) + s.begin, s.bytes(), device);
      }
    std::exception_ptr failure;
    try {
      // run() waits for every message, sends from the block included, or
      // takes them all back on a failure, before it returns.
      co_await c.run([&]() -> detail::task<void> {
        start(host, plan.per * plan.es);
        for (std::size_t k = 0; k < plan.slices; ++k) {
          if (src) co_await copies_done(*copies, k + 1, deadline, operation);
          c.set_step_base(static_cast<std::uint32_t>(k << 24));
          const slice s = plan.at(k, host);
          co_await body(s);
          if (dst) {
            copies_.to_device(copies, static_cast<char*>(dst) + s.begin, s.host, s.bytes(), device);
            ++queued;
          }
        }
      });
      co_await copies_done(*copies, queued, deadline, operation);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      // Nothing may copy into or out of the block once it is given back:
      // skip what has not started and wait for the copy in progress (a
      // local copy; if even that does not end, the batch frees the block
      // after it).
      copies->cancelled.store(true, std::memory_order_release);
      try {
        co_await copies_done(*copies, queued, detail::clock::now() + std::chrono::seconds(10),
                             operation, false);
      } catch (...) {
        std::rethrow_exception(failure);  // the lease hands the block to the batch
      }
      block.give();
      std::rethrow_exception(failure);
    }
    block.give();
  }

 private:
  // Until `n` copies of the batch are done (or skipped); a failed copy is
  // rethrown unless `rethrow` is false.
  DCOMM_EMIT_ON_USE detail::task<void> copies_done(detail::copy_thread::batch& b, std::size_t n,
                                                   detail::clock::time_point deadline,
                                                   const char* operation, bool rethrow = true);

  asio::any_io_executor ex_;
  std::size_t slice_bytes_;
  int rank_;
  detail::pinned_blocks pinned_;
  // Copies of sliced CUDA tensors (its thread starts with the first one);
  // gone before the blocks it copies into.
  detail::copy_thread copies_{ex_};
};

DCOMM_EMIT_ON_USE_DEFINITION auto staging::copies_done(detail::copy_thread::batch& b, std::size_t n,
                                                       detail::clock::time_point deadline,
                                                       const char* operation, bool rethrow)
    -> detail::task<void> {
  asio::steady_timer timer(ex_);
  b.waiter = &timer;
  struct unhook {
    detail::copy_thread::batch& b;
    ~unhook() { b.waiter = nullptr; }
  } guard{b};
  while (b.done < n) {
    if (rethrow && b.failure) std::rethrow_exception(b.failure);
    if (detail::clock::now() >= deadline)
      throw_error(errc::timeout, {.operation = operation,
                                  .rank = rank_,
                                  .detail = "the deadline passed while copying a slice of a "
                                            "CUDA tensor between host and device"});
    timer.expires_at(deadline);
    co_await timer.async_wait(detail::use_task);
  }
  if (rethrow && b.failure) std::rethrow_exception(b.failure);
}

}  // namespace dcomm::cpu

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu::staging::copies_done<void>(detail::copy_thread::batch& b, std::size_t n, detail::clock::time_point deadline, const char* operation, bool rethrow) -> detail::task<void>)
// clang-format on
// End of the separate-compilation block.
