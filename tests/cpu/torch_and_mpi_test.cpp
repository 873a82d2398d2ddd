// What torch.distributed and MPI users reach for (docs/torch_and_mpi.md),
// on the CPU backend.
//
// "cpu objects": the object collectives (object_collectives.hpp), every
// kind of value in worlds 1-6 (thread worlds; the suite runs again over TCP
// and as two hosts), in processes with the blocking, future, callback and
// request tokens, and what they refuse: ranks passing different types,
// roots or list lengths all fail with errc::mismatch and the group goes on;
// bytes that do not parse fail on the ranks that read them; bad input fails
// before anything is sent.
//
// "default group": default_group.hpp, in processes (the default is the
// process's), from several threads at once.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/default_group.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/spawn.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"
#include "support/object_cases.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

// Writes one byte more than it reads: the receivers find it left over.
struct overlong {
  std::int32_t v = 0;
};

}  // namespace

template <>
struct dcomm::codec<overlong> {
  static std::string name() { return "overlong"; }
  static void write(dcomm::writer& w, const overlong& x) {
    w(x.v);
    w(std::uint8_t{0});
  }
  static void read(dcomm::reader& r, overlong& x) { r(x.v); }
};

namespace {

// Every rank's failure of `op` must be a mismatch whose message has `text`;
// then the group must still work (the first exchange completed everywhere).
// `text` is a pointer: g++ 12 cannot pass a literal's array to a coroutine.
template <class F>
asio::awaitable<void> mismatch_then_go_on(comm& c, F op, const char* text) {
  auto [code, what] = co_await failure_of(op);
  require(code == dcomm::errc::mismatch, "expected a mismatch, got '" + what + "'");
  require(contains(what, text), "'" + what + "' does not say '" + std::string(text) + "'");
  auto ranks = co_await c.all_gather_object(c.rank());
  require(ranks.size() == static_cast<std::size_t>(c.size()), "the group goes on");
}

}  // namespace

