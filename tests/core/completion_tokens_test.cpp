// Every completion token docs/core.md lists (the default, asio::use_awaitable,
// a callback, asio::use_future, dcomm::blocking, dcomm::as_request), on every
// family of communicator operation: point to point, a plain collective,
// rooted collectives, the _v collectives that complete with counts, the
// object collectives, barrier and split; results and errors both. Then a
// backend written from backend.hpp's public names alone, and the public
// thread world (dcomm/thread_world.hpp) these tests run on.
// Size: many small independent cases in one translation unit on purpose: each
// Asio-heavy test file costs about a minute per CI build (three builds), so
// a component's cases share one file rather than split by line count.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/detail/io_thread.hpp"
#include "dcomm/thread_world.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"
#include "support/store_world.hpp"

using namespace std::chrono_literals;
using dcomm::test::check_failed;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

// How a test waits for an operation: each of docs/core.md's tokens.
enum class way { default_token, use_awaitable, callback, use_future, blocking, as_request };

const char* name(way w) {
  switch (w) {
    case way::default_token:
      return "default token";
    case way::use_awaitable:
      return "asio::use_awaitable";
    case way::callback:
      return "callback";
    case way::use_future:
      return "asio::use_future";
    case way::blocking:
      return "dcomm::blocking";
    case way::as_request:
      return "dcomm::as_request";
  }
  return "?";
}

// Waits for a future without blocking the thread that runs this coroutine's
// executor (the rank's: the operation needs it to run).
template <class T>
asio::awaitable<T> await_future(std::future<T> f) {
  auto ex = co_await asio::this_coro::executor;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (f.wait_for(0s) != std::future_status::ready) {
    if (std::chrono::steady_clock::now() > until) throw check_failed("a future never became ready");
    asio::steady_timer pause(ex, 1ms);
    co_await pause.async_wait(asio::use_awaitable);
  }
  co_return f.get();
}

// Runs f (a blocking call) on a thread of its own while this coroutine's
// executor keeps running, and completes with its result.
template <class F>
asio::awaitable<std::invoke_result_t<F&>> off_thread(F f) {
  using R = std::invoke_result_t<F&>;
  std::packaged_task<R()> job(std::move(f));
  auto result = job.get_future();
  std::thread runner(std::move(job));
  struct joiner {
    std::thread& t;
    ~joiner() { t.join(); }
  } join{runner};
  co_return co_await await_future(std::move(result));
}

// Starts op with the token `w` stands for (op() is the call without one)
// and completes with its result. A callback must run on the thread that
// runs the communicator (its executor: the default associated executor).
// takes_request: whether op accepts dcomm::as_request (the communicator's
// operations without a result do).
template <class R, bool takes_request = std::is_void_v<R>, class Op>
asio::awaitable<R> finish(way w, Op op, bool callback_here = true) {
  if (w == way::default_token) co_return co_await op();
  if (w == way::use_awaitable) co_return co_await op(asio::use_awaitable);
  if (w == way::use_future) {
    std::future<R> f = op(asio::use_future);
    co_return co_await await_future(std::move(f));
  }
  if (w == way::blocking)
    co_return co_await off_thread([op]() mutable { return op(dcomm::blocking); });
  if (w == way::callback) {
    auto promise = std::make_shared<std::promise<R>>();
    auto f = promise->get_future();
    op([promise, callback_here, me = std::this_thread::get_id()](std::exception_ptr e,
                                                                 auto... value) {
      if (callback_here && std::this_thread::get_id() != me)
        promise->set_exception(std::make_exception_ptr(
            check_failed("the callback ran on another thread than the communicator's")));
      else if (e)
        promise->set_exception(e);
      else
        promise->set_value(std::move(value)...);
    });
    co_return co_await await_future(std::move(f));
  }
  // dcomm::as_request: for the operations without a result (a static_assert
  // refuses it on the others, which are awaited instead).
  if constexpr (takes_request) {
    dcomm::request req = op(dcomm::as_request);
    require(req.valid(), "as_request returned an empty request");
    co_await req.async_wait();
    require(req.test(), "the request is not done after async_wait");
  } else {
    co_return co_await op();
  }
}

