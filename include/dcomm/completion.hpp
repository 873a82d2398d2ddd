// Completion tokens and helpers shared by every dcomm initiating function.
//
// Every asynchronous dcomm operation is an Asio initiating function whose
// completion signature is void(std::exception_ptr, T...): the exception is a
// dcomm::error carrying the context a user needs, which an error_code alone
// cannot. So one call serves
//   co_await store.get("k");                         // default: asio::use_awaitable
//   store.get("k", [](std::exception_ptr, std::string) {...});
//   store.get("k", asio::use_future);
//   store.get("k", dcomm::blocking);                 // plain blocking form
#pragma once

#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/await_task.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/io_thread.hpp"
#include "dcomm/detail/task.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

// Token for the blocking form: the initiating function returns the result
// (or throws) once the operation has completed.
struct blocking_t {
  constexpr blocking_t() = default;
};
inline constexpr blocking_t blocking{};

using default_token_t = asio::use_awaitable_t<>;

// What an operation completing with T... accepts as its last argument.
template <typename Token, typename... Ts>
concept completion_token_for = std::same_as<std::decay_t<Token>, blocking_t> ||
    asio::completion_token_for<Token, void(std::exception_ptr, Ts...)>;

namespace detail {

// A blocking call from the thread that runs the operation's executor could
// never complete: refuse it instead of hanging.
// Whether this thread runs the io_context behind ex (inside a strand of it
// or not: a blocking wait there would stop everything the context runs).
inline bool running_in_this_thread(const asio::any_io_executor& ex) {
  if (auto* e = executor_target<asio::io_context::executor_type>(ex))
    return e->running_in_this_thread();
  if (auto* s = executor_target<asio::strand<asio::io_context::executor_type>>(ex))
    return s->get_inner_executor().running_in_this_thread();
  if (auto* s = executor_target<asio::strand<asio::any_io_executor>>(ex))
    return running_in_this_thread(s->get_inner_executor());
  return false;
}

// An executor that runs one handler at a time, for an object whose state
// is not locked: `ex` itself where it is an io_context's made for one
// thread (concurrency hint 1, Asio's word that one thread runs it: a strand
// there only costs its lock, its queue and the atomic reference count of
// every copy, a quarter of a small shared memory call), else a strand of
// `ex`. On an io_context the strand wraps the concrete executor type: a
// strand of the type-erased any_io_executor is too large for
// any_io_executor's small-object buffer, so every copy Asio makes per
// completed handler would allocate, and every property query on its inner
// executor too.
inline asio::any_io_executor serial_executor(const asio::any_io_executor& ex) {
  if (auto* io = executor_target<asio::io_context::executor_type>(ex)) {
    if (asio::use_service<asio::detail::scheduler>(io->context()).concurrency_hint() == 1)
      return ex;
    return asio::make_strand(*io);
  }
  return asio::make_strand(ex);
}

// Completes a std::promise from co_spawn's handler. Not asio::use_future:
// its handler runs through Asio's global system_context thread pool, whose
// threads do not survive fork(), so a forked child that had inherited a
// started pool would wait forever. This handler runs on the operation's own
// executor.
template <typename T>
auto promise_handler(std::shared_ptr<std::promise<T>> promise) {
  return [promise](std::exception_ptr failure, auto&&... value) {
    if (failure)
      promise->set_exception(failure);
    else
      promise->set_value(std::forward<decltype(value)>(value)...);
  };
}

template <typename T>
std::future<T> spawn_with_future(const asio::any_io_executor& ex, asio::awaitable<T> op) {
  auto promise = std::make_shared<std::promise<T>>();
  auto future = promise->get_future();
  asio::co_spawn(ex, std::move(op), promise_handler(std::move(promise)));
  return future;
}

// What a blocking call waits for: its operation's end, which the thread
// that ran the operation sets (and tells the io_drive, where one runs the
// operation's context: the caller may be waiting there).
template <typename T>
struct blocking_outcome {
  using value_type = std::conditional_t<std::is_void_v<T>, char, T>;
  io_drive* drive = nullptr;
  std::atomic<bool> done{false};
  std::exception_ptr failure;
  std::optional<value_type> value;
  std::mutex mutex;  // for a wait without an io_drive
  std::condition_variable ended;

