// A task awaited from an asio::awaitable coroutine (the default token,
// asio::use_awaitable) without a trip through the scheduler when the task
// ends inside its own start.
//
// Why: a small call over shared memory usually ends where it starts (the
// peers are already there, or arrive while the transport spins). Posted,
// its end costs a scheduler round (a mutex, the reactor's poll, work
// counting): a third of such a call. Asio 1.22 has no immediate executor
// (1.27+ does), and a use_awaitable handler invoked inside its initiation
// resumes the coroutine on the initiation's own stack, so back-to-back
// calls that end at once would recurse without bound.
//
// How: await_task is an awaitable coroutine that starts the task from
// Asio's initiation hook (the function an awaitable frame runs once the
// coroutine has suspended, what use_awaitable's own initiate uses). If the
// task has ended when its start returns, the hook returns without handing
// the coroutine's thread to a handler, and Asio's pump loop resumes the
// coroutine at once: no recursion, no scheduler. Otherwise the thread goes
// to a handler that the task's end posts, as every other token's handler
// is (tracked work on the handler's executor, so its io_context does not
// run dry meanwhile). After `inline_turns` immediate ends in a row on one
// thread the next end is posted anyway, so a coroutine whose calls always
// end at once still lets the rest of its io_context run.
#pragma once

#include "dcomm/detail/asio_config.hpp"  // first: before any Asio header

#include <asio/awaitable.hpp>
#include <asio/use_awaitable.hpp>
#include <atomic>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "dcomm/detail/task.hpp"

namespace dcomm::detail {

namespace await_task_detail {

// Immediate ends in a row before one is posted. Each posted end is a
// scheduler round with a reactor poll, and lets the shared memory
// transport's doorbell settle (peers that arrive meanwhile ring it, a
// system call each): at 64 a small call makes a quarter of the system
// calls it made at 16, and other handlers wait at most 64 small calls
// (docs/performance.md, "Figures behind the code").
inline constexpr int inline_turns = 64;
inline int& inline_streak() noexcept {
  thread_local int streak = 0;
  return streak;
}

template <class T>
using value_of = std::conditional_t<std::is_void_v<T>, char, T>;

// Where the task's end meets the awaiting coroutine, in that coroutine's
// frame (alive until the coroutine is resumed or destroyed, which only its
// handler, run after the end, or the end itself can cause).
template <class T, class Executor>
struct meeting {
  using handler_type = std::conditional_t<
      std::is_void_v<T>, asio::detail::awaitable_handler<Executor, std::exception_ptr>,
      asio::detail::awaitable_handler<Executor, std::exception_ptr, value_of<T>>>;
  using work_type = std::decay_t<decltype(asio::prefer(std::declval<const Executor&>(),
                                                       asio::execution::outstanding_work.tracked))>;
  enum : int { running, ended, handed_over };

  std::atomic<int> state{running};
  std::exception_ptr failure;
  std::optional<value_of<T>> value;
  std::optional<handler_type> handler;
  std::optional<work_type> work;

  // Posts the handler with the end (once both are here), the count of
  // work with it (post_handing_over: the end may come on another thread).
  void complete_later() {
    post_handing_over(std::move(*work), [h = std::move(*handler), failure = failure,
                                         value = std::move(value)]() mutable {
      if constexpr (std::is_void_v<T>)
        std::move(h)(failure);
      else
        std::move(h)(failure, value ? std::move(*value) : value_of<T>{});
    });
  }

  // The task's end (run_to_end's done): inside the start, or later on the
  // task's executor.
  void end(std::exception_ptr f) {
    failure = f;
    if (state.exchange(ended, std::memory_order_acq_rel) == handed_over) complete_later();
  }
  void end(std::exception_ptr f, std::optional<value_of<T>> v) {
    value = std::move(v);
    end(f);
  }
};

template <class T, class Executor>
struct meeting_end {
  meeting<T, Executor>* m;
  void operator()(std::exception_ptr f) { m->end(f); }
  template <class V>
  void operator()(std::exception_ptr f, std::optional<V> v) {
    m->end(f, std::move(v));
  }
};

}  // namespace await_task_detail

// Runs t on `ex` (started at once where the caller may enter ex: see
// start_now) for a coroutine that co_awaits the result.
template <class T, class Executor>
asio::awaitable<T, Executor> await_task(asio::any_io_executor ex, task<T> t) {
  using namespace await_task_detail;
  meeting<T, Executor> m;
  co_await [&](auto* frame) -> asio::detail::awaitable_thread<Executor>* {
    start_now(ex, std::move(t), meeting_end<T, Executor>{&m});
    int& streak = inline_streak();
    if (m.state.load(std::memory_order_acquire) == m.ended && ++streak < inline_turns)
      return nullptr;  // the pump resumes this coroutine at once, below
    streak = 0;
    // Hand the coroutine to a handler that the end posts.
    m.handler.emplace(frame->detach_thread());
    m.work.emplace(
        asio::prefer(m.handler->get_executor(), asio::execution::outstanding_work.tracked));
    int expected = m.running;
    if (!m.state.compare_exchange_strong(expected, m.handed_over, std::memory_order_acq_rel))
      m.complete_later();  // it has ended: inside the start, or meanwhile elsewhere
    return nullptr;
  };
  // Only reached when the task ended inside its start: a handed-over
  // coroutine is completed and resumed by its handler, not here.
  if (m.failure) std::rethrow_exception(m.failure);
  if constexpr (!std::is_void_v<T>) co_return std::move(*m.value);
}

}  // namespace dcomm::detail