// Every operation family once, with token `w`, on a world of 3, against
// computed expectations. Over 80 lines on purpose: one list, read top to
// bottom, is the order every rank makes its calls in.
asio::awaitable<void> every_family(comm& c, way w) {
  const int r = c.rank(), n = c.size();
  const std::string how = std::string(" (") + name(w) + ")";

  // Point to point: 0 sends to 1, 1 sends it back doubled.
  if (r == 0) {
    std::vector<std::int32_t> out{1, 2, 3}, back(3);
    co_await finish<void>(w, [&](auto... t) { return c.send(out, 1, 7, t...); });
    co_await finish<void>(w, [&](auto... t) { return c.recv(back, 1, 8, t...); });
    require(back == std::vector<std::int32_t>{2, 4, 6}, "send/recv round trip" + how);
  } else if (r == 1) {
    std::vector<std::int32_t> in(3);
    co_await finish<void>(w, [&](auto... t) { return c.recv(in, 0, 7, t...); });
    for (auto& x : in) x *= 2;
    co_await finish<void>(w, [&](auto... t) { return c.send(in, 0, 8, t...); });
  }

  // A plain collective.
  std::vector<std::int64_t> sum{r + 1, 10 * (r + 1)};
  co_await finish<void>(w, [&](auto... t) { return c.all_reduce(sum, dcomm::sum, t...); });
  const std::int64_t total = n * (n + 1) / 2;
  require(sum == std::vector<std::int64_t>{total, 10 * total}, "all_reduce" + how);

  // Rooted collectives: broadcast from 1, reduce to 2.
  std::vector<float> b(3, r == 1 ? 0.0f : -1.0f);
  if (r == 1) b = {7.0f, 8.0f, 9.0f};
  co_await finish<void>(w, [&](auto... t) { return c.broadcast(b, 1, t...); });
  require(b == std::vector<float>{7.0f, 8.0f, 9.0f}, "broadcast" + how);
  std::vector<std::int32_t> red{r};
  co_await finish<void>(w, [&](auto... t) { return c.reduce(red, 2, dcomm::sum, t...); });
  if (r == 2) require(red[0] == n * (n - 1) / 2, "reduce at the root" + how);

  // The _v collectives: rank i gives i + 1 elements of value i.
  std::vector<std::int32_t> mine(static_cast<std::size_t>(r + 1), r), all;
  using counts_t = std::vector<std::size_t>;
  auto counts =
      co_await finish<counts_t>(w, [&](auto... t) { return c.all_gather_v(mine, all, t...); });
  std::vector<std::int32_t> expect_all;
  counts_t expect_counts;
  for (int i = 0; i < n; ++i) {
    expect_counts.push_back(static_cast<std::size_t>(i + 1));
    expect_all.insert(expect_all.end(), static_cast<std::size_t>(i + 1), i);
  }
  require(counts == expect_counts && all == expect_all, "all_gather_v" + how);
  // all_to_all_v: j + 1 elements of 10 r + j go to rank j.
  counts_t send_counts;
  std::vector<std::int32_t> send, got;
  for (int j = 0; j < n; ++j) {
    send_counts.push_back(static_cast<std::size_t>(j + 1));
    send.insert(send.end(), static_cast<std::size_t>(j + 1), 10 * r + j);
  }
  auto got_counts = co_await finish<counts_t>(
      w, [&](auto... t) { return c.all_to_all_v(send, send_counts, got, t...); });
  std::vector<std::int32_t> expect_got;
  for (int i = 0; i < n; ++i)
    expect_got.insert(expect_got.end(), static_cast<std::size_t>(r + 1), 10 * i + r);
  require(got_counts == counts_t(static_cast<std::size_t>(n), static_cast<std::size_t>(r + 1)) &&
              got == expect_got,
          "all_to_all_v" + how);

  // The object collectives.
  std::string greeting = r == 0 ? "hello from rank 0" : "";
  co_await finish<void>(w, [&](auto... t) { return c.broadcast_object(greeting, 0, t...); });
  require(greeting == "hello from rank 0", "broadcast_object" + how);
  const std::int32_t id = 100 + r;
  auto ids = co_await finish<std::vector<std::int32_t>>(
      w, [&](auto... t) { return c.all_gather_object(id, t...); });
  require(ids == std::vector<std::int32_t>{100, 101, 102}, "all_gather_object" + how);

  co_await finish<void>(w, [&](auto... t) { return c.barrier(t...); });

  // split (new_group takes no token: it sends nothing). Color r % 2, key
  // -r: the even ranks {0, 2}, rank 2 first.
  auto group =
      co_await finish<std::optional<comm>>(w, [&](auto... t) { return c.split(r % 2, -r, t...); });
  require(group.has_value(), "split gave no group" + how);
  const int expected_size = r % 2 == 0 ? 2 : 1;
  const int expected_rank = r == 2 ? 0 : (r == 0 ? 1 : 0);
  require(group->size() == expected_size && group->rank() == expected_rank,
          "split: size " + std::to_string(group->size()) + ", rank " +
              std::to_string(group->rank()) + how);
  std::vector<std::int32_t> in_group{r};
  co_await group->all_reduce(in_group, dcomm::sum);
  require(in_group[0] == (r % 2 == 0 ? 0 + 2 : 1), "all_reduce in the split group" + how);
}

// A refused call (a bad root, bad counts) fails through the token too, with
// errc::invalid_argument, and takes no sequence number: a good call after
// it still matches the other ranks'.
asio::awaitable<void> errors_through(comm& c, way w) {
  const std::string how = std::string(" (") + name(w) + ")";
  std::vector<float> b(2);
  auto [code, what] = co_await failure_of([&]() -> asio::awaitable<void> {
    co_await finish<void>(w, [&](auto... t) { return c.broadcast(b, 99, t...); });
  });
  require(code == dcomm::errc::invalid_argument && contains(what, "root 99"),
          "a bad root: " + what + how);
  std::vector<std::int32_t> in(2), out;
  std::vector<std::size_t> wrong(static_cast<std::size_t>(c.size()), 5);
  auto [code_v, what_v] = co_await failure_of([&]() -> asio::awaitable<void> {
    co_await finish<std::vector<std::size_t>>(
        w, [&](auto... t) { return c.all_to_all_v(in, wrong, out, t...); });
  });
  require(code_v == dcomm::errc::invalid_argument && contains(what_v, "send_counts"),
          "bad send_counts: " + what_v + how);
  std::vector<std::int32_t> one{1};
  co_await finish<void>(w, [&](auto... t) { return c.all_reduce(one, dcomm::sum, t...); });
  require(one[0] == c.size(), "all_reduce after refused calls" + how);
}

