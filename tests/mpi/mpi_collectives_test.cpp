// The collective suite's cases (support/collective_cases.hpp, the same
// expectations as the CPU backend's tests/cpu/collectives_test.cpp) on
// the MPI backend, under the real mpirun with worlds 1, 3 and 4: every
// collective, every dtype, counts 0, 1, 7, world-1, 1001 and large ones,
// in place and out of place, functors, runtime-typed views and objects
// (support/object_cases.hpp: every object collective);
// and the RPC agent (dcomm/rpc.hpp) over MPI's point-to-point.
#include <doctest/doctest.h>

#include <cstdint>
#include <dcomm/half.hpp>
#include <dcomm/rpc.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "mpi/mpi_world.hpp"
#include "support/collective_cases.hpp"
#include "support/object_cases.hpp"

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

  TEST_CASE("every object collective, every kind of value") {
    const std::string failure =
        run_on(mpi_world(), [](mpi_comm& comm) { return object_collectives(comm); });
    CHECK_MESSAGE(failure.empty(), failure);
  }

  TEST_CASE("sendrecv, batch_isend_irecv with wait_all, all_reduce_coalesced") {
    const std::string failure = run_on(mpi_world(), [](mpi_comm& comm) -> asio::awaitable<void> {
      const int n = comm.size(), r = comm.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
      std::vector<float> out(1001, static_cast<float>(r)), in(1001);
      co_await comm.sendrecv(out, next, in, prev);
      if (in != std::vector<float>(1001, static_cast<float>(prev)))
        throw dcomm::test::check_failed("sendrecv");
      std::vector<std::int64_t> buf(3, r);
      co_await comm.sendrecv_replace(buf, next, prev, 5, {});
      if (buf != std::vector<std::int64_t>(3, prev))
        throw dcomm::test::check_failed("sendrecv_replace");
      if (n > 1) {
        std::vector<std::int32_t> x(7, r), got(7, -1);
        std::vector<dcomm::p2p_op> ring{dcomm::irecv_op(got, prev, 2), dcomm::isend_op(x, next, 2)};
        auto reqs = comm.batch_isend_irecv(ring);
        co_await dcomm::async_wait_all(reqs);
        if (got != std::vector<std::int32_t>(7, prev))
          throw dcomm::test::check_failed("batch_isend_irecv");
      }
      std::vector<double> a(2, 1.0), b(5, r);
      std::vector<dcomm::tensor_view> bufs{dcomm::mutable_view(a), dcomm::mutable_view(b)};
      co_await comm.all_reduce_coalesced(bufs, dcomm::sum);
      if (a != std::vector<double>(2, n) || b != std::vector<double>(5, n * (n - 1) / 2.0))
        throw dcomm::test::check_failed("all_reduce_coalesced");
    });
    CHECK_MESSAGE(failure.empty(), failure);
  }

  TEST_CASE("rpc: calls, tensors and remote references over MPI") {
    const std::string failure = run_on(mpi_world(), [](mpi_comm& comm) -> asio::awaitable<void> {
      dcomm::rpc::registry f;
      const int me = comm.rank();
      f.add("add", [](std::int32_t a, std::int32_t b) { return a + b; });
      f.add("whoami", [me] { return me; });
      f.add("scale", [](std::vector<float> v, float by) {
        for (auto& x : v) x *= by;
        return v;
      });
      auto rpc = co_await dcomm::rpc::start(comm, f);
      const int next = (me + 1) % comm.size();
      if (co_await rpc.call<std::int32_t>(next, "add", me, 40) != me + 40)
        throw std::runtime_error("add");
      if (co_await rpc.call<int>(next, "whoami") != next) throw std::runtime_error("whoami");
      std::vector<float> v(100'003);  // a tensor beside the payload
      std::iota(v.begin(), v.end(), 0.0f);
      auto doubled = co_await rpc.call<std::vector<float>>(next, "scale", v, 2.0f);
      for (std::size_t i = 0; i < v.size(); ++i)
        if (doubled[i] != 2 * v[i]) throw std::runtime_error("scale at " + std::to_string(i));
      {
        auto ref = co_await rpc.remote<int>(next, "whoami");
        if (co_await ref.to_here() != next) throw std::runtime_error("to_here");
      }
      co_await rpc.shutdown();
      if (rpc.values_held() != 0) throw std::runtime_error("a remote value was not released");
    });
    CHECK_MESSAGE(failure.empty(), failure);
  }
}
