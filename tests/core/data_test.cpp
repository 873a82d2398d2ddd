// Tests for distributed_sampler, data_partitioner and the shuffle they share.
// Expectations come from outside the code under test: the padding and
// striding are recomputed here by a literal transcription of torch's
// DistributedSampler.__iter__, and the golden vectors were produced by an
// independent Python implementation of splitmix64 + Fisher-Yates.
#include <doctest/doctest.h>
#include <dcomm/data_partitioner.hpp>
#include <dcomm/detail/shuffle.hpp>
#include <dcomm/distributed_sampler.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>  // doctest prints std::error_code with operator<<
#include <span>
#include <string>
#include <vector>

#include "support/text.hpp"

namespace {

using dcomm::data_partitioner;
using dcomm::distributed_sampler;
using dcomm::distributed_sampler_options;
using index_list = std::vector<std::size_t>;

// torch.utils.data.distributed.DistributedSampler.__iter__, line by line,
// given the (shuffled or not) list of all indices.
index_list torch_indices(index_list indices, std::size_t replicas, std::size_t rank,
                         bool drop_last) {
  const std::size_t n = indices.size();
  std::size_t num_samples = 0;
  if (drop_last && n % replicas != 0)
    num_samples = n < replicas ? 0 : (n - replicas + replicas - 1) / replicas;  // ceil((n-R)/R)
  else
    num_samples = (n + replicas - 1) / replicas;
  const std::size_t total_size = num_samples * replicas;
  if (!drop_last) {
    const std::size_t padding = total_size - n;
    if (padding <= n) {
      indices.insert(indices.end(), indices.begin(), indices.begin() + padding);
    } else {
      index_list repeated;
      const std::size_t copies = (padding + n - 1) / n;
      for (std::size_t c = 0; c < copies; ++c)
        repeated.insert(repeated.end(), indices.begin(), indices.begin() + n);
      indices.insert(indices.end(), repeated.begin(), repeated.begin() + padding);
    }
  } else {
    indices.resize(total_size);
  }
  index_list mine;
  for (std::size_t k = rank; k < total_size; k += replicas) mine.push_back(indices[k]);
  return mine;
}

index_list iota_list(std::size_t n) {
  index_list v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

index_list to_list(const distributed_sampler& s) {
  return index_list(s.begin(), s.end());
}

index_list to_list(std::span<const std::size_t> s) {
  return index_list(s.begin(), s.end());
}

distributed_sampler make(std::size_t n, int replicas, int rank, bool shuffle = true,
                         std::uint64_t seed = 0, bool drop_last = false) {
  return distributed_sampler({.dataset_size = n,
                              .num_replicas = replicas,
                              .rank = rank,
                              .shuffle = shuffle,
                              .seed = seed,
                              .drop_last = drop_last});
}

template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::invalid_argument);
    return e.what();
  }
  FAIL("no dcomm::error thrown");
  return {};
}

using dcomm::test::contains;

}  // namespace

