// CUDA device memory as dcomm tensors: a typed, owning device buffer, a
// borrowed device pointer + count view, and the tensor_traits that tell
// dcomm where they live (device = cuda, device index). Needs the CUDA
// runtime (cuda_runtime_api.h, libcudart): Meson's dcomm_cuda dependency.
// dcomm/dcomm.hpp never includes this.
//
//   dcomm::cuda::device_buffer<float> grad(1 << 20);       // on the current device
//   grad.copy_from(host);                                   // host -> device
//   dcomm::cuda::device_span<float> part(ptr, n, 1);        // someone else's memory, GPU 1
//
// Every failing CUDA call becomes a dcomm::error with errc::device_error that
// names the call and CUDA's error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include "dcomm/detail/device_memory.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm::cuda {

// Throws errc::device_error for a failed CUDA runtime call; `what` says
// what was being done ("cudaMalloc of 4096 bytes on device 1").
inline void check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  throw_error(errc::device_error,
              {.operation = what,
               .detail = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e)});
}

// GPUs this process can use; 0 without a driver or a device (the CI
// machines), which is no error: GPU tests skip on it.
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, so that it does not surface later
    return 0;
  }
  return n;
}

inline int current_device() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

// Makes `index` the calling thread's current device for a scope, as CUDA
// calls on another device need, and restores the previous one.
class device_guard {
 public:
  explicit device_guard(int index) : previous_(current_device()) {
    if (index != previous_) {
      check(cudaSetDevice(index), "cudaSetDevice(" + std::to_string(index) + ")");
      switched_ = true;
    }
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_;
  bool switched_ = false;  // on every operation's path: no call when unchanged
};

namespace detail {
// cudaFree on `device`'s context; for destructors: never throws.
inline void free_device(void* p, int device) noexcept {
  int previous = 0;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                        cudaSetDevice(device) == cudaSuccess;
  (void)cudaFree(p);  // nothing to do about a failure in a destructor
  if (switched) (void)cudaSetDevice(previous);
}
}  // namespace detail

// A borrowed view of `count` elements of T at a device pointer on GPU
// `device`. Like std::span, its constness is shallow.
template <element_type T>
struct device_span {
  T* data = nullptr;
  std::size_t count = 0;
  int device = 0;

  constexpr device_span() = default;
  constexpr device_span(T* p, std::size_t n, int device_index) noexcept
      : data(p), count(n), device(device_index) {}
  constexpr std::size_t size_bytes() const noexcept { return count * sizeof(T); }
};

// `count` elements of T in device memory, owned: cudaMalloc on
// construction, cudaFree on destruction. Move-only. The contents start
// undefined, as cudaMalloc leaves them.
template <element_type T>
class device_buffer {
 public:
  device_buffer() = default;
  // On the calling thread's current device.
  explicit device_buffer(std::size_t count) : device_buffer(count, current_device()) {}
  device_buffer(std::size_t count, int device) : count_(count), device_(device) {
    if (count_ == 0) return;
    check_device(device);
    device_guard on(device);
    void* p = nullptr;
    check(cudaMalloc(&p, size_bytes()), "cudaMalloc of " + std::to_string(size_bytes()) +
                                            " bytes on device " + std::to_string(device));
    data_ = static_cast<T*>(p);
  }
  device_buffer(device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        count_(std::exchange(other.count_, 0)),
        device_(other.device_) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
      device_ = other.device_;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return count_; }
  std::size_t size_bytes() const noexcept { return count_ * sizeof(T); }
  int device() const noexcept { return device_; }
  device_span<T> span() noexcept { return {data_, count_, device_}; }

  // Synchronous copies from and to host memory of exactly size() elements;
  // any other size is an error, never a partial copy.
  void copy_from(std::span<const T> host) {
    check_size(host.size(), "copy_from");
    if (count_ == 0) return;
    device_guard on(device_);
    check(cudaMemcpy(data_, host.data(), size_bytes(), cudaMemcpyHostToDevice),
          "cudaMemcpy host to device " + std::to_string(device_));
  }
  void copy_to(std::span<T> host) const {
    check_size(host.size(), "copy_to");
    if (count_ == 0) return;
    device_guard on(device_);
    check(cudaMemcpy(host.data(), data_, size_bytes(), cudaMemcpyDeviceToHost),
          "cudaMemcpy device " + std::to_string(device_) + " to host");
  }