// A world of 3 over tcp; every rank runs body(comm, w).
void run_world(way w, asio::awaitable<void> (*body)(comm&, way)) {
  dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 90s};
  try {
    dcomm::run_thread_world<dcomm::cpu_backend>(
        3, [&](comm& c) { return body(c, w); }, o);
  } catch (const std::exception& e) {
    FAIL(e.what());
  }
}

// A world of 2 whose ranks are threads of this process, each with the
// communicator of the blocking init_process_group (the backend on an io
// thread of its own), meeting through a file store; each rank runs
// rank(c, r) on its thread. Returns each rank's error ("" if none).
template <class Rank>
std::vector<std::string> own_thread_ranks(Rank rank) {
  dcomm::test::temp_dir dir;
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        dcomm::init_options<dcomm::cpu_backend> o{.init_method = "file://" + dir.path + "/store",
                                                  .rank = r,
                                                  .world_size = 2,
                                                  .timeout = 10s,
                                                  .job_token = ""};
        o.backend.bind_host = "127.0.0.1";
        auto c = dcomm::init_process_group<dcomm::cpu_backend>(o);
        rank(c, r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  return errors;
}

// Each rank runs `calls` times dcomm::sync_wait(body(c, rank, i)), each on
// a fresh io_context, as plain code does.
template <class Body>
std::vector<std::string> own_thread_world(int calls, Body body) {
  return own_thread_ranks([&](comm& c, int r) {
    for (int i = 0; i < calls; ++i) dcomm::sync_wait(body(c, r, i));
  });
}

}  // namespace