TEST_SUITE("cpu objects") {
  TEST_CASE("every object collective, every kind of value, worlds 1-6") {
    DCOMM_TEST_DEADLINE(120s);
    for (int world = 1; world <= 6; ++world) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world,
                          [](comm& c, int) { return dcomm::test::cases::object_collectives(c); });
    }
  }

  TEST_CASE("ranks passing different types, roots or lengths all fail with mismatch") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      // Types: rank 1 passes a string where the others pass an int.
      co_await mismatch_then_go_on(
          c,
          [&]() -> asio::awaitable<void> {
            if (r == 1) {
              std::string s = "a string";
              co_await c.broadcast_object(s, 0);
            } else {
              std::int32_t v = 7;
              co_await c.broadcast_object(v, 0);
            }
          },
          r == 1 ? "ranks {0}" : "ranks {1}");
      co_await mismatch_then_go_on(
          c,
          [&]() -> asio::awaitable<void> {
            if (r == 2)
              (void)co_await c.all_gather_object(std::string("x"));
            else
              (void)co_await c.all_gather_object(std::int64_t{1});
          },
          r == 2 ? "ranks {0,1}" : "ranks {2}");
      co_await mismatch_then_go_on(
          c,
          [&]() -> asio::awaitable<void> {
            const std::vector<int> ints(1, 1);  // named: g++ 12 and braced temporaries
            const std::vector<float> floats(1, 1.0f);
            if (r == 0)
              (void)co_await c.gather_object(ints, 2);
            else
              (void)co_await c.gather_object(floats, 2);
          },
          "another type, root or list length");
      // Roots: rank 0 names root 0, the others root 1.
      co_await mismatch_then_go_on(
          c,
          [&]() -> asio::awaitable<void> {
            std::vector<std::string> in(3, "v");
            (void)co_await c.scatter_object(in, r == 0 ? 0 : 1);
          },
          "another type, root or list length");
      // Lengths: broadcast_object_list wants one length everywhere.
      co_await mismatch_then_go_on(
          c,
          [&]() -> asio::awaitable<void> {
            std::vector<std::string> list(r == 2 ? 2 : 3);
            co_await c.broadcast_object_list(list, 0);
          },
          "list length");
    });
  }

  TEST_CASE("bytes that do not parse as the type fail on the ranks that read them") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      overlong x{r == 1 ? 5 : 0};
      auto [code, what] = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await c.broadcast_object(x, 1); });
      if (r == 1) {
        require(code == dcomm::errc{}, "the root reads nothing: " + what);
      } else {
        require(code == dcomm::errc::mismatch, "expected a mismatch, got '" + what + "'");
        require(contains(what, "rank 1") && contains(what, "left over"), what);
      }
      auto all = co_await c.all_gather_object(std::string("after"));
      require(all.size() == 3, "the group goes on");
    });
  }

  TEST_CASE("bad input fails before anything is sent, and takes no sequence number") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      auto refused = [](auto f) -> asio::awaitable<std::string> {
        auto [code, what] = co_await failure_of(f);
        require(code == dcomm::errc::invalid_argument, "expected invalid_argument: '" + what + "'");
        co_return what;
      };
      std::string s;
      auto what =
          co_await refused([&]() -> asio::awaitable<void> { co_await c.broadcast_object(s, 2); });
      require(contains(what, "broadcast_object") && contains(what, "root"), what);
      what = co_await refused(
          [&]() -> asio::awaitable<void> { (void)co_await c.gather_object(s, -1); });
      require(contains(what, "gather_object"), what);
      what = co_await refused([&]() -> asio::awaitable<void> {
        (void)co_await c.all_gather_object(s,
                                           dcomm::op_options{.algorithm = dcomm::algorithm::ring});
      });
      require(contains(what, "no algorithm to choose"), what);
      if (r == 0) {  // the root alone refuses: the other rank does not call
        what = co_await refused([&]() -> asio::awaitable<void> {
          (void)co_await c.scatter_object(std::vector<std::string>(3), 0);
        });
        require(contains(what, "one value per rank: 3 for a group of 2"), what);
      }
      // None took a number: the next call matches.
      std::vector<std::string> in{"zero", "one"};
      auto mine = co_await c.scatter_object(in, 0);
      require(mine == (r == 0 ? "zero" : "one"), "scatter_object after the refusals: " + mine);
    });
  }

  TEST_CASE("in processes: blocking, future and callback tokens") {
    DCOMM_TEST_DEADLINE(90s);
    dcomm::spawn(
        3,
        [](int rank, int world) {
          auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 30s});
          std::map<std::string, int> config;
          if (rank == 2) config = {{"epochs", 3}, {"world", world}};
          c.broadcast_object(config, 2, dcomm::blocking);
          if (config != std::map<std::string, int>{{"epochs", 3}, {"world", 3}}) return 2;
          auto names = c.gather_object("rank " + std::to_string(rank), 0, dcomm::blocking);
          if (rank == 0 && names != std::vector<std::string>{"rank 0", "rank 1", "rank 2"})
            return 3;
          std::vector<std::vector<int>> shards;
          if (rank == 1) shards = {{0}, {1, 1}, {}};
          auto shard = c.scatter_object(shards, 1, asio::use_future).get();
          if (shard != std::vector<int>(static_cast<std::size_t>(rank == 2 ? 0 : rank + 1), rank))
            return 4;
          std::promise<std::vector<std::set<int>>> got;
          c.all_gather_object(std::set<int>{rank, -rank},
                              [&](std::exception_ptr e, std::vector<std::set<int>> v) {
                                if (e)
                                  got.set_exception(e);
                                else
                                  got.set_value(std::move(v));
                              });
          auto sets = got.get_future().get();
          for (int p = 0; p < world; ++p)
            if (sets[static_cast<std::size_t>(p)] != std::set<int>{p, -p}) return 5;
          std::vector<std::string> list(2);
          if (rank == 0) list = {"a", "b"};
          c.broadcast_object_list(list, 0, dcomm::as_request).wait();
          if (list != std::vector<std::string>{"a", "b"}) return 6;
          return 0;
        },
        {.timeout = 60s});
  }
}