  void finish(std::exception_ptr f, std::optional<value_type> v = {}) {
    failure = std::move(f);
    value = std::move(v);
    if (drive) {
      done.store(true, std::memory_order_seq_cst);  // seq_cst: see io_drive::notify
      drive->notify();
      return;
    }
    {
      std::lock_guard lock(mutex);
      done.store(true, std::memory_order_release);
    }
    ended.notify_all();
  }
  bool ready() const { return done.load(std::memory_order_seq_cst); }
  bool wait_until(clock::time_point deadline) {
    std::unique_lock lock(mutex);
    return ended.wait_until(lock, deadline, [this] { return ready(); });
  }
};

// Starts op on ex, to end in `out`: at once where this thread runs ex's
// context (io_drive's as_handler; finish may then run inside this call, as
// the end of a blocking call may), else posted.
template <typename T>
void start_blocking(const asio::any_io_executor& ex, task<T> op,
                    std::shared_ptr<blocking_outcome<T>> out) {
  if constexpr (std::is_void_v<T>)
    start_now(ex, std::move(op), [out](std::exception_ptr failure) { out->finish(failure); });
  else
    start_now(ex, std::move(op), [out](std::exception_ptr failure, std::optional<T> value) {
      out->finish(failure, std::move(value));
    });
}
template <typename T>
void start_blocking(const asio::any_io_executor& ex, asio::awaitable<T> op,
                    std::shared_ptr<blocking_outcome<T>> out) {
  // Two handlers, not one generic lambda: clang checks std::optional<T>
  // where T is void even in a discarded branch of one.
  if constexpr (std::is_void_v<T>)
    asio::co_spawn(ex, std::move(op), [out](std::exception_ptr failure) { out->finish(failure); });
  else
    asio::co_spawn(ex, std::move(op), [out](std::exception_ptr failure, T value) {
      if (failure)
        out->finish(failure);
      else
        out->finish(nullptr, std::optional<T>(std::move(value)));
    });
}

template <typename Op>
struct op_result;
template <typename T>
struct op_result<task<T>> {
  using type = T;
};
template <typename T>
struct op_result<asio::awaitable<T>> {
  using type = T;
};

// Runs op (an awaitable or a task) to its end from plain code, by
// `deadline`. Where an io_thread runs ex's context (`drive`: its io_drive),
// this thread runs that context meanwhile: no hand-over to the io thread
// and back per call. Else it waits for the thread that runs the context.
template <typename Op, typename T = typename op_result<Op>::type>
T run_blocking(const asio::any_io_executor& ex, Op op, const char* operation,
               clock::time_point deadline, io_drive* drive) {
  if (running_in_this_thread(ex))
    throw_error(errc::invalid_argument,
                {.operation = operation,
                 .detail = "blocking call made from the thread that runs the object's executor; "
                           "co_await it instead"});
  auto out = std::allocate_shared<blocking_outcome<T>>(pool_allocator<blocking_outcome<T>>{});
  out->drive = drive;
  bool ended = false;
  if (drive) {
    ended = drive->drive([&] { start_blocking(ex, std::move(op), out); },
                         [&out] { return out->ready(); }, deadline);
  } else {
    start_blocking(ex, std::move(op), out);
    ended = out->wait_until(deadline);
  }
  if (!ended)
    throw_error(errc::timeout, {.operation = operation,
                                .detail = "the operation did not complete; is anything running "
                                          "the executor it was started on?"});
  if (out->failure) std::rethrow_exception(out->failure);
  if constexpr (!std::is_void_v<T>) return T(std::move(*out->value));
}

// The same within `limit` (every operation has its own deadline; this one
// only guards against an executor nobody runs, which would otherwise block
// forever), on ex's io_drive if it has one.
template <typename Op, typename T = typename op_result<Op>::type>
T run_blocking(const asio::any_io_executor& ex, Op op, const char* operation,
               clock::duration limit) {
  return run_blocking(ex, std::move(op), operation, clock::now() + limit, io_drive::of(ex));
}

// The completion signature of an operation with a result of type T.
template <typename T>
struct task_completion {
  using type = void(std::exception_ptr, T);
};
template <>
struct task_completion<void> {
  using type = void(std::exception_ptr);
};

// Whether a handler's associated executor fits in an any_io_executor.
// asio::use_future's does not: its promise_executor lacks the properties
// any_io_executor requires (context, outstanding work), so the completers
// below cannot hold it.
template <typename Handler>
inline constexpr bool has_io_executor_v =
    std::is_constructible_v<asio::any_io_executor,
                            asio::associated_executor_t<Handler, asio::any_io_executor>>;

// co_spawn's handler for an operation that runs on `ex` while its caller's
// handler runs on another executor (a coroutine's io_context, say): Asio's
// co_spawn would post the handler there from the operation's thread and
// drop its count of work there afterwards, which an io_context gone
// meanwhile does not survive (post_handing_over). Here co_spawn completes
// on `ex` itself, and the handler is posted with the count handed over.
// The caller's cancellation slot is the operation's still.
template <typename Handler>
class handing_over {
 public:
  using cancellation_slot_type = asio::associated_cancellation_slot_t<Handler>;
  handing_over(Handler h, const asio::any_io_executor& ex)
      : work_(asio::prefer(asio::get_associated_executor(h, ex),
                           asio::execution::outstanding_work.tracked)),
        handler_(std::move(h)) {}
  cancellation_slot_type get_cancellation_slot() const noexcept {
    return asio::get_associated_cancellation_slot(handler_);
  }
  template <typename... Args>
  void operator()(Args... args) {
    post_handing_over(std::move(work_),
                      [h = std::move(handler_), ... a = std::move(args)]() mutable {
                        std::move(h)(std::move(a)...);
                      });
  }

