// The one shuffle that distributed_sampler and data_partitioner share. Every
// rank must compute the same permutation from the same seed, whatever its
// compiler or standard library, so nothing here comes from <random>:
// std::shuffle and the std distributions are implementation-defined. The
// algorithms below are fixed, and tests/data_test.cpp pins golden outputs, so
// changing any line here changes every user's data order and must be treated
// as a breaking change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace dcomm::detail {

// splitmix64 (Steele, Lea, Flood 2014): tiny, fully specified, and passes
// BigCrush; ample for data order, where cryptographic strength is irrelevant.
// Any 64-bit seed (0 included) gives a good stream.
class splitmix64 {
 public:
  explicit constexpr splitmix64(std::uint64_t seed) noexcept : state_(seed) {}

  constexpr std::uint64_t next() noexcept {
    state_ += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t state_;
};

// Uniform in [0, bound), bound > 0, without modulo bias: draws below 2^64 mod
// bound are rejected so that every residue has the same number of preimages.
// Rejection instead of Lemire's multiply keeps this free of __int128, which
// -Wpedantic rejects; the cost is one 64-bit division per draw.
constexpr std::uint64_t uniform_below(splitmix64& rng, std::uint64_t bound) noexcept {
  const std::uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const std::uint64_t r = rng.next();
    if (r >= threshold) return r % bound;
  }
}

// Fisher-Yates, from the back: position i swaps with a uniform j in [0, i].
template <class T>
void shuffle(std::vector<T>& values, std::uint64_t seed) noexcept {
  splitmix64 rng(seed);
  for (std::size_t i = values.size(); i > 1; --i) {
    const auto j = static_cast<std::size_t>(uniform_below(rng, i));
    std::swap(values[i - 1], values[j]);
  }
}

// 0, 1, ..., n-1 in the order shuffle() puts them for this seed.
inline std::vector<std::size_t> shuffled_indices(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> indices(n);
  std::iota(indices.begin(), indices.end(), std::size_t{0});
  shuffle(indices, seed);
  return indices;
}

}  // namespace dcomm::detail