TEST_SUITE("default group") {
  TEST_CASE("set by init_process_group, read from anywhere, cleared by destroy_process_group") {
    DCOMM_TEST_DEADLINE(90s);
    dcomm::spawn(
        3,
        [](int rank, int world) {
          if (dcomm::is_initialized()) return 2;
          try {
            (void)dcomm::get_rank();
            return 3;
          } catch (const dcomm::error& e) {
            if (e.code() != dcomm::errc::invalid_argument ||
                !contains(e.what(), "set_default = true"))
              return 4;
          }
          dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 30s, .set_default = true});
          if (!dcomm::is_initialized() || dcomm::get_rank() != rank ||
              dcomm::get_world_size() != world)
            return 5;
          // From any function: no handle passed.
          auto c = dcomm::default_group<dcomm::cpu_backend>();
          std::vector<int> one{1};
          c.all_reduce(one, dcomm::sum, dcomm::blocking);
          if (one[0] != world) return 6;
          // A group of its own replaces it: ranks 0 and 2.
          auto pair = c.new_group({0, 2});
          if (pair) {
            dcomm::set_default_group(*pair);
            if (dcomm::get_world_size() != 2 || dcomm::get_rank() != rank / 2) return 7;
            dcomm::default_group<dcomm::cpu_backend>().barrier(dcomm::blocking);
            dcomm::set_default_group(c);
          }
          if (dcomm::get_world_size() != world) return 8;
          c.barrier(dcomm::blocking);
          dcomm::destroy_process_group();
          if (dcomm::is_initialized()) return 9;
          dcomm::destroy_process_group();  // none: nothing to do
          try {
            (void)dcomm::default_group<dcomm::cpu_backend>();
            return 10;
          } catch (const dcomm::error& e) {
            if (e.code() != dcomm::errc::invalid_argument) return 11;
          }
          c.barrier(dcomm::blocking);  // the program's own handle still works
          return 0;
        },
        {.timeout = 60s});
  }

  TEST_CASE("read and replaced from several threads at once") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(1, [](comm& c, int) -> asio::awaitable<void> {
      std::atomic<bool> stop{false};
      std::atomic<int> wrong{0};
      std::vector<std::thread> readers;
      for (int t = 0; t < 3; ++t)
        readers.emplace_back([&] {
          while (!stop)
            if (dcomm::is_initialized()) {
              try {
                if (dcomm::default_group<dcomm::cpu_backend>().size() != 1) ++wrong;
                if (dcomm::get_world_size() != 1) ++wrong;
              } catch (const dcomm::error&) {  // destroyed between the two: allowed
              }
            }
        });
      for (int i = 0; i < 2000; ++i) {
        dcomm::set_default_group(c);
        if (i % 3 == 0) dcomm::destroy_process_group();
      }
      stop = true;
      for (auto& t : readers) t.join();
      dcomm::destroy_process_group();
      require(wrong == 0, std::to_string(wrong.load()) + " wrong answers");
      co_return;
    });
  }
}

