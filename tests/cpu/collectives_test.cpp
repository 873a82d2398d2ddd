// Every collective of the CPU backend against computed expectations
// (support/collective_cases.hpp, shared with the MPI backend's suite):
// every dtype, world sizes 1-8, counts 0, 1, 7, world-1 and a large count
// not divisible by the world size, in place and out of place, each
// algorithm forced on its own.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "dcomm/store/hash_store.hpp"
#include "support/collective_cases.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::check_failed;
using dcomm::test::comm;
using namespace dcomm::test::cases;

namespace {

// Small eager limit and chunks, so that the rendezvous protocol, chunking
// and pipelining are exercised with counts that keep the test fast.
dcomm::cpu_backend::options small_messages() {
  dcomm::cpu_backend::options o;
  o.eager_limit = 512;
  o.chunk_bytes = 1024;
  o.small_all_reduce = 256;
  o.small_broadcast = 256;
  o.small_all_gather = 256;
  o.small_reduce_scatter = 256;
  // Where the ranks share memory, the arena's collectives take several
  // steps, and all_reduce splits its reduction, at these counts too.
  o.shm_slot_bytes = 4096;
  return o;
}

}  // namespace

TEST_SUITE("cpu collectives") {
  TEST_CASE("every collective, every dtype, worlds 1 to 8, edge counts") {
    DCOMM_TEST_DEADLINE(240s);
    for (int world : {1, 2, 3, 4, 5, 8}) {
      CAPTURE(world);
      // 1001 is not divisible by any of the worlds but 1; with the small
      // limits it takes the ring, chain and rendezvous paths.
      const std::size_t large = 1001;
      DCOMM_REQUIRE_WORLD(
          world,
          [&](comm& c, int) -> asio::awaitable<void> {
            for (auto count : counts_for(world, large))
              co_await every_dtype<std::int8_t, std::uint8_t, std::int32_t, std::int64_t,
                                   dcomm::float16, dcomm::bfloat16, float, double>(c, count);
          },
          60s, small_messages());
    }
  }

  TEST_CASE("default limits: large buffers take the ring and chain at their real sizes") {
    DCOMM_TEST_DEADLINE(120s);
    for (int world : {2, 3}) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [&](comm& c, int) -> asio::awaitable<void> {
        co_await every_collective<float>(c, 300'007);  // > chunk and eager limits
        co_await every_collective<std::int64_t>(c, 70'001);
      });
    }
  }

  TEST_CASE("each algorithm forced on its own") {
    DCOMM_TEST_DEADLINE(120s);
    using A = dcomm::algorithm;
    for (int world : {2, 3, 5}) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(
          world,
          [&](comm& c, int) -> asio::awaitable<void> {
            const int n = c.size(), r = c.rank();
            // The arena's algorithms where every rank shares this host's memory.
            bool arena = true;
            for (int p = 0; p < n; ++p)
              if (p != r && c.backend().link_to(p) != "shm") arena = false;
            auto with_arena = [arena](std::vector<A> as) {
              if (arena) as.push_back(A::shared_memory);
              return as;
            };
            if (arena) co_await c.barrier({.algorithm = A::shared_memory});
            for (std::size_t count :
                 {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1001}}) {
              for (auto a : with_arena({A::recursive_doubling, A::ring})) {
                dcomm::op_options o{.algorithm = a};
                co_await reductions<std::int32_t>(c, count, o);
                co_await reductions<float>(c, count, o);
                const auto in = inputs<double>(r, count, dcomm::reduce_kind::sum);
                std::vector<double> out(count);
                co_await c.all_reduce(in, out, dcomm::sum, o);
                expect_equal<double>({"all_reduce " + std::string(dcomm::name(a)), r, n, count},
                                     out,
                                     expected_vector<double>(n, count, dcomm::reduce_kind::sum));
              }
              for (auto a : with_arena({A::binomial_tree, A::chain})) {
                dcomm::op_options o{.algorithm = a};
                for (int root = 0; root < n; ++root) {
                  auto buf = r == root ? inputs<std::int64_t>(r, count, dcomm::reduce_kind::sum)
                                       : std::vector<std::int64_t>(count);
                  co_await c.broadcast(buf, root, o);
                  expect_equal<std::int64_t>(
                      {"broadcast " + std::string(dcomm::name(a)), r, n, count}, buf,
                      inputs<std::int64_t>(root, count, dcomm::reduce_kind::sum));
                  auto red = inputs<std::int64_t>(r, count, dcomm::reduce_kind::sum);
                  co_await c.reduce(red, root, dcomm::sum, o);
                  if (r == root)
                    expect_equal<std::int64_t>(
                        {"reduce " + std::string(dcomm::name(a)), r, n, count}, red,
                        expected_vector<std::int64_t>(n, count, dcomm::reduce_kind::sum));
                }
              }
              for (auto a : with_arena({A::direct, A::ring})) {
                dcomm::op_options o{.algorithm = a};
                const auto in = inputs<std::uint8_t>(r, count, dcomm::reduce_kind::sum);
                std::vector<std::uint8_t> out(count * static_cast<std::size_t>(n)), want;
                for (int p = 0; p < n; ++p) {
                  auto part = inputs<std::uint8_t>(p, count, dcomm::reduce_kind::sum);
                  want.insert(want.end(), part.begin(), part.end());
                }
                co_await c.all_gather(in, out, o);
                expect_equal<std::uint8_t>(
                    {"all_gather " + std::string(dcomm::name(a)), r, n, count}, out, want);
                if (a == A::shared_memory) continue;  // reduce_scatter has no arena algorithm
                const auto rs_in =
                    inputs<float>(r, count * static_cast<std::size_t>(n), dcomm::reduce_kind::min);
                std::vector<float> rs_out(count);
                co_await c.reduce_scatter(rs_in, rs_out, dcomm::min, o);
                auto all = expected_vector<float>(n, count * static_cast<std::size_t>(n),
                                                  dcomm::reduce_kind::min);
                std::vector<float> mine(
                    all.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)),
                    all.begin() +
                        static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r + 1)));
                expect_equal<float>({"reduce_scatter " + std::string(dcomm::name(a)), r, n, count},
                                    rs_out, mine);
              }
            }
          },
          30s, small_messages());
    }
  }

  TEST_CASE("custom functors, runtime-typed views and objects") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world : {1, 3})
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int) { return functors_views_objects(c); });
  }

  // Recursive doubling (detail/recursive_doubling.hpp) combines the lower
  // rank's value first on both sides of each exchange: with an operator
  // that does not commute, every rank still ends with the same value
  // (worlds with folded ranks included).
  TEST_CASE("recursive doubling: the same result on every rank, whatever the operator") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world : {2, 3, 4, 5, 6})
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int r) -> asio::awaitable<void> {
        auto lower_first = [](std::int64_t a, std::int64_t b) { return 3 * a + b; };
        std::vector<std::int64_t> v{r + 1, 10 * (r + 1)};
        co_await c.all_reduce(v, lower_first,
                              dcomm::op_options{.algorithm = dcomm::algorithm::recursive_doubling});
        std::vector<std::int64_t> all(2 * static_cast<std::size_t>(c.size()));
        co_await c.all_gather(v, all);
        for (int p = 0; p < c.size(); ++p)
          for (std::size_t i = 0; i < 2; ++i)
            if (all[2 * static_cast<std::size_t>(p) + i] != v[i])
              throw check_failed("world " + std::to_string(c.size()) + ": rank " +
                                 std::to_string(p) + " has " +
                                 std::to_string(all[2 * static_cast<std::size_t>(p) + i]) +
                                 ", rank " + std::to_string(r) + " " + std::to_string(v[i]));
        // And it is a combination of every rank's value: the sum's
        // coefficients are all at least 1.
        std::int64_t least = 0;
        for (int p = 0; p < c.size(); ++p) least += p + 1;
        if (v[0] < least)
          throw check_failed("a rank's value was left out: " + std::to_string(v[0]));
      });
  }

  // In the arena a small all_reduce reduces within its first spin, outside
  // any coroutine (call::at_once): what its functor throws must still fail
  // the call the way it does anywhere else, and leave the group usable.
  TEST_CASE("a reduction functor that throws fails the call; the next call works") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world : {2, 3})
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int r) -> asio::awaitable<void> {
        auto refuses_13 = [](std::int32_t a, std::int32_t b) {
          if (a == 13 || b == 13) throw std::domain_error("13 refused");
          return a + b;
        };
        for (std::size_t count : {std::size_t{1}, std::size_t{5000}}) {
          std::vector<std::int32_t> v(count, 13);
          std::string got;
          try {
            co_await c.all_reduce(v, refuses_13);
          } catch (const std::domain_error& e) {
            got = e.what();
          } catch (const dcomm::error& e) {
            got = "dcomm::error";  // told by a rank whose functor threw
          }
          if (got.empty())
            throw check_failed("rank " + std::to_string(r) + ": the call did not fail");
          std::vector<std::int32_t> w(count, r);
          co_await c.all_reduce(w, refuses_13);
          const int n = c.size();
          expect_equal<std::int32_t>({"all_reduce after the failed one", r, n, count}, w,
                                     std::vector<std::int32_t>(count, n * (n - 1) / 2));
        }
      });
  }

  TEST_CASE("bad input fails before anything is sent, naming the operation") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      auto expect_invalid = [&](std::string what, std::exception_ptr e, std::string needle) {
        try {
          std::rethrow_exception(e);
        } catch (const dcomm::error& err) {
          if (err.code() != dcomm::errc::invalid_argument ||
              std::string(err.what()).find(needle) == std::string::npos)
            throw check_failed(what + ": wrong error: " + err.what());
          return;
        }
      };
      auto attempt = [](auto op) -> asio::awaitable<std::exception_ptr> {
        try {
          co_await op();
        } catch (...) {
          co_return std::current_exception();
        }
        co_return nullptr;
      };
      std::vector<float> v(4), small(3), big(8);
      std::vector<double> d(4);
      auto e = co_await attempt([&] { return c.broadcast(v, 2); });
      expect_invalid("root out of range", e, "root 2 is out of range");
      e = co_await attempt([&] { return c.all_reduce(v, small, dcomm::sum); });
      expect_invalid("size mismatch", e, "all_reduce");
      e = co_await attempt([&] { return c.all_gather(v, small); });
      expect_invalid("all_gather output size", e, "must hold 2 blocks");
      e = co_await attempt([&] { return c.send(v, r); });
      expect_invalid("send to self", e, "itself");
      e = co_await attempt([&] { return c.recv(v, -1); });
      expect_invalid("negative peer", e, "out of range");
      std::span<float> head(big.data(), 4), overlapping(big.data() + 2, 4);
      e = co_await attempt([&] { return c.all_reduce(head, overlapping, dcomm::sum); });
      expect_invalid("overlap", e, "overlap");
      dcomm::tensor_view iv{v.data(), v.size(), dcomm::dtype::int32, {}};
      dcomm::tensor_view fv{d.data(), d.size(), dcomm::dtype::float64, {}};
      e = co_await attempt([&] { return c.all_reduce(fv, dcomm::band); });
      expect_invalid("bitwise on floats at run time", e, "integral");
      e = co_await attempt([&] { return c.all_reduce(iv, dcomm::avg); });
      expect_invalid("avg on ints at run time", e, "floating");
      dcomm::op_options wrong{.algorithm = dcomm::algorithm::chain};
      e = co_await attempt([&] { return c.all_reduce(v, dcomm::sum, wrong); });
      expect_invalid("an algorithm all_reduce lacks", e, "not available");
      // Never dereferenced: refused for where it lives before any byte moves.
      dcomm::tensor_view on_gpu{v.data(), v.size(), dcomm::dtype::float32, dcomm::device::cuda(0)};
      e = co_await attempt([&] { return c.all_reduce(on_gpu, dcomm::sum); });
      expect_invalid("a CUDA tensor", e, "host memory");
      e = co_await attempt([&] { return c.broadcast(on_gpu, 0); });
      expect_invalid("a CUDA tensor to broadcast", e, "nccl backend");
      dcomm::op_options on_stream{.stream = reinterpret_cast<CUstream_st*>(std::uintptr_t{8})};
      e = co_await attempt([&] { return c.all_reduce(v, dcomm::sum, on_stream); });
      expect_invalid("a stream", e, "no streams");
      // The numbering stayed in step: a real collective still works.
      std::vector<int> one{1};
      co_await c.all_reduce(one, dcomm::sum);
      if (one[0] != 2) throw check_failed("all_reduce after refused calls");
    });
  }

  // The backend's state is not locked: on an io_context that several
  // threads run it lives on a strand; on one made for one thread
  // (concurrency hint 1, as thread worlds make theirs) on the context's own
  // executor. Here two ranks, each on an io_context that three threads
  // run, start point-to-point calls from four coroutines at once (which
  // those threads resume concurrently) while a fifth makes collectives.
  TEST_CASE("an io_context that several threads run: the backend keeps to a strand") {
    DCOMM_TEST_DEADLINE(120s);
    using strand_type = asio::strand<asio::io_context::executor_type>;
    constexpr int rounds = 150, talkers = 4;
    auto table = std::make_shared<dcomm::hash_store::table>();
    std::vector<std::string> errors(2);
    auto rank_main = [&](int rank) -> asio::awaitable<void> {
      const auto ex = co_await asio::this_coro::executor;
      auto store = dcomm::hash_store::create(asio::make_strand(ex), table);
      dcomm::init_options<dcomm::cpu_backend> o{.timeout = 30s, .job_token = ""};
      o.backend.bind_host = "127.0.0.1";
      auto c = co_await dcomm::init_process_group<dcomm::cpu_backend>(ex, store, rank, 2, o);
      if (c.get_executor().target_type() != typeid(strand_type))
        throw check_failed("the backend's executor is not a strand of the io_context");
      const int peer = 1 - rank;
      auto talk = [&c, rank, peer](int tag) -> asio::awaitable<void> {
        for (int i = 0; i < rounds; ++i) {
          std::vector<std::int32_t> mine(1 + i % 5, rank * 1000 + tag * 100 + i), theirs(1 + i % 5);
          if (rank == 0) {
            co_await c.send(mine, peer, tag);
            co_await c.recv(theirs, peer, tag);
          } else {
            co_await c.recv(theirs, peer, tag);
            co_await c.send(mine, peer, tag);
          }
          for (auto v : theirs)
            if (v != peer * 1000 + tag * 100 + i)
              throw check_failed("tag " + std::to_string(tag) + " round " + std::to_string(i) +
                                 ": received " + std::to_string(v));
        }
      };
      auto gather = [&c]() -> asio::awaitable<void> {
        for (int i = 0; i < rounds; ++i) {
          std::vector<std::int64_t> x{c.rank() + i, 1};
          co_await c.all_reduce(x, dcomm::sum);
          if (x != std::vector<std::int64_t>{1 + 2 * i, 2})
            throw check_failed("all_reduce round " + std::to_string(i));
          co_await c.barrier();
        }
      };
      std::vector<std::future<void>> running;
      for (int tag = 0; tag < talkers; ++tag)
        running.push_back(asio::co_spawn(ex, talk(tag), asio::use_future));
      running.push_back(asio::co_spawn(ex, gather(), asio::use_future));
      // Waited for without blocking a thread of the context, every one
      // (they use `c`) before any failure is rethrown.
      asio::steady_timer tick(ex);
      for (auto& f : running)
        while (f.wait_for(0s) != std::future_status::ready) {
          tick.expires_after(1ms);
          co_await tick.async_wait(asio::use_awaitable);
        }
      for (auto& f : running) f.get();
      co_await c.barrier();
    };
    {
      std::vector<std::jthread> ranks;
      for (int r = 0; r < 2; ++r)
        ranks.emplace_back([&, r] {
          asio::io_context io;  // the default hint: any number of threads
          auto done = asio::co_spawn(io, rank_main(r), asio::use_future);
          {
            std::vector<std::jthread> runners;
            for (int t = 0; t < 3; ++t) runners.emplace_back([&io] { io.run(); });
          }
          try {
            done.get();
          } catch (const std::exception& e) {
            errors[static_cast<std::size_t>(r)] = e.what();
          }
        });
    }
    CHECK(errors[0] == "");
    CHECK(errors[1] == "");
  }

  TEST_CASE("a thread world's io_context is made for one thread: no strand") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int) -> asio::awaitable<void> {
      if (c.get_executor().target_type() != typeid(asio::io_context::executor_type))
        throw check_failed("the backend's executor is not the io_context's own");
      co_await c.barrier();
    });
  }
}