 private:
  static void check_device(int device) {
    const int n = device_count();
    if (device < 0 || device >= n)
      throw_error(
          errc::invalid_argument,
          {.operation = "cuda::device_buffer",
           .expected = "a device index below " + std::to_string(n),
           .seen = std::to_string(device),
           .detail = n == 0 ? "no CUDA device is visible to this process" : "no such CUDA device"});
  }
  void check_size(std::size_t n, const char* operation) const {
    if (n != count_)
      throw_error(errc::invalid_argument,
                  {.operation = std::string("cuda::device_buffer::") + operation,
                   .expected = std::to_string(count_) + " elements",
                   .seen = std::to_string(n) + " elements"});
  }
  void release() noexcept {
    if (data_) detail::free_device(data_, device_);
    data_ = nullptr;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
  int device_ = 0;
};

namespace detail {

inline void copy_to_host(void* host, const void* data, std::size_t bytes, int device) {
  device_guard on(device);
  check(cudaMemcpy(host, data, bytes, cudaMemcpyDeviceToHost),
        "cudaMemcpy of " + std::to_string(bytes) + " bytes from device " + std::to_string(device) +
            " to host");
}
inline void copy_to_device(void* data, const void* host, std::size_t bytes, int device) {
  device_guard on(device);
  check(cudaMemcpy(data, host, bytes, cudaMemcpyHostToDevice),
        "cudaMemcpy of " + std::to_string(bytes) + " bytes from host to device " +
            std::to_string(device));
}
inline void* allocate_pinned(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMallocHost(&p, bytes), "cudaMallocHost of " + std::to_string(bytes) + " bytes");
  return p;
}
inline void free_pinned(void* p) {
  (void)cudaFreeHost(p);
}
inline void* allocate_device(std::size_t bytes, int device) {
  device_guard on(device);
  void* p = nullptr;
  check(cudaMalloc(&p, bytes),
        "cudaMalloc of " + std::to_string(bytes) + " bytes on device " + std::to_string(device));
  return p;
}
// Queued in the legacy default stream, named as such so that code built
// with a per-thread default stream orders the same way.
inline void copy_on_device(void* dst, const void* src, std::size_t bytes, int device) {
  device_guard on(device);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cudaStreamLegacy),
        "cudaMemcpyAsync of " + std::to_string(bytes) + " bytes within device " +
            std::to_string(device));
}

inline constexpr dcomm::detail::device_memory_hooks memory_hooks{
    &copy_to_host,    &copy_to_device, &allocate_pinned, &free_pinned,
    &allocate_device, &free_device,    &copy_on_device};
// Including this header is what lets the CPU backend take CUDA tensors.
inline const bool memory_hooks_installed = (dcomm::detail::device_memory() = &memory_hooks, true);

}  // namespace detail

}  // namespace dcomm::cuda

// Both are tensors on GPU `device`: collectives take them like any other,
// and a backend that needs host memory refuses them before sending anything.
template <dcomm::element_type T>
struct dcomm::tensor_traits<dcomm::cuda::device_span<T>> {
  static T* data(const cuda::device_span<T>& s) noexcept { return s.data; }
  static std::size_t size(const cuda::device_span<T>& s) noexcept { return s.count; }
  static dcomm::device device(const cuda::device_span<T>& s) noexcept {
    return dcomm::device::cuda(s.device);
  }
};

template <dcomm::element_type T>
struct dcomm::tensor_traits<dcomm::cuda::device_buffer<T>> {
  static T* data(cuda::device_buffer<T>& b) noexcept { return b.data(); }
  static const T* data(const cuda::device_buffer<T>& b) noexcept { return b.data(); }
  static std::size_t size(const cuda::device_buffer<T>& b) noexcept { return b.size(); }
  static dcomm::device device(const cuda::device_buffer<T>& b) noexcept {
    return dcomm::device::cuda(b.device());
  }
};
