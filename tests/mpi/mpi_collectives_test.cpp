// The collective suite's cases (support/collective_cases.hpp, the same
// expectations as the CPU backend's tests/tcp/tcp_collectives_test.cpp) on
// the MPI backend, under the real mpirun with worlds 1, 3 and 4: every
// collective, every dtype, counts 0, 1, 7, world-1, 1001 and large ones,
// in place and out of place, functors, runtime-typed views and objects.
#include <doctest/doctest.h>

#include <cstdint>
#include <dcomm/half.hpp>
#include <string>

#include "mpi/mpi_world.hpp"
#include "support/collective_cases.hpp"

using namespace dcomm::test::cases;
using dcomm::test::mpi_comm;
using dcomm::test::mpi_world;
using dcomm::test::run_on;

TEST_SUITE("mpi collectives") {
  TEST_CASE("every collective, every dtype, edge counts") {
    auto& c = mpi_world();
    for (auto count : counts_for(c.size(), 1001)) {
      const std::string failure = run_on(c, [count](mpi_comm& comm) {
        return every_dtype<std::int8_t, std::uint8_t, std::int32_t, std::int64_t, dcomm::float16,
                           dcomm::bfloat16, float, double>(comm, count);
      });
      CHECK_MESSAGE(failure.empty(), failure);
    }
  }

  TEST_CASE("large buffers") {
    const std::string failure = run_on(mpi_world(), [](mpi_comm& comm) -> asio::awaitable<void> {
      co_await every_collective<float>(comm, 300'007);
      co_await every_collective<std::int64_t>(comm, 70'001);
    });
    CHECK_MESSAGE(failure.empty(), failure);
  }

  TEST_CASE("custom functors, runtime-typed views and objects") {
    const std::string failure =
        run_on(mpi_world(), [](mpi_comm& comm) { return functors_views_objects(comm); });
    CHECK_MESSAGE(failure.empty(), failure);
  }
}