TEST_SUITE("completion tokens") {
  TEST_CASE("every token on every operation family, results and errors") {
    for (way w : {way::default_token, way::use_awaitable, way::callback, way::use_future,
                  way::blocking, way::as_request}) {
      DCOMM_TEST_DEADLINE(100s);
      INFO(name(w));
      run_world(w, &every_family);
      run_world(w, &errors_through);
    }
  }

  // The call docs/core.md's table promises, as a user writes it, and its
  // _v form: the compile failure of issue 15.
  TEST_CASE("asio::use_future, written as in the docs, from a plain thread") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        2,
        [](comm& comm) -> asio::awaitable<void> {
          // The futures are waited for on a thread that does not run the
          // communicator; this coroutine awaits that thread.
          std::vector<float> b{1.0f, 2.0f};
          std::vector<float> out;
          co_await off_thread([&] {
            std::future<void> f = comm.all_reduce(b, dcomm::sum, asio::use_future);
            f.get();
            std::future<std::vector<std::size_t>> g = comm.all_gather_v(b, out, asio::use_future);
            auto counts = g.get();
            require(counts == std::vector<std::size_t>{2, 2}, "all_gather_v's counts");
          });
          require(b == std::vector<float>{2.0f, 4.0f}, "all_reduce through a future");
          require(out == std::vector<float>{2.0f, 4.0f, 2.0f, 4.0f}, "all_gather_v's output");
        },
        o);
  }

  // An operation called from the backend's own io_context starts inside
  // the call (detail::start_now), but its handler never runs there, even
  // where the operation has nothing to wait for (Asio's rule: a handler is
  // not invoked from inside its initiating function).
  TEST_CASE("a callback never runs inside the call, though the operation starts there") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world : {1, 2}) {
      dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
      dcomm::run_thread_world<dcomm::cpu_backend>(
          world,
          [](comm& c) -> asio::awaitable<void> {
            for (int i = 0; i < 200; ++i) {
              bool ran = false, refused = false;
              std::exception_ptr failure;
              c.barrier([&](std::exception_ptr e) { ran = true, failure = e; });
              require(!ran, "a barrier's callback ran inside the call");
              std::vector<float> v{1.0f};
              // Refused before any byte (a root out of range): completes at
              // once, still not inside the call.
              c.broadcast(v, 7, [&](std::exception_ptr e) { refused = e != nullptr; });
              require(!refused, "a refusal's callback ran inside the call");
              // Both come, in order, once this coroutine yields.
              while (!ran || !refused) {
                asio::steady_timer t(co_await asio::this_coro::executor,
                                     std::chrono::microseconds(1));
                co_await t.async_wait(asio::use_awaitable);
              }
              require(failure == nullptr, "the barrier failed");
            }
          },
          o);
    }
  }

  // A co_awaited call that ends inside its start (world 1: nothing to wait
  // for) resumes its coroutine at once, not through the scheduler
  // (detail/await_task.hpp): a handler posted before the first call runs
  // only after several calls, with its result, its value or its refusal.
  // Yet the io_context is never starved: it runs within inline_turns calls.
  TEST_CASE("co_await resumes at once when the call ends inside its start, yet lets others run") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 20s, .deadline = 50s};
    dcomm::run_thread_world<dcomm::cpu_backend>(
        1,
        [](comm& c) -> asio::awaitable<void> {
          for (int kind = 0; kind < 4; ++kind) {
            bool other_ran = false;
            asio::post(co_await asio::this_coro::executor, [&] { other_ran = true; });
            int calls = 0;
            while (!other_ran) {
              require(calls < 1000, "a handler posted before the calls never ran");
              std::vector<float> v{2.0f, 3.0f};
              if (kind == 0) {
                co_await c.barrier();
              } else if (kind == 1) {
                co_await c.all_reduce(v, dcomm::sum);
                require(v == std::vector<float>{2.0f, 3.0f}, "all_reduce's result");
              } else if (kind == 2) {
                auto all = co_await c.all_gather_object(std::string("x"));
                require(all == std::vector<std::string>{"x"}, "all_gather_object's value");
              } else {
                auto [code, what] = co_await failure_of([&] { return c.broadcast(v, 7); });
                require(code == dcomm::errc::invalid_argument && contains(what, "root"),
                        "a refused broadcast's error");
              }
              ++calls;
            }
            INFO("kind " << kind << ": " << calls << " calls before the posted handler ran");
            CHECK(calls > 1);
            CHECK(calls <= dcomm::detail::await_task_detail::inline_turns);
          }
        },
        o);
  }

  TEST_CASE("a request's async_wait takes every token; as_request failures reach wait()") {
    DCOMM_TEST_DEADLINE(60s);
    run_world(way::default_token, [](comm& c, way) -> asio::awaitable<void> {
      for (way w : {way::default_token, way::use_awaitable, way::callback, way::use_future,
                    way::blocking}) {
        std::vector<std::int32_t> x{c.rank()};
        auto req = c.all_reduce(x, dcomm::sum, dcomm::as_request);
        co_await finish<void, false>(w, [&](auto... t) { return req.async_wait(t...); });
        require(x[0] == 0 + 1 + 2, std::string("all_reduce waited with ") + name(w));
        // Once done, waiting again completes at once, the same way. (A done
        // request has let go of the communicator's executor, so a plain
        // callback runs through Asio's system executor, on another thread.)
        co_await finish<void, false>(
            w, [&](auto... t) { return req.async_wait(t...); }, false);
      }
      std::vector<float> b(1);
      auto bad = c.broadcast(b, -1, dcomm::as_request);
      auto [code, what] = co_await failure_of(
          [&]() -> asio::awaitable<void> { co_await off_thread([&] { bad.wait(); }); });
      require(code == dcomm::errc::invalid_argument, "as_request of a bad root: " + what);
    });
  }

  // Plain code's coroutines on a communicator with an io thread of its own:
  // each call ends on that thread and hands the coroutine back to the
  // sync_wait's io_context, which sync_wait destroys once the coroutine is
  // done. The end must not touch that context after the handover (issue
  // 41: a count of work dropped late reached the next sync_wait's context,
  // stopping it: "ran out of work", or a crash). Many rounds, since it is
  // a race.
  TEST_CASE("sync_wait around calls of a communicator on its own io thread") {
    DCOMM_TEST_DEADLINE(90s);
    auto awaited = own_thread_world(1000, [](comm& c, int r, int i) -> asio::awaitable<void> {
      std::vector<std::int32_t> x{r + 1, i};
      co_await c.all_reduce(x, dcomm::sum);
      require(x == std::vector<std::int32_t>{3, 2 * i}, "all_reduce's sum");
    });
    INFO("co_await: rank 0: " << awaited[0] << "; rank 1: " << awaited[1]);
    CHECK((awaited[0].empty() && awaited[1].empty()));
    // The same through a request (dcomm::as_request, then async_wait): its
    // waiter runs on the io thread and completes the coroutine from there.
    auto requested = own_thread_world(1000, [](comm& c, int r, int i) -> asio::awaitable<void> {
      std::vector<std::int32_t> x{r + 1, i};
      auto req = c.all_reduce(x, dcomm::sum, dcomm::as_request);
      co_await req.async_wait();
      require(x == std::vector<std::int32_t>{3, 2 * i}, "all_reduce's sum (as_request)");
    });
    INFO("as_request: rank 0: " << requested[0] << "; rank 1: " << requested[1]);
    CHECK((requested[0].empty() && requested[1].empty()));
    // Blocking calls from inside the coroutine (this thread runs the
    // communicator's context, detail::io_drive, from within a handler of
    // sync_wait's), between co_awaited ones, which hand it back to the io
    // thread: the context goes back and forth every call.
    auto mixed = own_thread_world(300, [](comm& c, int r, int i) -> asio::awaitable<void> {
      std::vector<std::int32_t> x{r + 1, i};
      c.all_reduce(x, dcomm::sum, dcomm::blocking);
      require(x == std::vector<std::int32_t>{3, 2 * i}, "blocking all_reduce's sum");
      co_await c.all_reduce(x, dcomm::sum);
      require(x == std::vector<std::int32_t>{6, 4 * i}, "co_awaited all_reduce's sum");
    });
    INFO("mixed: rank 0: " << mixed[0] << "; rank 1: " << mixed[1]);
    CHECK((mixed[0].empty() && mixed[1].empty()));
  }

  // Blocking calls from two threads of each rank at once: one thread runs
  // the context (detail::io_drive) and with it the other's operation, or
  // they take turns. Each rank's receiver waits for the other rank's
  // sender, which starts after a pause, while its own sender's message is
  // what the other rank's receiver waits for.
  TEST_CASE("dcomm::blocking from two threads of a rank at once") {
    DCOMM_TEST_DEADLINE(90s);
    constexpr int messages = 200;
    auto errors = own_thread_ranks([](comm& c, int r) {
      const int peer = 1 - r;
      std::string sender_failure;
      std::thread sender([&] {
        try {
          for (int k = 0; k < messages; ++k) {
            std::this_thread::sleep_for(std::chrono::microseconds(k % 7 * 30));
            std::vector<std::int32_t> out{1000 * r + k};
            c.send(out, peer, 1, dcomm::blocking);
          }
        } catch (const std::exception& e) {
          sender_failure = e.what();
        }
      });
      std::string receiver_failure;
      try {
        for (int k = 0; k < messages; ++k) {
          std::vector<std::int32_t> in{-1};
          c.recv(in, peer, 1, dcomm::blocking);
          require(in[0] == 1000 * peer + k,
                  "message " + std::to_string(k) + " came as " + std::to_string(in[0]));
        }
      } catch (const std::exception& e) {
        receiver_failure = e.what();
      }
      sender.join();
      require(sender_failure.empty(), "sender: " + sender_failure);
      require(receiver_failure.empty(), "receiver: " + receiver_failure);
      c.barrier(dcomm::blocking);
    });
    INFO("rank 0: " << errors[0] << "; rank 1: " << errors[1]);
    CHECK((errors[0].empty() && errors[1].empty()));
  }
}

