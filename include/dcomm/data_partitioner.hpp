// data_partitioner: the DataPartitioner of PyTorch's "Writing distributed
// applications" tutorial. The indices 0..N-1 are shuffled once with a seed,
// then cut into consecutive pieces: partition i gets the next
// int(fractions[i] * N) of them. Every rank builds the same partitioner and
// reads partition(rank).
//
// As in the tutorial, sizes are rounded down, so up to one index per
// partition (more with fractions summing below 1) is left over and read by no
// one; unused() lists them. Also as in the tutorial, the split is fixed: there
// is no per-epoch reshuffle (distributed_sampler has one).
//
// Differences from the Python: the shuffle is dcomm's fixed splitmix64 +
// Fisher-Yates (detail/shuffle.hpp), not Python's random.Random, so the
// order differs from the tutorial's but is the same on every platform; and
// equal() sizes partitions with exact integer division, floor(N / world),
// where the tutorial's int((1.0 / world) * N) can come out one short through
// rounding (e.g. int(1/49 * 49) == 0).
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <dcomm/detail/shuffle.hpp>
#include <dcomm/error.hpp>

namespace dcomm {

namespace detail {
// Shortest text that reads back as the same double, so that a sum of
// 1.0000000001 is not printed as "1.000000".
inline std::string format_fraction(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}
}  // namespace detail

class data_partitioner {
 public:
  // fractions: one per partition, each in (0, 1], summing to at most 1 (plus
  // 1e-9, so that n copies of 1.0 / n pass).
  data_partitioner(std::size_t dataset_size, std::vector<double> fractions,
                   std::uint64_t seed = 1234)
      : dataset_size_(dataset_size), seed_(seed) {
    double sum = 0;
    for (std::size_t i = 0; i < fractions.size(); ++i) {
      const double f = fractions[i];
      if (!(f > 0 && f <= 1))  // written so that NaN fails too
        throw_error(errc::invalid_argument,
                    {.operation = "data_partitioner",
                     .detail = "fractions[" + std::to_string(i) + "] is " +
                               detail::format_fraction(f) + "; each fraction must be in (0, 1]"});
      sum += f;
    }
    if (sum > 1 + 1e-9)
      throw_error(
          errc::invalid_argument,
          {.operation = "data_partitioner",
           .detail = "fractions sum to " + detail::format_fraction(sum) + " over " +
                     std::to_string(fractions.size()) + " partitions; the sum must be at most 1"});
    std::vector<std::size_t> sizes;
    sizes.reserve(fractions.size());
    const auto n = static_cast<double>(dataset_size);
    for (const double f : fractions) {
      // f * n may exceed what the size_t holds only when it exceeds n; the
      // clamp to what is left happens in build(), like Python's slicing.
      const double wanted = f * n;
      sizes.push_back(wanted >= n ? dataset_size : static_cast<std::size_t>(wanted));
    }
    build(std::move(sizes));
  }

  // world partitions of floor(dataset_size / world) indices each, for
  // partition(rank) on a world of that size.
  static data_partitioner equal(std::size_t dataset_size, int world, std::uint64_t seed = 1234) {
    if (world <= 0)
      throw_error(errc::invalid_argument,
                  {.operation = "data_partitioner::equal",
                   .detail = "world is " + std::to_string(world) + "; it must be at least 1"});
    const auto parts = static_cast<std::size_t>(world);
    return data_partitioner(exact_sizes{}, dataset_size, seed,
                            std::vector<std::size_t>(parts, dataset_size / parts));
  }

  std::size_t partitions() const noexcept { return offsets_.size() - 1; }
  std::size_t dataset_size() const noexcept { return dataset_size_; }
  std::uint64_t seed() const noexcept { return seed_; }

  // The indices of partition i, in shuffled order; valid as long as *this.
  std::span<const std::size_t> partition(std::size_t i) const {
    if (i >= partitions())
      throw_error(errc::invalid_argument,
                  {.operation = "data_partitioner::partition",
                   .detail = "partition " + std::to_string(i) + " requested, but there are " +
                             std::to_string(partitions()) + " partitions"});
    return std::span<const std::size_t>(indices_).subspan(offsets_[i],
                                                          offsets_[i + 1] - offsets_[i]);
  }

  // The indices that the rounding down of sizes left to no partition.
  std::span<const std::size_t> unused() const noexcept {
    return std::span<const std::size_t>(indices_).subspan(offsets_.back());
  }

 private:
  // The tag keeps braced fraction lists in public calls from ever matching this.
  struct exact_sizes {};
  data_partitioner(exact_sizes, std::size_t dataset_size, std::uint64_t seed,
                   std::vector<std::size_t> sizes)
      : dataset_size_(dataset_size), seed_(seed) {
    build(std::move(sizes));
  }

  void build(std::vector<std::size_t> sizes) {
    indices_ = detail::shuffled_indices(dataset_size_, seed_);
    offsets_.reserve(sizes.size() + 1);
    std::size_t start = 0;
    offsets_.push_back(start);
    for (const std::size_t size : sizes) {
      start += std::min(size, dataset_size_ - start);
      offsets_.push_back(start);
    }
  }

  std::size_t dataset_size_;
  std::uint64_t seed_;
  std::vector<std::size_t> indices_;  // all of 0..N-1, shuffled
  std::vector<std::size_t> offsets_;  // partition i is [offsets_[i], offsets_[i + 1])
};

}  // namespace dcomm