TEST_SUITE("cpu composed calls") {
  TEST_CASE("sendrecv and sendrecv_replace shift a ring, worlds 1-6") {
    DCOMM_TEST_DEADLINE(120s);
    for (int world = 1; world <= 6; ++world) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int r) -> asio::awaitable<void> {
        const int n = c.size(), next = (r + 1) % n, prev = (r + n - 1) % n;
        // Counts that differ per step, a large one past the eager limit, and 0.
        for (std::size_t count :
             {std::size_t{0}, std::size_t{1}, std::size_t{1001}, std::size_t{300'007}}) {
          std::vector<float> out(count, static_cast<float>(r)), in(count, -1.0f);
          co_await c.sendrecv(out, next, in, prev);
          require(in == std::vector<float>(count, static_cast<float>(prev)),
                  "sendrecv of " + std::to_string(count));
          std::vector<std::int64_t> buf(count, r);
          co_await c.sendrecv_replace(buf, next, prev, 7, {});
          require(buf == std::vector<std::int64_t>(count, prev),
                  "sendrecv_replace of " + std::to_string(count));
        }
      });
    }
  }

  TEST_CASE("sendrecv: sizes must match, and this rank is both ends or neither") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      const int other = 1 - r;
      std::vector<int> out(r == 0 ? 3 : 4, r), in(3);
      auto [code, what] = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await c.sendrecv(out, other, in, other); });
      // Rank 1 sends 4 to rank 0, which expects 3: the receiver fails (the
      // sender need not learn of it: communicator.md, point to point).
      if (r == 0) require(code == dcomm::errc::mismatch, "expected a mismatch: '" + what + "'");
      std::vector<int> self(2);
      std::tie(code, what) = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await c.sendrecv(out, r, self, other); });
      require(code == dcomm::errc::invalid_argument && contains(what, "both or neither"), what);
      std::tie(code, what) = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await c.sendrecv(out, r, self, r); });
      require(code == dcomm::errc::mismatch, "a copy to itself of another size: '" + what + "'");
      std::vector<int> two{r, r}, back(2);
      co_await c.sendrecv(two, r, back, r);
      require(back == two, "a copy to itself");
      // sendrecv_replace copies what it sends in host memory: a device
      // buffer is refused before anything is sent.
      dcomm::tensor_view on_gpu{two.data(), 2, dcomm::dtype::int32, dcomm::device::cuda(0)};
      std::tie(code, what) = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await c.sendrecv_replace(on_gpu, other, other); });
      require(code == dcomm::errc::invalid_argument && contains(what, "host"), what);
    });
  }

  TEST_CASE("batch_isend_irecv with wait_all, wait_any, test_* and their async forms") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world : {2, 3, 5}) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int r) -> asio::awaitable<void> {
        const int n = c.size();
        // Everyone sends to everyone else (rank order), in one batch.
        std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(n)),
            in(static_cast<std::size_t>(n));
        std::vector<dcomm::p2p_op> ops;
        for (int p = 0; p < n; ++p) {
          if (p == r) continue;
          out[static_cast<std::size_t>(p)].assign(static_cast<std::size_t>(p + 1), 100 * r + p);
          in[static_cast<std::size_t>(p)].resize(static_cast<std::size_t>(r + 1));
          ops.push_back(dcomm::irecv_op(in[static_cast<std::size_t>(p)], p, 3));
          ops.push_back(dcomm::isend_op(out[static_cast<std::size_t>(p)], p, 3));
        }
        auto reqs = c.batch_isend_irecv(ops);
        require(reqs.size() == ops.size(), "one request per operation");
        const std::size_t first = co_await dcomm::async_wait_any(reqs);
        require(first < reqs.size() && reqs[first].test(), "async_wait_any's index is done");
        co_await dcomm::async_wait_all(reqs);
        require(dcomm::test_all(reqs) && dcomm::test_any(reqs) == 0u &&
                    dcomm::test_some(reqs).size() == reqs.size(),
                "test_all, test_any and test_some once all are done");
        for (int p = 0; p < n; ++p)
          if (p != r)
            require(in[static_cast<std::size_t>(p)] ==
                        std::vector<std::int32_t>(static_cast<std::size_t>(r + 1), 100 * p + r),
                    "from rank " + std::to_string(p));
        // A bad operation: none starts (the next batch still matches).
        std::vector<std::int32_t> x(1, r);
        std::vector<dcomm::p2p_op> bad{dcomm::isend_op(x, (r + 1) % n), dcomm::isend_op(x, n)};
        auto [code, what] = co_await failure_of([&]() -> asio::awaitable<void> {
          (void)c.batch_isend_irecv(bad);
          co_return;
        });
        require(code == dcomm::errc::invalid_argument && contains(what, "out of range"), what);
        std::vector<std::int32_t> got(1, -1);
        std::vector<dcomm::p2p_op> ring{dcomm::isend_op(x, (r + 1) % n),
                                        dcomm::irecv_op(got, (r + n - 1) % n)};
        auto again = c.batch_isend_irecv(ring);
        co_await dcomm::async_wait_all(again);
        require(got[0] == (r + n - 1) % n, "the batch after a refused one");
      });
    }
  }

  TEST_CASE("wait_any and wait_all block off the communicator's thread; failures come last") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::spawn(2,
                 [](int rank, int) {
                   auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 30s});
                   const int other = 1 - rank;
                   std::vector<float> a(1000), b(1000, static_cast<float>(rank));
                   std::vector<dcomm::request> reqs;
                   reqs.push_back(c.irecv(a, other, 1));
                   if (rank == 1) std::this_thread::sleep_for(50ms);  // rank 0 waits for it
                   reqs.push_back(c.isend(b, other, 1));
                   const std::size_t i = dcomm::wait_any(reqs);
                   if (!reqs[i].test()) return 2;
                   dcomm::wait_all(reqs);
                   if (a != std::vector<float>(1000, static_cast<float>(other))) return 3;
                   // A receive that fails (size mismatch) after ones that succeed:
                   // wait_all waits for all, then rethrows it. Last between the two
                   // ranks: a refused send's report may reach the sender's next
                   // send to that peer (communicator.md, point to point).
                   std::vector<float> small(rank == 0 ? 10 : 20), ok(5), five(5, 1.0f);
                   std::vector<dcomm::request> mixed{c.irecv(ok, other, 4), c.isend(five, other, 4),
                                                     c.irecv(small, other, 2),
                                                     c.isend(small, other, 2)};
                   try {
                     dcomm::async_wait_all(mixed, dcomm::blocking);
                     return 4;
                   } catch (const dcomm::error& e) {
                     if (e.code() != dcomm::errc::mismatch) return 5;
                   }
                   if (!dcomm::test_all(mixed) || ok != five) return 6;
                   auto any = dcomm::async_wait_any(mixed, asio::use_future).get();
                   if (any != 0) return 7;
                   return 0;
                 },
                 {.timeout = 60s});
  }

  TEST_CASE("all_reduce_coalesced: several buffers in one call, worlds 1-6") {
    DCOMM_TEST_DEADLINE(120s);
    for (int world = 1; world <= 6; ++world) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [](comm& c, int r) -> asio::awaitable<void> {
        const int n = c.size();
        std::vector<double> a(3, r + 1.0), empty, b(70'001, 2.0 * r);
        std::vector<dcomm::tensor_view> bufs{dcomm::mutable_view(a), dcomm::mutable_view(empty),
                                             dcomm::mutable_view(b)};
        co_await c.all_reduce_coalesced(bufs, dcomm::sum);
        require(a == std::vector<double>(3, n * (n + 1) / 2.0), "the first buffer");
        require(b == std::vector<double>(70'001, n * (n - 1) * 1.0), "the third buffer");
        co_await c.all_reduce_coalesced(bufs, dcomm::max, {}, dcomm::as_request).async_wait();
        require(a == std::vector<double>(3, n * (n + 1) / 2.0), "max of equal values");
        std::vector<float> f(2);
        std::vector<dcomm::tensor_view> mixed{dcomm::mutable_view(a), dcomm::mutable_view(f)};
        auto [code, what] = co_await failure_of(
            [&]() -> asio::awaitable<void> { co_await c.all_reduce_coalesced(mixed, dcomm::sum); });
        require(code == dcomm::errc::invalid_argument && contains(what, "one dtype"), what);
        std::vector<std::int32_t> v(1, 1);
        co_await c.all_reduce(v, dcomm::sum);  // the refusal took no number
        require(v[0] == n, "the call after a refused one");
      });
    }
  }

  TEST_CASE("monitored_barrier names the ranks that did not come") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      if (r == 2) {  // comes after the others' deadline; its own barrier then fails
        asio::steady_timer late(co_await asio::this_coro::executor, 1s);
        co_await late.async_wait(asio::use_awaitable);
        (void)co_await failure_of(
            [&]() -> asio::awaitable<void> { co_await c.monitored_barrier(2s); });
        co_return;
      }
      auto [code, what] = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await c.monitored_barrier(300ms); });
      require(code == dcomm::errc::timeout, "expected a timeout: '" + what + "'");
      require(contains(what, "peers rank 2"), what);
    });
  }
}

