// dcomm::gradient_bucketer: the core of torch's DistributedDataParallel,
// without autograd. Register the gradient buffers once; each step, mark
// each gradient ready as the backward pass produces it; a bucket's
// all_reduce starts as soon as all of its gradients are ready, while the
// backward pass goes on; wait() finishes with every gradient averaged over
// the group.
//
//   dcomm::gradient_bucketer bucketer(comm);
//   for (auto& layer : layers) bucketer.add(layer.grad);   // forward order
//   for (;;) {                                             // each step
//     forward();
//     for (auto& layer : reversed(layers)) {               // backward
//       layer.backward();
//       bucketer.mark_ready(layer.index);                  // may start a bucket
//     }
//     co_await bucketer.wait();                            // averaged
//     optimizer_step();
//   }
//
// Buckets, as DDP builds them: gradients in reverse registration order (the
// order backward produces them), one dtype and device per bucket, the first bucket
// closed at about first_bucket_bytes (1 MiB) so communication starts early,
// the others at bucket_bytes (25 MiB). Buckets are launched in bucket
// order on every rank, even if a later one fills first: collectives are
// matched by order. Each gradient's result is the group's average of it, the
// same as all_reduce(grad, avg) on its own; only the summation order may
// differ (the bucket's size picks the algorithm), so floating-point results
// may differ in the last bits, as with DDP.
//
// The gradient buffers are borrowed: they must stay alive, and keep their
// size and address, as long as the bucketer is used.
//
// CUDA gradients (where the program includes dcomm/cuda.hpp, as
// dcomm/nccl.hpp does) are packed into a bucket in the same GPU's memory,
// by copies queued in the legacy default stream: after the gradient's
// producers queued there (or on blocking streams), before the all_reduce
// (the nccl backend's stream is a blocking one; the CPU backend's staging
// copies wait for that stream). wait() queues the copies back the same way:
// work queued after it in that stream, or in blocking streams, sees the
// averages; a non-blocking stream must wait for the legacy stream first.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm {

struct bucketer_options {
  // The first bucket closes at this size, so its all_reduce starts early in
  // the backward pass; DDP's 1 MiB.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  // Every later bucket; DDP's bucket_cap_mb = 25.
  std::size_t bucket_bytes = std::size_t{25} << 20;
};

template <backend Backend>
class gradient_bucketer {
 public:
  explicit gradient_bucketer(communicator<Backend> comm, bucketer_options options = {})
      : comm_(std::move(comm)), options_(options) {
    if (!comm_.valid())
      throw_error(errc::invalid_argument,
                  {.operation = "gradient_bucketer", .detail = "an empty communicator"});
  }
  gradient_bucketer(const gradient_bucketer&) = delete;
  gradient_bucketer& operator=(const gradient_bucketer&) = delete;
  // Waits for buckets still in flight: they write into the bucketer.
  ~gradient_bucketer() {
    for (auto& b : buckets_)
      if (b.pending.valid()) try {
          b.pending.wait();
        } catch (...) {
        }
  }

  // Registers a gradient buffer (floating-point; in host memory, or a CUDA
  // tensor); returns its index for mark_ready. Every rank registers the same gradients in the
  // same order. Only before the first step.
  template <mutable_tensor T>
  std::size_t add(T&& grad) {
    if (built_)
      throw_error(errc::invalid_argument,
                  {.operation = "gradient_bucketer.add",
                   .detail = "gradients are registered before the first mark_ready or wait"});
    tensor_view v = mutable_view(grad);
    if (!is_floating(v.type))
      throw_error(errc::invalid_argument,
                  {.operation = "gradient_bucketer.add",
                   .expected = "a floating-point gradient (averaging needs a division)",
                   .seen = std::string(name(v.type))});
    if (v.device.type != device::kind::cpu && !detail::device_memory())
      throw_error(errc::invalid_argument,
                  {.operation = "gradient_bucketer.add",
                   .seen = "a CUDA gradient on device " + std::to_string(v.device.index),
                   .detail = "CUDA gradients are packed on their GPU, which needs the program "
                             "to include dcomm/cuda.hpp (Meson's dcomm_cuda)"});
    grads_.push_back({v, 0, 0});
    return grads_.size() - 1;
  }

