// distributed_sampler: which dataset indices this rank reads in an epoch, the
// counterpart of torch.utils.data.distributed.DistributedSampler, with the
// same arithmetic so that a job keeps its data split when ported from Python
// (the shuffled order itself differs: torch.randperm's generator is not
// reproduced, dcomm's is fixed by detail/shuffle.hpp).
//
// Every epoch, all ranks compute the same list of indices: 0..N-1, shuffled by
// a permutation that depends only on seed + epoch (identity when shuffle is
// off). The list is then made a multiple of num_replicas long, so that every
// rank gets the same number of samples and no collective waits on a rank that
// ran out of batches:
//   - drop_last false (default): padded to total_size = ceil(N / R) * R by
//     appending entries from the start of the list, cycling through it again
//     if the padding is longer than the list (N < R - N % R, e.g. N = 1 with
//     R = 4). Up to R - 1 samples are thus seen twice per epoch.
//   - drop_last true: truncated to total_size = floor(N / R) * R; the last
//     N % R entries of the list are not read this epoch (with shuffle they are
//     different ones each epoch).
// Rank r then takes entries r, r + R, r + 2R, ... of that list, so
// num_samples() = total_size / R on every rank.
//
// Like torch, call set_epoch(e) at the start of every epoch, with the same e
// on every rank; otherwise each epoch repeats the order of epoch 0. The seed
// must be the same on every rank too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <dcomm/detail/shuffle.hpp>
#include <dcomm/error.hpp>

namespace dcomm {

struct distributed_sampler_options {
  std::size_t dataset_size{};
  int num_replicas{};  // the world size; no default, 0 is rejected
  int rank{};
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
};

// Not synchronized: set_epoch() must not run concurrently with any other call
// on the same object. The indices of the current epoch are computed in the
// constructor and in set_epoch(), so that iterating is free and allocation
// failures surface there.
class distributed_sampler {
 public:
  using value_type = std::size_t;
  using const_iterator = std::vector<std::size_t>::const_iterator;
  using iterator = const_iterator;

  explicit distributed_sampler(const distributed_sampler_options& options) : options_(options) {
    validate();
    const std::size_t n = options_.dataset_size;
    const auto replicas = static_cast<std::size_t>(options_.num_replicas);
    const std::size_t full_rounds = n / replicas;
    const bool pad = !options_.drop_last && n % replicas != 0;
    num_samples_ = full_rounds + (pad ? 1 : 0);
    total_size_ = num_samples_ * replicas;
    compute_indices();
  }

  // Picks the shuffle for epoch e: the permutation is seeded with seed + e
  // (wrapping), as torch seeds its generator with seed + epoch.
  void set_epoch(std::uint64_t epoch) {
    if (epoch == epoch_) return;
    epoch_ = epoch;
    if (options_.shuffle) compute_indices();
  }
  std::uint64_t epoch() const noexcept { return epoch_; }

  // Samples this rank reads per epoch; the same on every rank.
  std::size_t num_samples() const noexcept { return num_samples_; }
  std::size_t size() const noexcept { return num_samples_; }
  // Samples all ranks read per epoch, padding included.
  std::size_t total_size() const noexcept { return total_size_; }
  const distributed_sampler_options& options() const noexcept { return options_; }

  // This rank's indices for the current epoch, in the order to read them.
  const std::vector<std::size_t>& indices() const noexcept { return indices_; }
  const_iterator begin() const noexcept { return indices_.begin(); }
  const_iterator end() const noexcept { return indices_.end(); }

 private:
  void validate() const {
    const auto& o = options_;
    const std::string both =
        "num_replicas " + std::to_string(o.num_replicas) + ", rank " + std::to_string(o.rank);
    if (o.num_replicas <= 0)
      throw_error(errc::invalid_argument,
                  {.operation = "distributed_sampler",
                   .detail = both + ": num_replicas must be at least 1 (the world size)"});
    if (o.rank < 0 || o.rank >= o.num_replicas)
      throw_error(errc::invalid_argument, {.operation = "distributed_sampler",
                                           .detail = both + ": rank must be in [0, num_replicas)"});
    // total_size rounds N up to a multiple of num_replicas; that must fit.
    const auto replicas = static_cast<std::size_t>(o.num_replicas);
    const std::size_t rest = o.dataset_size % replicas;
    if (!o.drop_last && rest != 0 &&
        o.dataset_size > std::numeric_limits<std::size_t>::max() - (replicas - rest))
      throw_error(errc::invalid_argument,
                  {.operation = "distributed_sampler",
                   .detail = "dataset_size " + std::to_string(o.dataset_size) +
                             " padded to a multiple of num_replicas " +
                             std::to_string(o.num_replicas) + " overflows std::size_t"});
  }

  void compute_indices() {
    const std::size_t n = options_.dataset_size;
    const auto replicas = static_cast<std::size_t>(options_.num_replicas);
    const auto rank = static_cast<std::size_t>(options_.rank);
    indices_.clear();
    indices_.reserve(num_samples_);
    if (num_samples_ == 0) return;  // also covers n == 0, where % n below is undefined
    // Position k of the padded list is entry k % n of the (shuffled) list:
    // that is torch's padding, including its cycling when padding > n.
    if (options_.shuffle) {
      const std::vector<std::size_t> order = detail::shuffled_indices(n, options_.seed + epoch_);
      for (std::size_t i = 0; i < num_samples_; ++i)
        indices_.push_back(order[(rank + i * replicas) % n]);
    } else {
      for (std::size_t i = 0; i < num_samples_; ++i) indices_.push_back((rank + i * replicas) % n);
    }
  }

  distributed_sampler_options options_;
  std::uint64_t epoch_ = 0;
  std::size_t num_samples_ = 0;
  std::size_t total_size_ = 0;
  std::vector<std::size_t> indices_;
};

}  // namespace dcomm
