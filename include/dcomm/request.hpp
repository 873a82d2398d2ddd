// dcomm::request, the handle of an operation started at once (isend,
// irecv, and any operation given the dcomm::as_request token): torch's
// Work object. The start itself is detail::request_access::start, which
// the communicator's machinery (impl/initiate.hpp) calls.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

namespace detail {
struct request_access;

// Executors that run what they are given on Asio's system thread pool: a
// plain callback's (asio::system_executor) and asio::use_future's. A forked
// child inherits the pool's state but none of its threads, so a handler due
// at once is called inline rather than handed to them.
template <class E>
struct on_system_pool : std::false_type {};
template <class B, class R, class A>
struct on_system_pool<asio::basic_system_executor<B, R, A>> : std::true_type {};
template <class T, class B>
struct on_system_pool<asio::detail::promise_executor<T, B>> : std::true_type {};
template <class E>
inline constexpr bool on_system_pool_v = on_system_pool<E>::value;

// Calls `handler` with `values` (a tuple) now that its operation is done:
// posted to the handler's own executor, or inline where that is the
// system pool's. (A tuple: g++ 12 cannot capture a pack in a lambda inside
// a generic lambda, which is where callers are.)
template <class Handler, class Values>
void complete_now(Handler handler, Values values) {
  auto ex = asio::get_associated_executor(handler);
  auto call = [h = std::move(handler), v = std::move(values)]() mutable {
    std::apply([&](auto&... x) { std::move(h)(std::move(x)...); }, v);
  };
  if constexpr (on_system_pool_v<decltype(ex)>)
    call();
  else
    asio::post(ex, std::move(call));
}

// Told when any of the requests it watches finishes (wait_any).
struct request_watch {
  std::mutex mutex;
  std::condition_variable cv;
  bool fired = false;
  std::function<void()> also;  // set before it watches anything; async_wait_any's wake-up
  void fire() {
    {
      std::lock_guard lock(mutex);
      fired = true;
    }
    cv.notify_all();
    if (also) also();
  }
};
}  // namespace detail

// The token that makes an operation without a result start at once and
// return a dcomm::request (torch's async_op=True):
//   auto req = comm.all_reduce(grads, dcomm::avg, dcomm::as_request);
//   ... compute ...
//   co_await req.async_wait();
struct as_request_t {
  constexpr as_request_t() = default;
};
inline constexpr as_request_t as_request{};

// What a communicator operation without a result takes as its last argument.
template <typename Token>
concept op_token = completion_token_for<Token> || std::same_as<std::decay_t<Token>, as_request_t>;

// The handle isend/irecv (and dcomm::as_request) return: test() polls,
// wait() blocks, co_await req.async_wait() suspends. A failure is rethrown
// by wait().
class request {
 public:
  request() = default;

  bool valid() const { return state_ != nullptr; }

  // Whether the operation has finished (successfully or not).
  bool test() const {
    check_valid();
    std::lock_guard lock(state_->mutex);
    return state_->done;
  }

  // Blocks until the operation has finished; rethrows its failure.
  void wait() const {
    check_valid();
    {
      // Done: the executor may be gone already; do not touch it.
      std::lock_guard lock(state_->mutex);
      if (state_->done) {
        if (state_->failure) std::rethrow_exception(state_->failure);
        return;
      }
    }
    asio::any_io_executor executor;
    {
      std::lock_guard lock(state_->mutex);
      executor = state_->executor;
    }
    if (detail::running_in_this_thread(executor))
      throw_error(errc::invalid_argument,
                  {.operation = "request.wait",
                   .detail = "blocking wait on the thread that runs the communicator; use "
                             "co_await request.async_wait()"});
    // The io thread runs what is left of it, if blocking calls had it
    // parked (detail::io_drive).
    if (auto* drive = detail::io_drive::of(executor)) drive->hand_back();
    std::unique_lock lock(state_->mutex);
    if (!state_->cv.wait_until(lock, state_->deadline + detail::blocking_grace,
                               [&] { return state_->done; }))
      throw_error(errc::timeout, {.operation = state_->operation,
                                  .detail = "the operation did not complete; is anything running "
                                            "the communicator's executor?"});
    if (state_->failure) std::rethrow_exception(state_->failure);
  }

