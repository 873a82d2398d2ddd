// Host data in the NCCL backend's operations: the front end's own calls
// (split's colours, the object collectives, the _v collectives' counts and
// host outputs) carry host buffers, which NCCL cannot read, so they go
// through pinned blocks and device copies in the operation's stream order.
// Also premul_sum's NCCL operator, made per call and destroyed with it.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cuda.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/nccl/types.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm::nccl {

// Device copies of the host buffers that the front end's own calls carry
// (split's colours, the object collectives, the _v collectives' counts and
// host outputs), through pinned blocks, and device scratch, all in the
// operation's stream order: copies in before the NCCL calls, copies out
// after them (finish()), into host memory once the GPU is done (copy_back()).
class staging {
 public:
  staging(detail::pinned_blocks& pool, cudaStream_t stream, bool host_allowed)
      : pool_(pool), stream_(stream), host_allowed_(host_allowed) {}
  staging(const staging&) = delete;
  staging& operator=(const staging&) = delete;
  ~staging() {
    for (void* p : device_) (void)cudaFreeAsync(p, stream_);  // after the work, in stream order
    for (auto& b : pinned_) pool_.give(b);
    // NCCL keeps an operator alive for the calls already given it.
    for (auto& [op, comm] : made_ops_) (void)ncclRedOpDestroy(op, comm);
  }
  // NCCL's operator for r; premul_sum's is made for this call, with the
  // factor converted to the element type, as NCCL wants it.
  ncclRedOp_t reduce_op(const reducer& r, ncclComm_t comm) {
    if (r.kind != reduce_kind::premul_sum) return nccl::reduce_op(r.kind);
    ncclRedOp_t op{};
    ncclResult_t made = ncclInvalidArgument;
    visit_dtype(r.type, [&]<class T>(std::type_identity<T>) {
      if constexpr (dcomm::detail::is_floating_element<T>) {
        T scalar{};
        if constexpr (dcomm::detail::is_half<T>)
          scalar = T(static_cast<float>(r.factor()));
        else
          scalar = static_cast<T>(r.factor());
        made = ncclRedOpCreatePreMulSum(&op, &scalar, data_type(r.type), ncclScalarHostImmediate,
                                        comm);
      }
    });
    if (made != ncclSuccess)
      throw_error(error_for(made),
                  {.operation = "ncclRedOpCreatePreMulSum", .detail = describe(made, comm)});
    made_ops_.emplace_back(op, comm);
    return op;
  }
  // A device pointer with v's contents.
  const void* in(const const_tensor_view& v) {
    if (v.device.type == device::kind::cuda || v.bytes() == 0) return v.data;
    auto pinned = host_block(v.bytes());
    std::memcpy(pinned.data, v.data, v.bytes());
    void* d = allocate(v.bytes());
    cuda::check(cudaMemcpyAsync(d, pinned.data, v.bytes(), cudaMemcpyHostToDevice, stream_),
                "cudaMemcpyAsync host to device (staging)");
    return d;
  }
  // A device pointer whose contents end up in v; `initial`: v's contents
  // first (in-place operations).
  void* out(const tensor_view& v, bool initial = false) {
    if (v.device.type == device::kind::cuda || v.bytes() == 0) return v.data;
    void* d = initial ? const_cast<void*>(in(v)) : allocate(v.bytes());
    back_.push_back({d, host_block(v.bytes()).data, v.data, v.bytes()});
    return d;
  }
  // Device memory of `bytes` until the operation's work is done.
  void* allocate(std::size_t bytes) {
    void* d = nullptr;
    cuda::check(cudaMallocAsync(&d, bytes, stream_),
                "cudaMallocAsync of " + std::to_string(bytes) + " bytes");
    device_.push_back(d);
    return d;
  }
  // After the NCCL calls: the results to the pinned blocks.
  void finish() {
    for (auto& b : back_)
      cuda::check(cudaMemcpyAsync(b.pinned, b.device, b.bytes, cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync device to host (staging)");
  }
  // Once the GPU is done: into the caller's host memory.
  void copy_back() {
    for (auto& b : back_) std::memcpy(b.host, b.pinned, b.bytes);
    back_.clear();
  }

 private:
  detail::pinned_blocks::block host_block(std::size_t bytes) {
    if (!host_allowed_)
      throw_error(errc::invalid_argument,
                  {.operation = "nccl_backend",
                   .detail = "host memory in a stream-ordered operation (op_options::stream)"});
    auto b = pool_.take(bytes);
    pinned_.push_back(b);
    return b;
  }
  struct copy {
    void* device;
    void* pinned;
    void* host;
    std::size_t bytes;
  };
  detail::pinned_blocks& pool_;
  cudaStream_t stream_;
  bool host_allowed_;
  std::vector<void*> device_;
  std::vector<detail::pinned_blocks::block> pinned_;
  std::vector<copy> back_;
  std::vector<std::pair<ncclRedOp_t, ncclComm_t>> made_ops_;
};

}  // namespace dcomm::nccl