 private:
  asio::any_io_executor work_;
  Handler handler_;
};

// asio::co_spawn(ex, op, token), with the caller's handler completed as
// handing_over does (where it runs on an executor that can count work).
template <typename T, typename Token>
auto spawn(const asio::any_io_executor& ex, asio::awaitable<T> op, Token&& token) {
  return asio::async_initiate<Token, typename task_completion<T>::type>(
      [ex](auto handler, asio::awaitable<T> a) {
        using handler_type = decltype(handler);
        if constexpr (has_io_executor_v<handler_type>)
          asio::co_spawn(ex, std::move(a), handing_over<handler_type>(std::move(handler), ex));
        else
          asio::co_spawn(ex, std::move(a), std::move(handler));
      },
      token, std::move(op));
}

// Starts `op` on `ex` and completes `token` with its result. Every store and
// backend operation goes through here, so the token handling lives in one place.
template <typename T, typename Token>
auto initiate(const asio::any_io_executor& ex, asio::awaitable<T> op, Token&& token,
              const char* operation, detail::clock::duration limit) {
  if constexpr (std::is_same_v<std::decay_t<Token>, blocking_t>)
    return run_blocking(ex, std::move(op), operation, limit);
  else
    return spawn(ex, std::move(op), std::forward<Token>(token));
}

// The same for an operation that is a task (the backends' operations):
// started on `ex` without an Asio coroutine frame, its handler called
// through the handler's own executor, whose work is counted meanwhile (as
// co_spawn does), so that an io_context waiting for it does not run dry,
// and handed over with the handler (post_handing_over).
template <typename T, typename Handler>
class task_completer {
 public:
  task_completer(Handler h, const asio::any_io_executor& ex)
      : work_(asio::prefer(asio::get_associated_executor(h, ex),
                           asio::execution::outstanding_work.tracked)),
        handler_(std::move(h)) {}
  void operator()(std::exception_ptr failure) {
    post_handing_over(std::move(work_),
                      [h = std::move(handler_), failure]() mutable { std::move(h)(failure); });
  }
  template <typename V>
  void operator()(std::exception_ptr failure, std::optional<V> value) {
    post_handing_over(std::move(work_),
                      [h = std::move(handler_), failure, v = std::move(value)]() mutable {
                        std::move(h)(failure, v ? std::move(*v) : T{});
                      });
  }

 private:
  asio::any_io_executor work_;
  Handler handler_;
};

// The completer for such a handler, done as Asio's own operations do it
// (handler_work): the operation's executor counts the pending work, and
// the completion, posted there, is dispatched to the handler's executor.
// For use_future that dispatch sets the promise at once, on the
// operation's thread: not asio::post, which would run it on Asio's global
// system_context thread pool (threads that do not survive fork(); see
// promise_handler).
template <typename T, typename Handler>
class foreign_task_completer {
 public:
  foreign_task_completer(Handler h, const asio::any_io_executor& ex)
      : work_(asio::prefer(ex, asio::execution::outstanding_work.tracked)),
        handler_ex_(asio::prefer(asio::get_associated_executor(h, ex),
                                 asio::execution::outstanding_work.tracked)),
        handler_(std::move(h)) {}
  void operator()(std::exception_ptr failure) {
    auto work = std::move(work_);
    post_pooled(work, [ex = std::move(handler_ex_), h = std::move(handler_), failure]() mutable {
      asio::dispatch(ex, [h = std::move(h), failure]() mutable { std::move(h)(failure); });
    });
  }
  template <typename V>
  void operator()(std::exception_ptr failure, std::optional<V> value) {
    auto work = std::move(work_);
    post_pooled(work, [ex = std::move(handler_ex_), h = std::move(handler_), failure,
                       v = std::move(value)]() mutable {
      asio::dispatch(ex, [h = std::move(h), failure, v = std::move(v)]() mutable {
        std::move(h)(failure, v ? std::move(*v) : T{});
      });
    });
  }