  template <completion_token_for Token = default_token_t>
  auto async_wait(Token&& token = {}) const {
    check_valid();
    if constexpr (std::is_same_v<std::decay_t<Token>, blocking_t>) {
      return wait();
    } else {
      return asio::async_initiate<Token, void(std::exception_ptr)>(
          [](auto handler, std::shared_ptr<state> s) {
            asio::any_io_executor executor;
            std::exception_ptr failure;
            bool done;
            {
              std::lock_guard lock(s->mutex);
              done = s->done;
              failure = s->failure;
              executor = s->executor;
            }
            if (!done) {
              // The waiter runs on the communicator's executor; the
              // handler is handed back to its own (detail::handing_over).
              detail::spawn(executor, wait_op(std::move(s)), std::move(handler));
              return;
            }
            // Finished: the request has let go of its executor, so the
            // handler runs on its own (detail::complete_now).
            detail::complete_now(std::move(handler), std::make_tuple(failure));
          },
          token, state_);
    }
  }

 private:
  friend struct detail::request_access;

  struct state {
    asio::any_io_executor executor;  // the backend's: completion and waiters run there
    const char* operation = "";
    detail::clock::time_point deadline;
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr failure;
    std::vector<asio::steady_timer*> waiters;                     // only touched on `executor`
    std::vector<std::shared_ptr<detail::request_watch>> watches;  // under `mutex`
  };

  explicit request(std::shared_ptr<state> s) : state_(std::move(s)) {}

  // Runs on the executor (or while it is destroyed). Lets go of the
  // executor: a request may outlive it, an Asio executor may not.
  static void finish(const std::shared_ptr<state>& s, std::exception_ptr e) {
    asio::any_io_executor released;
    std::vector<std::shared_ptr<detail::request_watch>> watches;
    {
      std::lock_guard lock(s->mutex);
      s->done = true;
      s->failure = std::move(e);
      released = std::move(s->executor);
      s->executor = asio::system_executor();
      watches = std::move(s->watches);
    }
    s->cv.notify_all();
    for (auto* t : s->waiters) t->cancel();
    for (auto& w : watches) w->fire();
  }

  DCOMM_EMIT_ON_USE static asio::awaitable<void> wait_op(std::shared_ptr<state> s);

  void check_valid() const {
    if (!state_)
      throw_error(errc::invalid_argument,
                  {.operation = "request", .detail = "an empty request (default-constructed)"});
  }

  std::shared_ptr<state> state_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto request::wait_op(std::shared_ptr<state> s)
    -> asio::awaitable<void> {
  {
    std::lock_guard lock(s->mutex);
    if (s->done) {
      if (s->failure) std::rethrow_exception(s->failure);
      co_return;
    }
  }
  asio::steady_timer timer(co_await asio::this_coro::executor,
                           s->deadline + detail::blocking_grace);
  s->waiters.push_back(&timer);
  // Off the list however this frame ends: a frame destroyed while it
  // waits (its io_context shut down) must not leave finish() a timer
  // that is gone.
  struct unlist {
    state* s;
    asio::steady_timer* t;
    ~unlist() { std::erase(s->waiters, t); }
  } unlist_on_exit{s.get(), &timer};
  for (;;) {
    {
      std::lock_guard lock(s->mutex);
      if (s->done) break;
    }
    asio::error_code ec;
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (!ec) break;
  }
  std::lock_guard lock(s->mutex);
  if (!s->done)
    throw_error(errc::timeout, {.operation = s->operation,
                                .detail = "the operation did not complete by its deadline"});
  if (s->failure) std::rethrow_exception(s->failure);
}

namespace detail {

// Starts `op` on `executor` and returns its request: the one way a request
// is made, so that its state stays private to this header.
struct request_access {
  // Registers `w` to be fired when r finishes; false (and nothing
  // registered) if it has already.
  static bool watch(const request& r, const std::shared_ptr<request_watch>& w) {
    std::lock_guard lock(r.state_->mutex);
    if (r.state_->done) return false;
    r.state_->watches.push_back(w);
    return true;
  }
  static void unwatch(const request& r, const std::shared_ptr<request_watch>& w) {
    std::lock_guard lock(r.state_->mutex);
    std::erase(r.state_->watches, w);
  }
  // The executor of a request not done yet (done: the system executor).
  static asio::any_io_executor executor_of(const request& r) {
    std::lock_guard lock(r.state_->mutex);
    return r.state_->executor;
  }
  static detail::clock::time_point deadline_of(const request& r) { return r.state_->deadline; }
  static void check_valid(const request& r) { r.check_valid(); }

  static request start(asio::any_io_executor executor, const char* operation,
                       detail::clock::time_point deadline, task<void> op) {
    auto s = std::make_shared<request::state>();
    s->executor = std::move(executor);
    s->operation = operation;
    s->deadline = deadline;
    start_task(s->executor, guarded(std::move(op), guard(s)));
    return request(std::move(s));
  }