// ------------------------------------------------------------------------
// A backend written from backend.hpp's public names alone (dcomm::task,
// dcomm::use_task, op_context, reducer, output_allocator): a world of one
// rank, where every collective is a copy. Its communicator takes every
// token too.

namespace outside {

class self_backend {
 public:
  struct options {};
  static constexpr std::string_view name = "self";
  static constexpr bool supports_custom_reduce = true;
  static constexpr bool supports_bitwise_reduce = true;
  static constexpr bool supports_streams = false;
  static void check_algorithm(dcomm::operation op, dcomm::algorithm a) {
    if (a != dcomm::algorithm::automatic)
      dcomm::throw_error(dcomm::errc::invalid_argument,
                         {.operation = dcomm::name(op), .detail = "one algorithm only"});
  }

  explicit self_backend(asio::any_io_executor ex) : ex_(std::move(ex)) {}

  asio::any_io_executor get_executor() const { return ex_; }
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void abort() {}
  void close(std::function<void()> closed) {
    if (closed) asio::post(ex_, std::move(closed));
  }
  void check_tensor(const dcomm::const_tensor_view& v, const char* operation) const {
    if (v.device.type != dcomm::device::kind::cpu)
      dcomm::throw_error(dcomm::errc::invalid_argument,
                         {.operation = operation, .detail = "host memory only"});
  }
  void group_created(const std::shared_ptr<dcomm::group_state>&,
                     const std::shared_ptr<dcomm::group_state>&, int, int) {}

  // The front end refuses a peer that is this rank: a world of one has none.
  dcomm::task<void> send(const dcomm::op_context&, dcomm::const_tensor_view, int) { co_return; }
  dcomm::task<void> recv(const dcomm::op_context&, dcomm::tensor_view, int) { co_return; }
  // A real wait on an Asio timer inside a task, bounded by the deadline.
  dcomm::task<void> barrier(dcomm::op_context c) {
    asio::steady_timer t(ex_, std::min(c.deadline, dcomm::op_context::clock::now() + 1ms));
    auto [ec] = co_await t.async_wait(dcomm::use_task);
    if (ec) dcomm::throw_error(dcomm::errc::aborted, {.operation = "barrier"});
  }
  dcomm::task<void> broadcast(const dcomm::op_context&, dcomm::tensor_view, int) { co_return; }
  dcomm::task<void> reduce(const dcomm::op_context&, dcomm::const_tensor_view in,
                           dcomm::tensor_view out, dcomm::reducer r, int) {
    co_await copy_reduced(in, out, r);
  }
  dcomm::task<void> all_reduce(const dcomm::op_context&, dcomm::const_tensor_view in,
                               dcomm::tensor_view out, dcomm::reducer r) {
    ran_on = std::this_thread::get_id();
    bool now = false;
    asio::dispatch(ex_, [&now] { now = true; });
    dispatched_at_once = now;
    co_await copy_reduced(in, out, r);
  }
  // The last all_reduce's thread, and whether a dispatch to the executor
  // ran at once there (it does inside a handler of the executor).
  std::thread::id ran_on;
  bool dispatched_at_once = false;
  dcomm::task<void> scatter(const dcomm::op_context&, dcomm::const_tensor_view in,
                            dcomm::tensor_view out, int) {
    copy(in, out);
    co_return;
  }
  dcomm::task<void> gather(const dcomm::op_context&, dcomm::const_tensor_view in,
                           dcomm::tensor_view out, int) {
    copy(in, out);
    co_return;
  }
  dcomm::task<void> all_gather(const dcomm::op_context&, dcomm::const_tensor_view in,
                               dcomm::tensor_view out) {
    copy(in, out);
    co_return;
  }
  dcomm::task<void> reduce_scatter(const dcomm::op_context&, dcomm::const_tensor_view in,
                                   dcomm::tensor_view out, dcomm::reducer r) {
    co_await copy_reduced(in, out, r);
  }
  dcomm::task<void> all_to_all(const dcomm::op_context&, dcomm::const_tensor_view in,
                               dcomm::tensor_view out) {
    copy(in, out);
    co_return;
  }
  dcomm::task<std::vector<std::size_t>> all_gather_v(const dcomm::op_context&,
                                                     dcomm::const_tensor_view in,
                                                     dcomm::output_allocator alloc) {
    std::vector<std::size_t> counts{in.count};
    copy(in, alloc(counts));
    co_return counts;
  }
  dcomm::task<std::vector<std::size_t>> all_to_all_v(const dcomm::op_context&,
                                                     dcomm::const_tensor_view in,
                                                     std::vector<std::size_t> send_counts,
                                                     dcomm::output_allocator alloc) {
    copy(in, alloc(send_counts));
    co_return send_counts;
  }

