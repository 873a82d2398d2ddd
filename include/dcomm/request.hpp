// dcomm::request, the handle of an operation started at once (isend,
// irecv, and any operation given the dcomm::as_request token): torch's
// Work object. The start itself is detail::request_access::start, which
// the communicator's machinery (impl/initiate.hpp) calls.
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

namespace detail {
struct request_access;
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
            // handler runs on its own (a coroutine's: its executor).
            auto target = asio::get_associated_executor(handler);
            asio::post(target,
                       [h = std::move(handler), failure]() mutable { std::move(h)(failure); });
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
    std::vector<asio::steady_timer*> waiters;  // only touched on `executor`
  };

  explicit request(std::shared_ptr<state> s) : state_(std::move(s)) {}

  // Runs on the executor (or while it is destroyed). Lets go of the
  // executor: a request may outlive it, an Asio executor may not.
  static void finish(const std::shared_ptr<state>& s, std::exception_ptr e) {
    asio::any_io_executor released;
    {
      std::lock_guard lock(s->mutex);
      s->done = true;
      s->failure = std::move(e);
      released = std::move(s->executor);
      s->executor = asio::system_executor();
    }
    s->cv.notify_all();
    for (auto* t : s->waiters) t->cancel();
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

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::request::wait_op<void>(std::shared_ptr<state> s) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::request_access::guarded<void>(task<void> op, guard g) -> task<void>)
// clang-format on
// End of the separate-compilation block.