TEST_SUITE("data") {
  TEST_CASE("splitmix64 matches the published reference stream") {
    dcomm::detail::splitmix64 rng(0);
    CHECK(rng.next() == 0xe220a8397b1dcdafULL);
    CHECK(rng.next() == 0x6e789e6aa1b965f4ULL);
    CHECK(rng.next() == 0x06c45d188009454fULL);
  }

  TEST_CASE("shuffle golden vectors (a change here reorders every user's data)") {
    CHECK(dcomm::detail::shuffled_indices(10, 0) == index_list{6, 3, 2, 9, 8, 1, 4, 7, 0, 5});
    CHECK(dcomm::detail::shuffled_indices(10, 42) == index_list{0, 9, 5, 8, 6, 4, 7, 2, 1, 3});
    CHECK(dcomm::detail::shuffled_indices(10, 1234) == index_list{0, 1, 8, 6, 4, 3, 7, 2, 9, 5});
    CHECK(dcomm::detail::shuffled_indices(0, 0).empty());
    CHECK(dcomm::detail::shuffled_indices(1, 99) == index_list{0});
  }

  TEST_CASE("shuffle is a permutation") {
    for (std::size_t n : {2u, 3u, 7u, 64u, 1000u}) {
      for (std::uint64_t seed = 0; seed < 20; ++seed) {
        index_list v = dcomm::detail::shuffled_indices(n, seed);
        std::sort(v.begin(), v.end());
        CHECK(v == iota_list(n));
      }
    }
  }

  TEST_CASE("shuffle is roughly uniform over positions and values") {
    // Seeds are fixed, so this is deterministic: the tolerance only has to
    // absorb sampling noise once (sd ~ 57 around 4000), and a biased shuffle
    // (e.g. j drawn from [0, n) instead of [0, i]) lands far outside it.
    constexpr std::size_t n = 5;
    constexpr std::uint64_t seeds = 20000;
    std::array<std::array<int, n>, n> count{};
    for (std::uint64_t seed = 0; seed < seeds; ++seed) {
      const index_list v = dcomm::detail::shuffled_indices(n, seed);
      for (std::size_t pos = 0; pos < n; ++pos) ++count[pos][v[pos]];
    }
    for (std::size_t pos = 0; pos < n; ++pos) {
      for (std::size_t value = 0; value < n; ++value) {
        CAPTURE(pos);
        CAPTURE(value);
        CHECK(count[pos][value] > 3600);
        CHECK(count[pos][value] < 4400);
      }
    }
  }

  TEST_CASE("uniform_below stays in range and is unbiased for a non-power-of-two bound") {
    dcomm::detail::splitmix64 rng(7);
    std::array<int, 3> count{};
    for (int i = 0; i < 30000; ++i) {
      const std::uint64_t r = dcomm::detail::uniform_below(rng, 3);
      REQUIRE(r < 3);
      ++count[r];
    }
    for (int c : count) {
      CHECK(c > 9500);
      CHECK(c < 10500);
    }
    // A bound just above 2^63 rejects almost half the draws; it must still end.
    const std::uint64_t big = (std::uint64_t{1} << 63) + 1;
    for (int i = 0; i < 100; ++i) CHECK(dcomm::detail::uniform_below(rng, big) < big);
    CHECK(dcomm::detail::uniform_below(rng, 1) == 0);
  }

  TEST_CASE("sampler: divisible N, every index exactly once across ranks, every epoch") {
    constexpr std::size_t n = 120;
    constexpr int replicas = 4;
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      index_list all;
      for (int rank = 0; rank < replicas; ++rank) {
        auto s = make(n, replicas, rank, true, 17);
        s.set_epoch(epoch);
        CHECK(s.num_samples() == n / replicas);
        CHECK(s.size() == n / replicas);
        CHECK(s.total_size() == n);
        all.insert(all.end(), s.begin(), s.end());
      }
      std::sort(all.begin(), all.end());
      CHECK(all == iota_list(n));
    }
  }

  TEST_CASE("sampler: padding repeats the first total_size - N entries of the shuffled list") {
    constexpr std::size_t n = 10;
    constexpr int replicas = 4;  // total_size 12, two duplicates
    constexpr std::uint64_t seed = 5, epoch = 2;
    const index_list order = dcomm::detail::shuffled_indices(n, seed + epoch);
    std::vector<int> seen(n, 0);
    for (int rank = 0; rank < replicas; ++rank) {
      auto s = make(n, replicas, rank, true, seed);
      s.set_epoch(epoch);
      CHECK(s.num_samples() == 3);
      CHECK(s.total_size() == 12);
      CHECK(to_list(s) == torch_indices(order, replicas, static_cast<std::size_t>(rank), false));
      for (std::size_t i : s) ++seen[i];
    }
    for (std::size_t k = 0; k < n; ++k) {
      CAPTURE(k);
      const bool duplicated = order[0] == k || order[1] == k;
      CHECK(seen[k] == (duplicated ? 2 : 1));
    }
  }

  TEST_CASE("sampler: matches torch's arithmetic over many shapes") {
    for (std::size_t n : {0u, 1u, 2u, 3u, 5u, 10u, 11u, 16u, 17u, 33u}) {
      for (int replicas : {1, 2, 3, 4, 7, 8}) {
        for (bool drop_last : {false, true}) {
          for (bool shuffle : {false, true}) {
            const index_list order =
                shuffle ? dcomm::detail::shuffled_indices(n, 3 + 1) : iota_list(n);
            for (int rank = 0; rank < replicas; ++rank) {
              CAPTURE(n);
              CAPTURE(replicas);
              CAPTURE(rank);
              CAPTURE(drop_last);
              CAPTURE(shuffle);
              auto s = make(n, replicas, rank, shuffle, 3, drop_last);
              s.set_epoch(1);
              const index_list expected = torch_indices(order, static_cast<std::size_t>(replicas),
                                                        static_cast<std::size_t>(rank), drop_last);
              CHECK(to_list(s) == expected);
              CHECK(s.indices() == expected);
              CHECK(s.num_samples() == expected.size());
            }
          }
        }
      }
    }
  }

  TEST_CASE("sampler: shuffle=false is the plain strided order, padded from the start") {
    CHECK(to_list(make(10, 3, 0, false)) == index_list{0, 3, 6, 9});
    CHECK(to_list(make(10, 3, 1, false)) == index_list{1, 4, 7, 0});
    CHECK(to_list(make(10, 3, 2, false)) == index_list{2, 5, 8, 1});
    // set_epoch does not change an unshuffled order.
    auto s = make(10, 3, 1, false);
    s.set_epoch(9);
    CHECK(to_list(s) == index_list{1, 4, 7, 0});
  }

  TEST_CASE("sampler: drop_last truncates to floor(N / replicas) * replicas") {
    CHECK(to_list(make(10, 3, 0, false, 0, true)) == index_list{0, 3, 6});
    CHECK(to_list(make(10, 3, 1, false, 0, true)) == index_list{1, 4, 7});
    CHECK(to_list(make(10, 3, 2, false, 0, true)) == index_list{2, 5, 8});
    const auto s = make(10, 3, 2, true, 8, true);
    CHECK(s.num_samples() == 3);
    CHECK(s.total_size() == 9);
    // With a shuffle, the dropped one is the last entry of this epoch's list.
    const index_list order = dcomm::detail::shuffled_indices(10, 8);
    index_list all;
    for (int rank = 0; rank < 3; ++rank) {
      const auto r = make(10, 3, rank, true, 8, true);
      all.insert(all.end(), r.begin(), r.end());
    }
    CHECK(std::find(all.begin(), all.end(), order[9]) == all.end());
    std::sort(all.begin(), all.end());
    CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
    CHECK(all.size() == 9);
  }

  TEST_CASE("sampler: golden vector for N=10, replicas=3, seed 42") {
    // From the independent Python implementation: permutation
    // {0, 9, 5, 8, 6, 4, 7, 2, 1, 3}, padded with its first two entries.
    CHECK(to_list(make(10, 3, 0, true, 42)) == index_list{0, 8, 7, 3});
    CHECK(to_list(make(10, 3, 1, true, 42)) == index_list{9, 6, 2, 0});
    CHECK(to_list(make(10, 3, 2, true, 42)) == index_list{5, 4, 1, 9});
  }

  TEST_CASE("sampler: the permutation depends only on seed + epoch, the same on every rank") {
    constexpr std::size_t n = 50;
    constexpr int replicas = 5;
    for (std::uint64_t epoch : {0u, 1u, 6u}) {
      const index_list order = dcomm::detail::shuffled_indices(n, 100 + epoch);
      for (int rank = 0; rank < replicas; ++rank) {
        auto a = make(n, replicas, rank, true, 100);
        auto b = make(n, replicas, rank, true, 100);
        a.set_epoch(epoch);
        b.set_epoch(epoch);
        CHECK(a.indices() == b.indices());
        for (std::size_t i = 0; i < a.size(); ++i)
          CHECK(a.indices()[i] == order[static_cast<std::size_t>(rank) + i * replicas]);
      }
    }
    // Like torch: seed 7 at epoch 3 is seed 10 at epoch 0, and seed + epoch wraps.
    auto s = make(n, replicas, 2, true, 7);
    s.set_epoch(3);
    CHECK(s.indices() == make(n, replicas, 2, true, 10).indices());
    auto w = make(n, replicas, 2, true, std::numeric_limits<std::uint64_t>::max());
    w.set_epoch(1);
    CHECK(w.indices() == make(n, replicas, 2, true, 0).indices());
  }

  TEST_CASE("sampler: another epoch or another seed gives another order; back again restores") {
    auto s = make(100, 2, 1, true, 0);
    const index_list epoch0 = s.indices();
    s.set_epoch(1);
    CHECK(s.epoch() == 1);
    const index_list epoch1 = s.indices();
    CHECK(epoch1 != epoch0);
    index_list a = epoch0, b = epoch1;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    CHECK(a != b);  // rank 1 reads a different half, not just a different order
    s.set_epoch(0);
    CHECK(s.indices() == epoch0);
    CHECK(make(100, 2, 1, true, 1).indices() != epoch0);
  }

  TEST_CASE("sampler: edge shapes") {
    SUBCASE("N = 0") {
      for (bool drop_last : {false, true}) {
        const auto s = make(0, 3, 1, true, 0, drop_last);
        CHECK(s.size() == 0);
        CHECK(s.total_size() == 0);
        CHECK(s.begin() == s.end());
      }
    }
    SUBCASE("N < replicas: padding cycles through the list") {
      // N=2, replicas 5: list [0,1] padded to [0,1,0,1,0].
      const std::array<index_list, 5> expected{{{0}, {1}, {0}, {1}, {0}}};
      for (int rank = 0; rank < 5; ++rank)
        CHECK(to_list(make(2, 5, rank, false)) == expected[static_cast<std::size_t>(rank)]);
      // N=1 with 4 replicas: everyone reads the only sample.
      for (int rank = 0; rank < 4; ++rank)
        CHECK(to_list(make(1, 4, rank, true, 3)) == index_list{0});
      // drop_last with N < replicas leaves every rank empty, as in torch.
      for (int rank = 0; rank < 5; ++rank) CHECK(make(2, 5, rank, true, 0, true).size() == 0);
    }
    SUBCASE("one replica reads the whole shuffled list") {
      const auto s = make(10, 1, 0, true, 42);
      CHECK(to_list(s) == index_list{0, 9, 5, 8, 6, 4, 7, 2, 1, 3});
      CHECK(to_list(make(4, 1, 0, false)) == index_list{0, 1, 2, 3});
    }
  }

  TEST_CASE("sampler: bad arguments name both values") {
    std::string m = error_message([] { make(10, 0, 0); });
    CHECK(contains(m, "distributed_sampler"));
    CHECK(contains(m, "num_replicas 0"));
    CHECK(contains(m, "rank 0"));
    m = error_message([] { make(10, -2, 0); });
    CHECK(contains(m, "num_replicas -2"));
    m = error_message([] { make(10, 4, 4); });
    CHECK(contains(m, "num_replicas 4"));
    CHECK(contains(m, "rank 4"));
    m = error_message([] { make(10, 4, -1); });
    CHECK(contains(m, "rank -1"));
    m = error_message([] { make(std::numeric_limits<std::size_t>::max(), 2, 0); });
    CHECK(contains(m, "overflows"));
    // A default-constructed options aggregate must be filled in, not silently one replica.
    CHECK_THROWS_AS(distributed_sampler(distributed_sampler_options{}), dcomm::error);
  }

  TEST_CASE("partitioner: the tutorial's default split, golden") {
    // Shuffled list for seed 1234 is {0, 1, 8, 6, 4, 3, 7, 2, 9, 5}.
    const data_partitioner p(10, {0.7, 0.2, 0.1});
    REQUIRE(p.partitions() == 3);
    CHECK(to_list(p.partition(0)) == index_list{0, 1, 8, 6, 4, 3, 7});
    CHECK(to_list(p.partition(1)) == index_list{2, 9});
    CHECK(to_list(p.partition(2)) == index_list{5});
    CHECK(p.unused().empty());
    CHECK(p.seed() == 1234);
    CHECK(p.dataset_size() == 10);
  }

  TEST_CASE("partitioner: sizes are int(f * N), consecutive and disjoint; the rest is unused") {
    const std::vector<double> fractions{0.5, 0.25, 0.1};
    const std::size_t n = 37;
    const data_partitioner p(n, fractions, 9);
    // int(0.5*37)=18, int(0.25*37)=9, int(0.1*37)=3: 7 left over.
    const std::array<std::size_t, 3> sizes{18, 9, 3};
    const index_list order = dcomm::detail::shuffled_indices(n, 9);
    std::size_t start = 0;
    index_list all;
    for (std::size_t i = 0; i < 3; ++i) {
      const auto part = p.partition(i);
      CHECK(part.size() == sizes[i]);
      CHECK(to_list(part) ==
            index_list(order.begin() + static_cast<std::ptrdiff_t>(start),
                       order.begin() + static_cast<std::ptrdiff_t>(start + sizes[i])));
      all.insert(all.end(), part.begin(), part.end());
      start += sizes[i];
    }
    CHECK(p.unused().size() == 7);
    all.insert(all.end(), p.unused().begin(), p.unused().end());
    std::sort(all.begin(), all.end());
    CHECK(all == iota_list(n));  // disjoint, and with unused() they cover everything
  }

  TEST_CASE("partitioner: deterministic for a seed, different for another") {
    const data_partitioner a(200, {0.5, 0.5}, 77);
    const data_partitioner b(200, {0.5, 0.5}, 77);
    const data_partitioner c(200, {0.5, 0.5}, 78);
    CHECK(to_list(a.partition(0)) == to_list(b.partition(0)));
    CHECK(to_list(a.partition(1)) == to_list(b.partition(1)));
    CHECK(to_list(a.partition(0)) != to_list(c.partition(0)));
  }

  TEST_CASE("partitioner: equal()") {
    const auto p = data_partitioner::equal(10, 3);
    REQUIRE(p.partitions() == 3);
    index_list all;
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(p.partition(i).size() == 3);
      all.insert(all.end(), p.partition(i).begin(), p.partition(i).end());
    }
    CHECK(p.unused().size() == 1);
    // Same as the tutorial's fractions [1/3] * 3 where those round well.
    const data_partitioner q(10, std::vector<double>(3, 1.0 / 3));
    for (std::size_t i = 0; i < 3; ++i) CHECK(to_list(p.partition(i)) == to_list(q.partition(i)));
    // Where int(1/49 * 49) rounds to 0, equal() still gives one each.
    const auto r = data_partitioner::equal(49, 49);
    for (std::size_t i = 0; i < 49; ++i) CHECK(r.partition(i).size() == 1);
    CHECK(data_partitioner(49, std::vector<double>(49, 1.0 / 49)).partitions() == 49);
    CHECK(data_partitioner::equal(0, 4).partition(3).empty());
    CHECK(to_list(data_partitioner::equal(10, 1, 1234).partition(0)) ==
          index_list{0, 1, 8, 6, 4, 3, 7, 2, 9, 5});
    const std::string m = error_message([] { data_partitioner::equal(10, 0); });
    CHECK(contains(m, "world is 0"));
  }

  TEST_CASE("partitioner: bad fractions and partition indices are named") {
    std::string m = error_message([] { data_partitioner(10, {0.5, 0.0}); });
    CHECK(contains(m, "fractions[1] is 0"));
    m = error_message([] { data_partitioner(10, {-0.25}); });
    CHECK(contains(m, "fractions[0] is -0.25"));
    m = error_message([] { data_partitioner(10, {1.5}); });
    CHECK(contains(m, "fractions[0] is 1.5"));
    m = error_message([] { data_partitioner(10, {std::numeric_limits<double>::quiet_NaN()}); });
    CHECK(contains(m, "fractions[0] is nan"));
    m = error_message([] { data_partitioner(10, {0.7, 0.2, 0.2}); });
    CHECK(contains(m, "sum to 1.0999999999999999"));
    m = error_message([] { data_partitioner(10, {0.5, 0.5}).partition(2); });
    CHECK(contains(m, "partition 2"));
    CHECK(contains(m, "there are 2"));
    // Exactly 1 and slightly above 1 through rounding are accepted.
    CHECK(data_partitioner(10, {1.0}).partition(0).size() == 10);
    CHECK(data_partitioner(10, std::vector<double>(10, 0.1)).partitions() == 10);
  }
}