 private:
  static void copy(dcomm::const_tensor_view in, dcomm::tensor_view out) {
    if (in.data != out.data && in.bytes()) std::memcpy(out.data, in.data, in.bytes());
  }
  // One rank's reduction: its own values, finished (avg divides by one,
  // premul_sum scales by its factor).
  static dcomm::task<void> copy_reduced(dcomm::const_tensor_view in, dcomm::tensor_view out,
                                        dcomm::reducer r) {
    copy(in, out);
    r.finish(out.data, out.count, 1);
    co_return;
  }

  asio::any_io_executor ex_;
};

static_assert(dcomm::backend<self_backend>);

}  // namespace outside

TEST_SUITE("completion tokens") {
  TEST_CASE("a backend written from backend.hpp alone serves every token") {
    DCOMM_TEST_DEADLINE(30s);
    using self_comm = dcomm::communicator<outside::self_backend>;
    asio::io_context io;
    auto guard = asio::make_work_guard(io);
    std::thread runner([&] { io.run(); });
    struct stopper {
      decltype(guard)& g;
      std::thread& t;
      ~stopper() {
        g.reset();
        t.join();
      }
    } stop{guard, runner};
    std::optional<self_comm> made;
    {
      auto rt = std::make_shared<self_comm::runtime>();
      rt->backend = std::make_shared<outside::self_backend>(asio::make_strand(io));
      made = self_comm::make_world(std::move(rt), 10s);
    }
    self_comm c = *made;

    // Blocking, from this thread (not the io_context's).
    std::vector<double> x{1.5, -2.0};
    c.all_reduce(x, dcomm::premul_sum(2.0), dcomm::blocking);
    CHECK(x == std::vector<double>{3.0, -4.0});
    c.barrier(dcomm::blocking);

    // asio::use_future.
    std::vector<double> out;
    auto counts_f = c.all_gather_v(x, out, asio::use_future);
    REQUIRE(counts_f.wait_for(10s) == std::future_status::ready);
    CHECK(counts_f.get() == std::vector<std::size_t>{2});
    CHECK(out == x);
    auto avg_f = c.all_reduce(x, dcomm::avg, asio::use_future);
    REQUIRE(avg_f.wait_for(10s) == std::future_status::ready);
    avg_f.get();
    CHECK(x == std::vector<double>{3.0, -4.0});

    // A callback, on the io_context's thread.
    std::promise<std::vector<std::int32_t>> objects;
    auto objects_f = objects.get_future();
    c.all_gather_object(std::int32_t{42}, [&](std::exception_ptr e, std::vector<std::int32_t> v) {
      if (std::this_thread::get_id() != runner.get_id())
        objects.set_exception(std::make_exception_ptr(std::runtime_error("wrong thread")));
      else if (e)
        objects.set_exception(e);
      else
        objects.set_value(std::move(v));
    });
    REQUIRE(objects_f.wait_for(10s) == std::future_status::ready);
    CHECK(objects_f.get() == std::vector<std::int32_t>{42});

    // as_request, and co_await in a coroutine (the default token).
    std::vector<std::int32_t> flags{6};
    auto req = c.all_reduce(flags, dcomm::band, dcomm::as_request);
    req.wait();
    CHECK(flags == std::vector<std::int32_t>{6});
    auto awaited = asio::co_spawn(
        io,
        [&]() -> asio::awaitable<std::size_t> {
          std::vector<std::int32_t> all;
          auto counts = co_await c.all_gather_v(flags, all);
          co_await c.barrier();
          co_return counts.at(0);
        },
        asio::use_future);
    REQUIRE(awaited.wait_for(10s) == std::future_status::ready);
    CHECK(awaited.get() == 1);

    // A refused call, through a future.
    auto refused = c.all_reduce(
        x, dcomm::sum, dcomm::op_options{.algorithm = dcomm::algorithm::ring}, asio::use_future);
    REQUIRE(refused.wait_for(10s) == std::future_status::ready);
    CHECK_THROWS_AS(refused.get(), dcomm::error);
    made.reset();
  }
}