TEST_SUITE("cpu composed calls") {
  // asio::system_executor's pool is started in this process first; a
  // forked rank inherits its state but none of its threads, so a request
  // already done must not complete a future through it.
  TEST_CASE("a finished request's async_wait completes a future in a forked rank") {
#if defined(__SANITIZE_THREAD__)
    MESSAGE("skipped: ThreadSanitizer cannot start threads after a multi-threaded fork");
    return;
#endif
    DCOMM_TEST_DEADLINE(60s);
    std::promise<void> ran;
    asio::post(asio::system_executor(), [&] { ran.set_value(); });
    ran.get_future().get();
    dcomm::spawn(2,
                 [](int rank, int) {
                   auto c = dcomm::init_process_group<dcomm::cpu_backend>({.timeout = 10s});
                   std::vector<int> v(1, rank);
                   auto r = rank == 0 ? c.isend(v, 1) : c.irecv(v, 0);
                   r.wait();
                   r.async_wait(asio::use_future).get();  // done already
                   std::vector<dcomm::request> rs{r};
                   dcomm::async_wait_all(rs, asio::use_future).get();
                   return dcomm::async_wait_any(rs, asio::use_future).get() == 0 && v[0] == 0 ? 0
                                                                                              : 2;
                 },
                 {.timeout = 30s});
  }
}
