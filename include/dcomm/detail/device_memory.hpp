// How backends that work in host memory (tcp) reach CUDA tensors without
// including CUDA: dcomm/cuda.hpp fills these hooks in when a program
// includes it (and so links the CUDA runtime). Without them, CUDA tensors
// are refused with a message that says what to include.
#pragma once

#include "dcomm/detail/asio_config.hpp"  // first: before any Asio header

#include <algorithm>
#include <asio/any_io_executor.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "dcomm/tensor.hpp"

namespace dcomm::detail {

struct device_memory_hooks {
  // Synchronous copies between host memory and GPU `device`'s memory.
  void (*to_host)(void* host, const void* device_data, std::size_t bytes, int device) = nullptr;
  void (*to_device)(void* device_data, const void* host, std::size_t bytes, int device) = nullptr;
  // Page-locked host memory, which the GPU copies at full speed.
  void* (*allocate_pinned)(std::size_t bytes) = nullptr;
  void (*free_pinned)(void* p) = nullptr;
  // Memory on GPU `device`, and copies within it that are queued in the
  // legacy default stream (ordered after the work queued there before, and
  // before the work of blocking streams queued after; the host does not wait).
  void* (*allocate_device)(std::size_t bytes, int device) = nullptr;
  void (*free_device)(void* p, int device) = nullptr;
  void (*copy_on_device)(void* dst, const void* src, std::size_t bytes, int device) = nullptr;
};

inline const device_memory_hooks*& device_memory() noexcept {
  static const device_memory_hooks* hooks = nullptr;
  return hooks;
}

template <class View>
bool on_device(const View& v) noexcept {
  return v.device.type == device::kind::cuda && v.bytes() != 0;
}

// `bytes` of memory on GPU `device`, owned (move-only).
class device_allocation {
 public:
  device_allocation() = default;
  device_allocation(std::size_t bytes, int device)
      : data_(bytes ? device_memory()->allocate_device(bytes, device) : nullptr), device_(device) {}
  device_allocation(device_allocation&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), device_(other.device_) {}
  device_allocation& operator=(device_allocation&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }
  device_allocation(const device_allocation&) = delete;
  device_allocation& operator=(const device_allocation&) = delete;
  ~device_allocation() { release(); }
  void* data() const noexcept { return data_; }

 private:
  void release() noexcept {
    if (data_) device_memory()->free_device(data_, device_);
    data_ = nullptr;
  }
  void* data_ = nullptr;
  int device_ = 0;
};

// Page-locked host blocks kept for reuse by one backend, on its executor:
// cudaMallocHost is slow and cudaFreeHost may wait for the whole device.
class pinned_blocks {
 public:
  struct block {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  pinned_blocks() = default;
  pinned_blocks(const pinned_blocks&) = delete;
  pinned_blocks& operator=(const pinned_blocks&) = delete;
  ~pinned_blocks() {
    for (auto& b : free_) device_memory()->free_pinned(b.data);
  }
  block take(std::size_t bytes) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) best = it;
    if (best != free_.end()) {
      block b = *best;
      free_.erase(best);
      return b;
    }
    std::size_t size = 4096;
    while (size < bytes) size *= 2;
    return {device_memory()->allocate_pinned(size), size};
  }
  void give(block b) {
    free_.push_back(b);
    if (free_.size() > max_spare) {  // the smallest goes: large operations keep theirs
      auto smallest = std::min_element(free_.begin(), free_.end(),
                                       [](auto& x, auto& y) { return x.bytes < y.bytes; });
      device_memory()->free_pinned(smallest->data);
      free_.erase(smallest);
    }
  }

 private:
  static constexpr std::size_t max_spare = 8;
  std::vector<block> free_;
};