  std::size_t size() const { return grads_.size(); }
  std::size_t bucket_count() {
    build();
    return buckets_.size();
  }
  // The gradients of bucket b, in the order they are packed.
  std::vector<std::size_t> bucket_members(std::size_t b) {
    build();
    check_bucket(b);
    return buckets_[b].members;
  }

  // Gradient `index` holds this step's final value. When that completes
  // its bucket, the bucket (and any later full ones, in order) is packed
  // and its all_reduce started. Marking a gradient twice in a step is an
  // error.
  void mark_ready(std::size_t index) {
    build();
    if (index >= grads_.size())
      throw_error(errc::invalid_argument,
                  {.operation = "gradient_bucketer.mark_ready",
                   .expected = "a gradient index below " + std::to_string(grads_.size()),
                   .seen = std::to_string(index)});
    auto& g = grads_[index];
    if (g.ready_step == step_ + 1)
      throw_error(errc::invalid_argument, {.operation = "gradient_bucketer.mark_ready",
                                           .detail = "gradient " + std::to_string(index) +
                                                     " was already marked ready in this step"});
    g.ready_step = step_ + 1;
    auto& b = buckets_[g.bucket];
    ++b.ready;
    if (syncing()) launch_full_buckets();
  }

  // Completes once every bucket's all_reduce has finished and the averages
  // are written back into the gradients; ends the step. Gradients not
  // marked ready count as ready now (so wait() alone averages everything).
  // Inside a no_sync scope nothing is sent: the step just ends.
  template <completion_token_for Token = default_token_t>
  auto wait(Token&& token = {}) {
    build();
    if (syncing()) {
      for (std::size_t i = 0; i < grads_.size(); ++i)
        if (grads_[i].ready_step != step_ + 1) {
          grads_[i].ready_step = step_ + 1;
          ++buckets_[grads_[i].bucket].ready;
        }
      launch_full_buckets();
    }
    auto limit = comm_.timeout() * static_cast<int>(buckets_.size() + 1) + detail::blocking_grace;
    return detail::initiate(comm_.get_executor(), finish_step(), std::forward<Token>(token),
                            "gradient_bucketer.wait", limit);
  }

  // DDP's no_sync(): while a scope is alive, steps only accumulate (the
  // caller adds into its gradients); the first step after it averages the
  // accumulated gradients.
  class no_sync_scope {
   public:
    explicit no_sync_scope(gradient_bucketer& b) : b_(&b) { ++b_->no_sync_depth_; }
    no_sync_scope(no_sync_scope&& other) noexcept : b_(std::exchange(other.b_, nullptr)) {}
    no_sync_scope(const no_sync_scope&) = delete;
    no_sync_scope& operator=(const no_sync_scope&) = delete;
    no_sync_scope& operator=(no_sync_scope&&) = delete;
    ~no_sync_scope() {
      if (b_) --b_->no_sync_depth_;
    }

   private:
    gradient_bucketer* b_;
  };
  [[nodiscard]] no_sync_scope no_sync() { return no_sync_scope(*this); }

 private:
  struct grad {
    tensor_view view;
    std::size_t bucket;
    std::size_t ready_step;  // step_ + 1 once marked in the current step
  };
  struct bucket {
    dtype type;
    dcomm::device device;
    std::vector<std::size_t> members;
    std::vector<std::size_t> offsets;  // in elements
    std::size_t count = 0;
    std::vector<std::byte> flat;            // in host memory
    detail::device_allocation flat_on_gpu;  // or on the gradients' GPU

    bool on_gpu() const { return device.type != device::kind::cpu; }
    void* data() { return on_gpu() ? flat_on_gpu.data() : flat.data(); }
    std::size_t ready = 0;
    request pending;  // valid while the bucket's all_reduce is in flight this step
  };

  static bool is_floating(dtype t) {
    return t == dtype::float16 || t == dtype::bfloat16 || t == dtype::float32 ||
           t == dtype::float64;
  }

  bool syncing() const { return no_sync_depth_ == 0; }

