// The CPU backend's staging of CUDA tensors, exercised where there is no
// GPU (CI): "device memory" here is host memory that tensors report as
// device::cuda(0), and the device memory hooks copy it with memcpy after a
// random pause of up to `jitter` (so that copies finish in ever different
// orders relative to the network), or fail on request. What this tests is
// dcomm's own logic: slicing, message order, overlap of copies with the
// network, cleanup after a failure. gpu_tests runs the same cases
// (support/staged_cases.hpp) against the CUDA runtime on a real device.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/detail/device_memory.hpp"
#include "dcomm/error.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm::test::emulated {

struct settings {
  std::atomic<int> jitter_us{0};
  // Copies that touch device bytes in [fail_begin, fail_end) fail.
  std::atomic<const char*> fail_begin{nullptr};
  std::atomic<const char*> fail_end{nullptr};
  std::atomic<long> copies{0};       // made so far
  std::atomic<long> pinned_live{0};  // page-locked blocks not freed yet
  std::atomic<long> device_live{0};  // device allocations not freed yet
  std::atomic<long> copies_on_device{0};
};

inline settings& state() {
  static settings s;
  return s;
}

inline void pause_a_little() {
  const int most = state().jitter_us.load(std::memory_order_relaxed);
  if (most <= 0) return;
  thread_local std::minstd_rand random(
      static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id())));
  std::this_thread::sleep_for(
      std::chrono::microseconds(std::uniform_int_distribution<int>(0, most)(random)));
}

inline void check(const void* device_data, std::size_t bytes, const char* direction) {
  auto* p = static_cast<const char*>(device_data);
  const char* begin = state().fail_begin.load();
  const char* end = state().fail_end.load();
  if (begin && p < end && p + bytes > begin)
    throw_error(errc::device_error, {.operation = "emulated cudaMemcpy",
                                     .detail = std::to_string(bytes) + " bytes " + direction +
                                               " failed, as the test asked"});
}

inline void to_host(void* host, const void* device_data, std::size_t bytes, int) {
  pause_a_little();
  check(device_data, bytes, "to the host");
  std::memcpy(host, device_data, bytes);
  ++state().copies;
}
inline void to_device(void* device_data, const void* host, std::size_t bytes, int) {
  pause_a_little();
  check(device_data, bytes, "to the device");
  std::memcpy(device_data, host, bytes);
  ++state().copies;
}
inline void* allocate_pinned(std::size_t bytes) {
  ++state().pinned_live;
  return ::operator new (bytes, std::align_val_t{64});
}
inline void free_pinned(void* p) {
  --state().pinned_live;
  ::operator delete (p, std::align_val_t{64});
}

inline void* allocate_device(std::size_t bytes, int) {
  ++state().device_live;
  return ::operator new (bytes, std::align_val_t{64});
}
inline void free_device(void* p, int) {
  --state().device_live;
  ::operator delete (p, std::align_val_t{64});
}
inline void copy_on_device(void* dst, const void* src, std::size_t bytes, int) {
  std::memcpy(dst, src, bytes);
  ++state().copies_on_device;
}

inline constexpr detail::device_memory_hooks hooks{
    &to_host,         &to_device,   &allocate_pinned, &free_pinned,
    &allocate_device, &free_device, &copy_on_device};

// For one test's scope: the hooks in place of whatever was installed (the
// CUDA runtime's, where dcomm/cuda.hpp is included), failures off.
class device {
 public:
  explicit device(int jitter_us = 0) : previous_(detail::device_memory()) {
    state().jitter_us = jitter_us;
    fail_copies_of(nullptr, 0);
    detail::device_memory() = &hooks;
  }
  device(const device&) = delete;
  device& operator=(const device&) = delete;
  ~device() {
    detail::device_memory() = previous_;
    fail_copies_of(nullptr, 0);
  }
  // Copies to or from these device bytes fail with errc::device_error.
  static void fail_copies_of(const void* data, std::size_t bytes) {
    state().fail_end = static_cast<const char*>(data) + bytes;
    state().fail_begin = static_cast<const char*>(data);
  }

 private:
  const detail::device_memory_hooks* previous_;
};

// A "device buffer" of T on GPU 0, in host memory.
template <class T>
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t n) : data_(n) {}
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  std::size_t size() const { return data_.size(); }
  const std::vector<T>& host() const { return data_; }
  std::vector<T>& host() { return data_; }

 private:
  std::vector<T> data_;
};

}  // namespace dcomm::test::emulated

template <class T>
struct dcomm::tensor_traits<dcomm::test::emulated::buffer<T>> {
  static T* data(test::emulated::buffer<T>& b) noexcept { return b.data(); }
  static const T* data(const test::emulated::buffer<T>& b) noexcept { return b.data(); }
  static std::size_t size(const test::emulated::buffer<T>& b) noexcept { return b.size(); }
  static dcomm::device device(const test::emulated::buffer<T>&) noexcept {
    return dcomm::device::cuda(0);
  }
};