// Host copies of one operation's CUDA tensors: inputs copied from the GPU
// when staged, outputs copied back by copy_back() once the operation has
// succeeded. The copies are synchronous (cudaMemcpy), in the order of the
// legacy default stream: work queued there before the call is in the data.
class host_staging {
 public:
  explicit host_staging(pinned_blocks& pool) : pool_(pool) {}
  host_staging(const host_staging&) = delete;
  host_staging& operator=(const host_staging&) = delete;
  ~host_staging() {
    for (auto& b : taken_) pool_.give(b);
  }
  const_tensor_view in(const const_tensor_view& v) {
    if (!on_device(v)) return v;
    auto b = take(v.bytes());
    device_memory()->to_host(b.data, v.data, v.bytes(), v.device.index);
    return {b.data, v.count, v.type, device::cpu()};
  }
  // `initial`: with the tensor's contents (in place, or parts the
  // operation leaves alone on this rank).
  tensor_view out(const tensor_view& v, bool initial) {
    if (!on_device(v)) return v;
    auto b = take(v.bytes());
    if (initial) device_memory()->to_host(b.data, v.data, v.bytes(), v.device.index);
    back_.push_back({v.data, b.data, v.bytes(), v.device.index});
    return {b.data, v.count, v.type, device::cpu()};
  }
  void copy_back() {
    for (auto& c : back_) device_memory()->to_device(c.device_data, c.host, c.bytes, c.device);
    back_.clear();
  }

 private:
  pinned_blocks::block take(std::size_t bytes) {
    taken_.push_back(pool_.take(bytes));
    return taken_.back();
  }
  struct copy {
    void* device_data;
    const void* host;
    std::size_t bytes;
    int device;
  };
  pinned_blocks& pool_;
  std::vector<pinned_blocks::block> taken_;
  std::vector<copy> back_;
};

// Copies between host and device memory on a thread of their own, in the
// order they were queued, so that the executor moves one slice of a staged
// tensor over the network while others are copied. Each copy, done or
// skipped, is posted back to the executor and counted in its batch.
class copy_thread {
 public:
  // One operation's copies. `done`, `failure` and `waiter` are the
  // executor's; `cancelled` skips the copies not started yet.
  struct batch {
    batch() = default;
    batch(const batch&) = delete;
    batch& operator=(const batch&) = delete;
    ~batch() {
      if (orphan) free_orphan(orphan);
    }
    // The block of an operation that went away while its copies may still
    // touch it (its executor was destroyed): freed after the last of them.
    void adopt(void* block, void (*free_pinned)(void*)) {
      cancelled.store(true, std::memory_order_release);
      orphan = block;
      free_orphan = free_pinned;
    }

    std::size_t done = 0;
    std::exception_ptr failure;
    asio::steady_timer* waiter = nullptr;
    std::atomic<bool> cancelled{false};

   private:
    void* orphan = nullptr;
    void (*free_orphan)(void*) = nullptr;
  };

  explicit copy_thread(asio::any_io_executor ex) : ex_(std::move(ex)) {}
  copy_thread(const copy_thread&) = delete;
  copy_thread& operator=(const copy_thread&) = delete;
  ~copy_thread() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  void to_host(const std::shared_ptr<batch>& b, void* host, const void* device_data,
               std::size_t bytes, int device) {
    queue({b, host, device_data, bytes, device, false});
  }
  void to_device(const std::shared_ptr<batch>& b, void* device_data, const void* host,
                 std::size_t bytes, int device) {
    queue({b, device_data, host, bytes, device, true});
  }

 private:
  struct job {
    std::shared_ptr<batch> b;
    void* dst;
    const void* src;
    std::size_t bytes;
    int device;
    bool to_device;
  };
  void queue(job j) {
    {
      std::lock_guard lock(m_);
      jobs_.push_back(std::move(j));
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    }
    cv_.notify_one();
  }
  void run() {
    for (;;) {
      job j;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (stop_) return;
        j = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::exception_ptr failed;
      if (!j.b->cancelled.load(std::memory_order_acquire)) try {
          if (j.to_device)
            device_memory()->to_device(j.dst, j.src, j.bytes, j.device);
          else
            device_memory()->to_host(j.dst, j.src, j.bytes, j.device);
        } catch (...) {
          failed = std::current_exception();
        }
      asio::post(ex_, [b = std::move(j.b), failed] {
        ++b->done;
        if (failed && !b->failure) b->failure = failed;
        if (b->waiter) b->waiter->cancel();
      });
    }
  }

  asio::any_io_executor ex_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<job> jobs_;
  bool stop_ = false;
  std::thread thread_;  // started with the first copy
};

}  // namespace dcomm::detail