TEST_SUITE("completion tokens") {
  // dcomm::blocking on an io thread's context (the blocking init_process_group's):
  // the calling thread runs the operation while the io thread is parked
  // (detail::io_drive), so a call takes no thread hand-over (issue 41: it
  // cost 5 to 8 times the co_await form); other tokens and request.wait()
  // hand the context back to the io thread at once.
  TEST_CASE("dcomm::blocking runs its operation on the calling thread, the io thread parked") {
    DCOMM_TEST_DEADLINE(60s);
    using self_comm = dcomm::communicator<outside::self_backend>;
    // A linger beyond the test: only a hand-back lets the io thread go on.
    auto thread = std::make_shared<dcomm::detail::io_thread>(std::chrono::seconds(120));
    std::optional<self_comm> made;
    {
      auto rt = std::make_shared<self_comm::runtime>();
      rt->backend = std::make_shared<outside::self_backend>(thread->get_executor());
      rt->thread = thread;
      made = self_comm::make_world(std::move(rt), 10s);
    }
    self_comm c = *made;
    std::promise<std::thread::id> io_id_p;
    asio::post(thread->get_executor(), [&] { io_id_p.set_value(std::this_thread::get_id()); });
    const auto io_id = io_id_p.get_future().get();
    const auto me = std::this_thread::get_id();
    int here = 0, at_once = 0;
    std::string where;
    for (int i = 0; i < 100; ++i) {
      std::vector<std::int32_t> x{i, -i};
      c.all_reduce(x, dcomm::sum, dcomm::blocking);
      REQUIRE(x == std::vector<std::int32_t>{i, -i});
      if (c.backend().ran_on == me) ++here;
      where += c.backend().ran_on == me ? 'h' : (c.backend().ran_on == io_id ? 'i' : '?');
      if (c.backend().dispatched_at_once) ++at_once;
    }
    // The first call asks the io thread to park and may run there.
    INFO("where each ran: " << where);
    CHECK(here >= 99);
    // Each ran as a handler of the executor would, on either thread: what
    // it dispatches runs in order (the MPI backend makes a split's
    // communicator so).
    CHECK(at_once == 100);
    c.barrier(dcomm::blocking);  // a timer's wait, run here too

    // Posted work that no blocking call runs: another token hands the
    // context back, and the io thread runs both (the io thread's linger
    // alone would hold them for minutes). A blocking call from the io
    // thread is refused there.
    std::promise<std::string> from_io;
    auto from_io_f = from_io.get_future();
    asio::post(thread->get_executor(), [&] {
      try {
        c.barrier(dcomm::blocking);
        from_io.set_value("it ran");
      } catch (const dcomm::error& e) {
        from_io.set_value(e.code() == dcomm::errc::invalid_argument ? "refused" : e.what());
      }
    });
    std::vector<float> y{1.5f};
    auto y_f = c.all_reduce(y, dcomm::max, asio::use_future);
    REQUIRE(y_f.wait_for(10s) == std::future_status::ready);
    y_f.get();
    REQUIRE(from_io_f.wait_for(10s) == std::future_status::ready);
    CHECK(from_io_f.get() == "refused");
    CHECK(c.backend().ran_on == io_id);

    // Parked again by blocking calls, then a request: its start hands the
    // context back, and so does wait().
    for (int i = 0; i < 3; ++i) c.barrier(dcomm::blocking);
    std::vector<std::int64_t> z{7};
    auto req = c.all_reduce(z, dcomm::sum, dcomm::as_request);
    const auto t0 = std::chrono::steady_clock::now();
    req.wait();
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    CHECK(z == std::vector<std::int64_t>{7});
    made.reset();
  }
}

TEST_SUITE("completion tokens") {
  // io_drive after an operation's start throws, on either path: while the
  // io thread runs the context (the park asked for with it), and while the
  // caller runs it. Either way later calls still run on the calling thread
  // with the io thread parked, rather than wait for a park never asked for
  // or a caller that left.
  TEST_CASE("io_drive: an operation's start that throws leaves the context usable") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::detail::io_thread thread(std::chrono::seconds(120));
    auto& drive = thread.drive();
    const auto me = std::this_thread::get_id();
    // One call: its operation posted to the context (run at once where this
    // thread runs it); true if it ended, and ran on this thread.
    auto call = [&](bool throw_at_start) {
      std::atomic<bool> done{false};
      std::thread::id ran_on;
      const bool ended = drive.drive(
          [&] {
            if (throw_at_start) throw std::runtime_error("start failed");
            asio::post(thread.get_executor(), [&] {
              ran_on = std::this_thread::get_id();
              done.store(true, std::memory_order_seq_cst);
              drive.notify();
            });
          },
          [&] { return done.load(std::memory_order_seq_cst); }, dcomm::detail::clock::now() + 5s);
      return ended && ran_on == me;
    };
    CHECK_THROWS_WITH_AS(call(true), "start failed", std::runtime_error);  // the io thread runs
    int here = 0;
    for (int i = 0; i < 20; ++i) here += call(false) ? 1 : 0;
    CHECK(here >= 19);
    CHECK_THROWS_WITH_AS(call(true), "start failed", std::runtime_error);  // this thread runs
    here = 0;
    for (int i = 0; i < 20; ++i) here += call(false) ? 1 : 0;
    CHECK(here == 20);
  }
}

// ------------------------------------------------------------------------
// The thread world itself.