 private:
  static void start_task(const asio::any_io_executor& executor, task<void> op);
  // If the executor is destroyed with the operation still pending (a user's
  // io_context that stops running), the request still finishes: with
  // errc::closed, instead of leaving wait() to its deadline. A parameter,
  // not a local: the coroutine may be destroyed before it ever ran.
  struct guard {
    std::shared_ptr<request::state> s;
    explicit guard(std::shared_ptr<request::state> state) : s(std::move(state)) {}
    guard(guard&& other) noexcept : s(std::move(other.s)) {}
    guard& operator=(guard&&) = delete;
    ~guard() {
      if (s)
        request::finish(
            s, std::make_exception_ptr(
                   error(errc::closed, {.operation = s->operation,
                                        .detail = "the communicator's executor was "
                                                  "destroyed before the operation finished"})));
    }
  };
  // Finishes the request itself: a completion handler could be destroyed
  // unrun along with the executor.
  DCOMM_EMIT_ON_USE static task<void> guarded(task<void> op, guard g);
};

DCOMM_EMIT_ON_USE_DEFINITION auto request_access::guarded(task<void> op, guard g) -> task<void> {
  std::exception_ptr failure;
  try {
    co_await std::move(op);
  } catch (...) {
    failure = std::current_exception();
  }
  auto s = std::move(g.s);
  request::finish(s, std::move(failure));
}

// Not inline in the separate-compilation mode: the library holds it, and
// the coroutine it starts (detail/asio.hpp).
#if !defined(DCOMM_SEPARATE_COMPILATION) || defined(DCOMM_SOURCE)
DCOMM_DECL void request_access::start_task(const asio::any_io_executor& executor, task<void> op) {
  detail::start(executor, std::move(op), ignore_end{});
}
#endif

}  // namespace detail

// ------------------------------------------------- several requests at once
// MPI's Waitall/Waitany/Testall/Testany/Testsome; torch's `for w in works:
// w.wait()`. Requests of different communicators may be mixed.

// Whether every one has finished (successfully or not).
inline bool test_all(std::span<const request> rs) {
  return std::all_of(rs.begin(), rs.end(), [](const request& r) { return r.test(); });
}
// The index of the first that has finished, if any.
inline std::optional<std::size_t> test_any(std::span<const request> rs) {
  for (std::size_t i = 0; i < rs.size(); ++i)
    if (rs[i].test()) return i;
  return std::nullopt;
}
// The indices of those that have finished, ascending.
inline std::vector<std::size_t> test_some(std::span<const request> rs) {
  std::vector<std::size_t> done;
  for (std::size_t i = 0; i < rs.size(); ++i)
    if (rs[i].test()) done.push_back(i);
  return done;
}

// Waits for every one; then rethrows the first failure in list order (all
// have finished by then, so no buffer is still in use).
inline void wait_all(std::span<const request> rs) {
  std::exception_ptr first;
  for (const auto& r : rs) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

namespace detail {
inline void check_requests(std::span<const request> rs, const char* operation) {
  if (rs.empty())
    throw_error(errc::invalid_argument, {.operation = operation, .detail = "no requests"});
  for (const auto& r : rs) request_access::check_valid(r);
}
// The latest deadline of those not finished: a wait for any of them ends
// by then, one way or the other.
inline clock::time_point latest_deadline(std::span<const request> rs) {
  auto latest = clock::time_point::min();
  for (const auto& r : rs) latest = std::max(latest, request_access::deadline_of(r));
  return latest + blocking_grace;
}
}  // namespace detail

// Blocks until one has finished and returns the lowest such index; it does
// not rethrow (that request's wait() does). Not on the thread that runs a
// communicator of these requests (co_await async_wait_any there).
inline std::size_t wait_any(std::span<const request> rs) {
  detail::check_requests(rs, "wait_any");
  if (auto i = test_any(rs)) return *i;
  auto w = std::make_shared<detail::request_watch>();
  std::vector<asio::any_io_executor> executors;
  for (const auto& r : rs) executors.push_back(detail::request_access::executor_of(r));
  for (const auto& ex : executors)
    if (detail::running_in_this_thread(ex))
      throw_error(errc::invalid_argument,
                  {.operation = "wait_any",
                   .detail = "blocking wait on the thread that runs the communicator; use "
                             "co_await dcomm::async_wait_any(requests)"});
  bool all_watched = true;
  for (const auto& r : rs) all_watched = detail::request_access::watch(r, w) && all_watched;
  for (const auto& ex : executors)
    if (auto* drive = detail::io_drive::of(ex)) drive->hand_back();
  if (all_watched) {
    std::unique_lock lock(w->mutex);
    w->cv.wait_until(lock, detail::latest_deadline(rs), [&] { return w->fired; });
  }
  for (const auto& r : rs) detail::request_access::unwatch(r, w);
  if (auto i = test_any(rs)) return *i;
  throw_error(errc::timeout, {.operation = "wait_any",
                              .detail = "none of the operations completed; is anything running "
                                        "the communicators' executors?"});
}

namespace detail {
// async_wait_any's coroutine, on a strand of a pending request's executor:
// a finishing request posts the cancel of its timer there, after the
// coroutine's check and wait (the strand orders them), so no wake-up is lost.
inline asio::awaitable<std::size_t> wait_any_op(std::vector<request> rs) {
  auto ex = co_await asio::this_coro::executor;
  auto timer = std::make_shared<asio::steady_timer>(ex, latest_deadline(rs));
  auto w = std::make_shared<request_watch>();
  w->also = [ex, timer] { asio::post(ex, [timer] { timer->cancel(); }); };
  for (const auto& r : rs) request_access::watch(r, w);
  std::optional<std::size_t> done;
  for (;;) {
    done = test_any(rs);
    if (done) break;
    asio::error_code ec;
    co_await timer->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (!ec) break;  // the deadline
  }
  for (const auto& r : rs) request_access::unwatch(r, w);
  if (!done) done = test_any(rs);
  if (!done)
    throw_error(errc::timeout,
                {.operation = "wait_any", .detail = "none of the operations completed"});
  co_return *done;
}
inline asio::awaitable<void> wait_all_op(std::vector<request> rs) {
  std::exception_ptr first;
  for (const auto& r : rs) {
    try {
      co_await r.async_wait(asio::use_awaitable);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}
// A strand of the first pending request's executor; none if all are done.
inline asio::any_io_executor wait_executor(std::span<const request> rs) {
  for (const auto& r : rs)
    if (!r.test()) return asio::make_strand(request_access::executor_of(r));
  return {};
}
// Completes `token` with `args` now (detail::complete_now).
template <class Signature, class Token, class... Args>
auto complete_at_once(Token&& token, Args... args) {
  return asio::async_initiate<Token, Signature>(
      [](auto handler, auto values) { complete_now(std::move(handler), std::move(values)); }, token,
      std::make_tuple(std::move(args)...));
}
}  // namespace detail

// wait_all and wait_any for any completion token: co_await, a callback
// (void(std::exception_ptr) and void(std::exception_ptr, std::size_t)),
// asio::use_future, dcomm::blocking.
template <completion_token_for Token = default_token_t>
auto async_wait_all(std::span<const request> rs, Token&& token = {}) {
  if constexpr (std::is_same_v<std::decay_t<Token>, blocking_t>) {
    return wait_all(rs);
  } else {
    for (const auto& r : rs) detail::request_access::check_valid(r);
    auto ex = detail::wait_executor(rs);  // none: all are done
    if (!ex) {
      std::exception_ptr first;
      try {
        wait_all(rs);
      } catch (...) {
        first = std::current_exception();
      }
      return detail::complete_at_once<void(std::exception_ptr)>(std::forward<Token>(token), first);
    }
    std::vector<request> held(rs.begin(), rs.end());
    return detail::spawn(ex, detail::wait_all_op(std::move(held)), std::forward<Token>(token));
  }
}
template <completion_token_for<std::size_t> Token = default_token_t>
auto async_wait_any(std::span<const request> rs, Token&& token = {}) {
  detail::check_requests(rs, "wait_any");
  if constexpr (std::is_same_v<std::decay_t<Token>, blocking_t>) {
    return wait_any(rs);
  } else {
    auto done = test_any(rs);
    auto ex = done ? asio::any_io_executor() : detail::wait_executor(rs);
    if (!ex) {  // one is done (or all finished meanwhile)
      if (!done) done = test_any(rs);
      return detail::complete_at_once<void(std::exception_ptr, std::size_t)>(
          std::forward<Token>(token), std::exception_ptr{}, *done);
    }
    std::vector<request> held(rs.begin(), rs.end());
    return detail::spawn(ex, detail::wait_any_op(std::move(held)), std::forward<Token>(token));
  }
}

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::request::wait_op<void>(std::shared_ptr<state> s) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::request_access::guarded<void>(task<void> op, guard g) -> task<void>)
// clang-format on
// End of the separate-compilation block.
