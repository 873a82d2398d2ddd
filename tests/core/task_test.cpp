// detail/task.hpp: the coroutine type of the backends' operations, its
// frame pool, use_task, and start() on an executor.
#include <doctest/doctest.h>

#include <asio.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "dcomm/detail/task.hpp"
#include "support/sanitizer.hpp"

namespace {

using dcomm::detail::task;

task<int> forty_two() {
  co_return 42;
}

task<int> add_one(int depth) {
  if (depth == 0) co_return co_await forty_two();
  co_return 1 + co_await add_one(depth - 1);
}

task<void> fails() {
  throw std::runtime_error("from a task");
  co_return;
}

task<std::string> catches() {
  try {
    co_await fails();
  } catch (const std::runtime_error& e) {
    co_return std::string("caught: ") + e.what();
  }
  co_return "nothing thrown";
}

// Sets a flag when destroyed: shows what a destroyed coroutine destroyed.
struct witness {
  std::shared_ptr<bool> destroyed;
  explicit witness(std::shared_ptr<bool> d) : destroyed(std::move(d)) {}
  witness(witness&& other) noexcept : destroyed(std::move(other.destroyed)) {}
  ~witness() {
    if (destroyed) *destroyed = true;
  }
};

task<void> holds(witness w) {
  static_cast<void>(w);
  co_return;
}

}  // namespace

TEST_SUITE("task") {
  TEST_CASE("values, nesting and exceptions pass through co_await") {
    asio::io_context ctx;
    std::optional<int> value;
    std::optional<std::string> text;
    std::exception_ptr failure;
    // Deep nesting: symmetric transfer, no stack growth per level.
    dcomm::detail::start(ctx.get_executor(), add_one(10000),
                         [&](std::exception_ptr e, std::optional<int> v) {
                           failure = e;
                           value = v;
                         });
    dcomm::detail::start(ctx.get_executor(), catches(),
                         [&](std::exception_ptr, std::optional<std::string> v) { text = v; });
    std::string thrown;
    dcomm::detail::start(ctx.get_executor(), fails(), [&](std::exception_ptr e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::runtime_error& err) {
        thrown = err.what();
      }
    });
    CHECK_FALSE(value.has_value());  // posted: nothing runs before the context does
    ctx.run();
    CHECK_FALSE(failure);
    CHECK(value == 10042);
    CHECK(text == "caught: from a task");
    CHECK(thrown == "from a task");
  }

  TEST_CASE("use_task hands over the operation's arguments, error codes included") {
    asio::io_context ctx;
    auto strand = asio::make_strand(ctx.get_executor());
    asio::steady_timer fires(strand, std::chrono::milliseconds(1));
    asio::steady_timer cancelled(strand, std::chrono::hours(1));
    std::optional<asio::error_code> first, second;
    auto body = [&]() -> task<void> {
      auto [ec] = co_await fires.async_wait(dcomm::detail::use_task);
      first = ec;
      CHECK(strand.running_in_this_thread());  // resumed on the timer's executor
      asio::post(strand, [&] { cancelled.cancel(); });
      auto [ec2] = co_await cancelled.async_wait(dcomm::detail::use_task);
      second = ec2;
    };
    dcomm::detail::start(strand, body(), [](std::exception_ptr e) { CHECK_FALSE(e); });
    ctx.run();
    REQUIRE(first.has_value());
    CHECK_FALSE(*first);
    REQUIRE(second.has_value());
    CHECK(*second == asio::error::operation_aborted);
  }

  TEST_CASE("a task whose executor goes before it runs is destroyed, with its arguments") {
    auto destroyed = std::make_shared<bool>(false);
    bool ran = false;
    {
      asio::io_context ctx;
      dcomm::detail::start(ctx.get_executor(), holds(witness(destroyed)),
                           [&](std::exception_ptr) { ran = true; });
      CHECK_FALSE(*destroyed);
    }  // never run
    CHECK(*destroyed);
    CHECK_FALSE(ran);
  }

  TEST_CASE("frame_pool hands a freed block back for the next request of its size class") {
    using dcomm::detail::frame_pool;
    void* a = frame_pool::allocate(200);
    frame_pool::deallocate(a, 200);
    void* b = frame_pool::allocate(250);       // the same class: 193 to 256 bytes
    if (!DCOMM_TEST_SANITIZED) CHECK(b == a);  // under ASan blocks are not pooled
    frame_pool::deallocate(b, 250);
    void* big = frame_pool::allocate(1 << 20);  // beyond the classes: operator new
    CHECK(big != nullptr);
    frame_pool::deallocate(big, 1 << 20);
  }
}