namespace docs_example {
// docs/core.md, "Thread worlds", verbatim: keep the two in step.
void test_my_sum() {
  dcomm::thread_world_options<dcomm::cpu_backend> options{.timeout = std::chrono::seconds(10)};
  dcomm::run_thread_world<dcomm::cpu_backend>(
      4,
      [](dcomm::communicator<dcomm::cpu_backend>& comm) -> asio::awaitable<void> {
        std::vector<int> x{comm.rank()};
        co_await comm.all_reduce(x, dcomm::sum);
        if (x[0] != 0 + 1 + 2 + 3) throw std::runtime_error("wrong sum: " + std::to_string(x[0]));
      },
      options);
}
}  // namespace docs_example

TEST_SUITE("thread world") {
  TEST_CASE("docs/core.md's example runs") {
    DCOMM_TEST_DEADLINE(60s);
    CHECK_NOTHROW(docs_example::test_my_sum());
  }

  TEST_CASE("a failing rank: rank_failed names it, its exception nested; the rest listed") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 10s, .deadline = 50s};
    bool thrown = false;
    try {
      dcomm::run_thread_world<dcomm::cpu_backend>(
          3,
          [](comm& c) -> asio::awaitable<void> {
            if (c.rank() == 1) throw std::logic_error("rank one's own failure");
            // The others wait for rank 1, which is gone: peer_lost.
            co_await c.barrier();
          },
          o);
    } catch (const dcomm::error& e) {
      thrown = true;
      INFO(e.what());
      CHECK(e.code() == dcomm::errc::rank_failed);
      CHECK(e.context().rank == 1);
      CHECK(contains(e.what(), "rank one's own failure"));
      CHECK(contains(e.what(), "ranks {0,2} failed after it"));
      bool nested = false;
      try {
        std::rethrow_if_nested(e);
      } catch (const std::logic_error& original) {
        nested = std::string(original.what()) == "rank one's own failure";
      }
      CHECK(nested);
    }
    CHECK(thrown);
  }

  TEST_CASE("thread_world_failures: every rank's outcome; start-up failures included") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 10s, .deadline = 50s};
    auto failures = dcomm::thread_world_failures<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          std::vector<float> x{1.0f};
          co_await c.all_reduce(x, dcomm::sum);
          if (c.rank() == 0) throw check_failed("rank 0 checks after the all_reduce");
        },
        o);
    REQUIRE(failures.size() == 2);
    CHECK(failures[1] == nullptr);
    REQUIRE(failures[0] != nullptr);
    CHECK_THROWS_AS(std::rethrow_exception(failures[0]), check_failed);

    // A backend option no rank can use (an unknown algorithm name) fails
    // init_process_group on every rank: each has its own error.
    dcomm::thread_world_options<dcomm::cpu_backend> bad{
        .timeout = 10s, .deadline = 50s, .backend_of = [](int rank) {
          return dcomm::cpu_backend::options{.algorithms =
                                                 "all_reduce=no_such_" + std::to_string(rank)};
        }};
    auto start_up = dcomm::thread_world_failures<dcomm::cpu_backend>(
        2, [](comm&) -> asio::awaitable<void> { co_return; }, bad);
    for (int r = 0; r < 2; ++r) {
      REQUIRE(start_up[static_cast<std::size_t>(r)] != nullptr);
      auto what = dcomm::detail::message_of(start_up[static_cast<std::size_t>(r)]);
      INFO(what);
      CHECK(contains(what, "no_such_" + std::to_string(r)));
    }
    CHECK_THROWS_AS(dcomm::thread_world_failures<dcomm::cpu_backend>(
                        0, [](comm&) -> asio::awaitable<void> { co_return; }),
                    dcomm::error);
  }

  TEST_CASE("the deadline: hung ranks are aborted, and stopped, and fail with timeout") {
    DCOMM_TEST_DEADLINE(60s);
    // Both ranks wait for a message nobody sends, with an operation timeout
    // far beyond the world's deadline: the deadline aborts them.
    dcomm::thread_world_options<dcomm::cpu_backend> o{.timeout = 120s, .deadline = 1s};
    auto failures = dcomm::thread_world_failures<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          std::vector<float> x(1);
          co_await c.recv(x, 1 - c.rank());
        },
        o);
    for (int r = 0; r < 2; ++r) {
      REQUIRE(failures[static_cast<std::size_t>(r)] != nullptr);
      try {
        std::rethrow_exception(failures[static_cast<std::size_t>(r)]);
      } catch (const dcomm::error& e) {
        INFO(e.what());
        CHECK(e.code() == dcomm::errc::timeout);
        CHECK(e.context().rank == r);
        CHECK(contains(e.what(), "deadline (1000 ms"));
        CHECK(contains(e.what(), "aborted"));
      }
    }
    // A rank that waits on something abort() cannot reach (its own timer):
    // its io_context is stopped after the grace period.
    auto stuck = dcomm::thread_world_failures<dcomm::cpu_backend>(
        2,
        [](comm& c) -> asio::awaitable<void> {
          if (c.rank() == 0) {
            asio::steady_timer forever(co_await asio::this_coro::executor, 1h);
            co_await forever.async_wait(asio::use_awaitable);
          }
        },
        o);
    CHECK(stuck[1] == nullptr);
    REQUIRE(stuck[0] != nullptr);
    auto what = dcomm::detail::message_of(stuck[0]);
    INFO(what);
    CHECK(contains(what, "timed out in run_thread_world (rank 0)"));
  }
}