  // DDP's compute_bucket_assignment_by_size: walk the gradients from the
  // last registered; each dtype on each device fills a bucket of its own,
  // which closes once it reaches its limit (the first closed bucket's limit
  // is the small one). Buckets still open at the end follow, host memory's
  // first, then by GPU, each in dtype order.
  void build() {
    if (built_) return;
    built_ = true;
    struct open_bucket {
      bucket b;
      bool used = false;
    };
    std::map<std::tuple<int, int, int>, open_bucket> open;
    bool first = true;
    for (std::size_t i = grads_.size(); i-- > 0;) {
      auto& g = grads_[i];
      auto& o = open[{static_cast<int>(g.view.device.type), g.view.device.index,
                      static_cast<int>(g.view.type)}];
      o.used = true;
      o.b.type = g.view.type;
      o.b.device = g.view.device;
      o.b.members.push_back(i);
      o.b.offsets.push_back(o.b.count);
      o.b.count += g.view.count;
      std::size_t limit = first ? options_.first_bucket_bytes : options_.bucket_bytes;
      if (o.b.count * size_of(o.b.type) >= limit) {
        close(std::move(o.b));
        o = open_bucket{};
        first = false;
      }
    }
    for (auto& [key, o] : open)
      if (o.used) close(std::move(o.b));
  }
  void close(bucket b) {
    for (auto i : b.members) grads_[i].bucket = buckets_.size();
    const std::size_t bytes = b.count * size_of(b.type);
    if (b.on_gpu())
      b.flat_on_gpu = detail::device_allocation(bytes, b.device.index);
    else
      b.flat.resize(bytes);
    buckets_.push_back(std::move(b));
  }

  // Between a gradient and its place in the bucket: memcpy in host memory,
  // a copy queued in the legacy default stream on a GPU.
  static void copy(const bucket& b, void* dst, const void* src, std::size_t bytes) {
    if (!bytes) return;
    if (b.on_gpu())
      detail::device_memory()->copy_on_device(dst, src, bytes, b.device.index);
    else
      std::memcpy(dst, src, bytes);
  }

  void check_bucket(std::size_t b) const {
    if (b >= buckets_.size())
      throw_error(errc::invalid_argument,
                  {.operation = "gradient_bucketer",
                   .expected = "a bucket index below " + std::to_string(buckets_.size()),
                   .seen = std::to_string(b)});
  }

  // Launches, in bucket order, every bucket whose gradients are all ready.
  void launch_full_buckets() {
    while (next_launch_ < buckets_.size()) {
      auto& b = buckets_[next_launch_];
      if (b.ready < b.members.size()) break;
      const std::size_t es = size_of(b.type);
      auto* flat = static_cast<std::byte*>(b.data());
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        const auto& v = grads_[b.members[k]].view;
        copy(b, flat + b.offsets[k] * es, v.data, v.count * es);
      }
      b.pending = comm_.all_reduce(tensor_view{flat, b.count, b.type, b.device}, avg, as_request);
      ++next_launch_;
    }
  }

  // Waits for the buckets in launch order, unpacks each, and ends the step.
  // A failed bucket fails the step, after the others have been waited for.
  DCOMM_EMIT_ON_USE asio::awaitable<void> finish_step() {
    std::exception_ptr failure;
    for (auto& b : buckets_) {
      if (!b.pending.valid()) continue;
      try {
        co_await b.pending.async_wait();
        const std::size_t es = size_of(b.type);
        const auto* flat = static_cast<const std::byte*>(b.data());
        for (std::size_t k = 0; k < b.members.size(); ++k) {
          const auto& v = grads_[b.members[k]].view;
          copy(b, v.data, flat + b.offsets[k] * es, v.count * es);
        }
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      b.pending = request();
    }
    for (auto& b : buckets_) b.ready = 0;
    next_launch_ = 0;
    ++step_;
    if (failure) std::rethrow_exception(failure);
  }

  communicator<Backend> comm_;
  bucketer_options options_;
  std::vector<grad> grads_;
  std::vector<bucket> buckets_;
  bool built_ = false;
  std::size_t next_launch_ = 0;
  std::size_t step_ = 0;
  int no_sync_depth_ = 0;
};

}  // namespace dcomm