 private:
  using handler_executor = std::decay_t<decltype(asio::prefer(
      std::declval<asio::associated_executor_t<Handler, asio::any_io_executor>>(),
      asio::execution::outstanding_work.tracked))>;
  asio::any_io_executor work_;
  handler_executor handler_ex_;
  Handler handler_;
};

// asio::use_awaitable_t<Executor>, and its Executor.
template <typename Token>
struct use_awaitable_traits {
  static constexpr bool value = false;
};
template <typename Executor>
struct use_awaitable_traits<asio::use_awaitable_t<Executor>> {
  static constexpr bool value = true;
  using executor_type = Executor;
};
template <typename Token>
inline constexpr bool is_use_awaitable_v = use_awaitable_traits<Token>::value;

template <typename T, typename Token>
auto initiate(const asio::any_io_executor& ex, task<T> op, Token&& token, const char* operation,
              detail::clock::duration limit) {
  if constexpr (std::is_same_v<std::decay_t<Token>, blocking_t>) {
    return run_blocking(ex, std::move(op), operation, limit);
  } else if constexpr (is_use_awaitable_v<std::decay_t<Token>>) {
    // Resumed at once when it ends inside its start (detail/await_task.hpp).
    using executor = typename use_awaitable_traits<std::decay_t<Token>>::executor_type;
    return await_task<T, executor>(ex, std::move(op));
  } else {
    return asio::async_initiate<Token, typename task_completion<T>::type>(
        [ex](auto handler, task<T> t) {
          using handler_type = decltype(handler);
          // Both completers post the end: it never runs inside the caller.
          if constexpr (has_io_executor_v<handler_type>)
            start_now(ex, std::move(t), task_completer<T, handler_type>(std::move(handler), ex));
          else
            start_now(ex, std::move(t),
                      foreign_task_completer<T, handler_type>(std::move(handler), ex));
        },
        token, std::move(op));
  }
}

// Extra time a blocking wait allows beyond an operation's own deadline.
inline constexpr detail::clock::duration blocking_grace = std::chrono::seconds(30);

}  // namespace detail

// Runs a coroutine to completion on a caller-owned io_context from plain
// code (main, tests) and returns its result or rethrows its exception. Runs
// handlers only until the coroutine is done: servers and connections it
// started stay alive on the context for the next call.
template <typename T>
T sync_wait(asio::io_context& context, asio::awaitable<T> op) {
  // A timer gives the context its reactor (if it has none yet), so that
  // this thread waits in epoll_wait, which a post from another thread
  // interrupts under the scheduler's lock. Without one it would wait on a
  // condition variable, which Asio signals after unlocking: the posting
  // thread could still be inside pthread_cond_signal when this one, woken,
  // returns and lets the context be destroyed.
  { asio::steady_timer reactor(context); }
  auto result = detail::spawn_with_future<T>(context.get_executor(), std::move(op));
  context.restart();
  while (result.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
    if (context.run_one() == 0)
      throw_error(errc::aborted, {.operation = "sync_wait",
                                  .detail = "the io_context ran out of work before the coroutine "
                                            "finished (was it stopped?)"});
  return result.get();
}

// The same on a fresh io_context of its own (run by this thread alone:
// hint 1, so a backend made on it needs no strand).
template <typename T>
T sync_wait(asio::awaitable<T> op) {
  asio::io_context context{1};
  return sync_wait(context, std::move(op));
}

}  // namespace dcomm

// Separate compilation (detail/asio.hpp): the blocking path of every call
// that returns nothing, compiled once in the library. Written by hand:
// templates of the operation's type.
// clang-format off
DCOMM_INSTANTIATE(void dcomm::detail::run_blocking<dcomm::detail::task<void>, void>(const asio::any_io_executor&, task<void>, const char*, clock::time_point, io_drive*))
DCOMM_INSTANTIATE(void dcomm::detail::run_blocking<dcomm::detail::task<void>, void>(const asio::any_io_executor&, task<void>, const char*, clock::duration))
DCOMM_INSTANTIATE(void dcomm::detail::run_blocking<asio::awaitable<void>, void>(const asio::any_io_executor&, asio::awaitable<void>, const char*, clock::time_point, io_drive*))
DCOMM_INSTANTIATE(void dcomm::detail::run_blocking<asio::awaitable<void>, void>(const asio::any_io_executor&, asio::awaitable<void>, const char*, clock::duration))
// clang-format on
