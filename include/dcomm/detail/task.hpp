// The coroutine type of dcomm's operations inside a backend, and the pool
// its frames and Asio's operation memory come from.
//
// Why not asio::awaitable: every operation runs a chain of coroutines (the
// front end's, the backend's, the algorithm's, the transport's waits), and
// Asio allocates each awaitable frame through a per-thread cache of two
// blocks, so most of them reach malloc on every operation; so do the
// handlers of socket and timer operations without an allocator of their
// own. A task's frame and the handlers of `use_task` come from frame_pool,
// per-thread free lists that keep what steady state needs: no heap
// allocation per operation once warm.
//
//   task<int> answer() { co_return 42; }
//   task<void> body(asio::steady_timer& t) {
//     auto [ec] = co_await t.async_wait(use_task);   // resumes on the timer's executor
//     int x = co_await answer();
//   }
//   start(executor, body(timer), [](std::exception_ptr e) { ... });
//
// A task starts when awaited (or start()ed) and resumes its awaiter when it
// ends (symmetric transfer: no stack growth). Results and exceptions pass
// through co_await. use_task completes with the operation's arguments as a
// tuple, error codes included: nothing is thrown for them.
//
// g++ 12 destroys a non-trivially-destructible temporary argument of a call
// inside a co_await expression twice (GCC PR 100611): use_task is an empty
// tag for that reason, and callers keep such arguments in named variables.
#pragma once

#include "dcomm/detail/asio_config.hpp"  // first: before any Asio header

#include <asio/any_io_executor.hpp>
#include <asio/associated_allocator.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/bind_allocator.hpp>
#include <asio/bind_executor.hpp>
#include <asio/dispatch.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/strand.hpp>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <new>
#include <optional>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

namespace dcomm::detail {

// Per-thread free lists of blocks in 64-byte size classes up to 4 KiB;
// larger blocks go straight to operator new. A block freed on another
// thread joins that thread's lists. Lists only grow to what a thread has
// had in use at once.
class frame_pool {
 public:
  static void* allocate(std::size_t bytes) {
    const std::size_t c = size_class(bytes);
    if (c < classes && pooling && !state().dead) {
      node*& head = lists().head[c];
      if (head) {
        node* n = head;
        head = n->next;
        return n;
      }
      return ::operator new(c* step);
    }
    return ::operator new(bytes);
  }
  static void deallocate(void* p, std::size_t bytes) noexcept {
    const std::size_t c = size_class(bytes);
    if (c < classes && pooling && !state().dead) {
      node*& head = lists().head[c];
      head = ::new (p) node{head};
      return;
    }
    ::operator delete(p);
  }

 private:
  // Under AddressSanitizer every block goes to operator new and back, so
  // that a use after free of a frame is caught rather than hidden by reuse.
#if defined(__SANITIZE_ADDRESS__)
  static constexpr bool pooling = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  static constexpr bool pooling = false;
#else
  static constexpr bool pooling = true;
#endif
#else
  static constexpr bool pooling = true;
#endif
  static constexpr std::size_t step = 64;
  static constexpr std::size_t classes = 65;  // class c holds c * 64 bytes
  struct node {
    node* next;
  };
  struct free_lists {
    node* head[classes] = {};
    ~free_lists() {
      state().dead = true;  // blocks freed later on this thread go to operator delete
      for (node*& h : head)
        while (h) {
          node* n = h;
          h = n->next;
          ::operator delete(n);
        }
    }
  };
  struct flags {
    bool dead = false;
  };
  static std::size_t size_class(std::size_t bytes) noexcept {
    return (bytes + step - 1) / step;
  }
  static free_lists& lists() {
    thread_local free_lists l;
    return l;
  }
  static flags& state() noexcept {
    thread_local flags f;  // trivially destructible: still readable after lists() is gone
    return f;
  }
};

// The allocator Asio's operations use when their handler names it.
template <class T = void>
struct pool_allocator {
  using value_type = T;
  pool_allocator() noexcept = default;
  template <class U>
  pool_allocator(const pool_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(frame_pool::allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { frame_pool::deallocate(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const pool_allocator<U>&) const noexcept {
    return true;
  }
};

template <class T = void>
class task;

namespace task_detail {

struct promise_base {
  std::coroutine_handle<> continuation;
  std::exception_ptr failure;

  static void* operator new(std::size_t bytes) { return frame_pool::allocate(bytes); }
  static void operator delete(void* p, std::size_t bytes) noexcept {
    frame_pool::deallocate(p, bytes);
  }

  std::suspend_always initial_suspend() noexcept { return {}; }
  struct final_awaiter {
    bool await_ready() noexcept { return false; }
    template <class Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> h) noexcept {
      auto next = h.promise().continuation;
      return next ? next : std::noop_coroutine();
    }
    void await_resume() noexcept {}
  };
  final_awaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { failure = std::current_exception(); }
};

template <class T>
struct promise : promise_base {
  std::optional<T> value;
  task<T> get_return_object() noexcept;
  template <class U>
  void return_value(U&& v) {
    value.emplace(std::forward<U>(v));
  }
  T take() {
    if (failure) std::rethrow_exception(failure);
    return std::move(*value);
  }
};

template <>
struct promise<void> : promise_base {
  task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() {
    if (failure) std::rethrow_exception(failure);
  }
};

}  // namespace task_detail

template <class T>
class [[nodiscard]] task {
 public:
  using promise_type = task_detail::promise<T>;
  using value_type = T;

  task() noexcept = default;
  explicit task(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
  task(task&& other) noexcept : h_(std::exchange(other.h_, {})) {}
  task& operator=(task&& other) noexcept {
    if (this != &other) {
      if (h_) h_.destroy();
      h_ = std::exchange(other.h_, {});
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  ~task() {
    if (h_) h_.destroy();
  }

  bool await_ready() const noexcept { return !h_ || h_.done(); }
  std::coroutine_handle<> await_suspend(std::coroutine_handle<> awaiting) noexcept {
    h_.promise().continuation = awaiting;
    return h_;
  }
  T await_resume() { return h_.promise().take(); }

 private:
  std::coroutine_handle<promise_type> h_;
};

namespace task_detail {
template <class T>
task<T> promise<T>::get_return_object() noexcept {
  return task<T>(std::coroutine_handle<promise<T>>::from_promise(*this));
}
inline task<void> promise<void>::get_return_object() noexcept {
  return task<void>(std::coroutine_handle<promise<void>>::from_promise(*this));
}

// A coroutine nobody awaits: runs a task to its end and hands the outcome
// to a callback. Its frame goes when it ends, or unstarted with its starter.
struct detached {
  struct promise_type {
    static void* operator new(std::size_t bytes) { return frame_pool::allocate(bytes); }
    static void operator delete(void* p, std::size_t bytes) noexcept {
      frame_pool::deallocate(p, bytes);
    }
    detached get_return_object() noexcept {
      return {std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }  // run_to_end catches all
  };
  std::coroutine_handle<promise_type> h;
};

template <class T, class F>
detached run_to_end(task<T> t, F done) {
  std::exception_ptr failure;
  if constexpr (std::is_void_v<T>) {
    try {
      co_await t;
    } catch (...) {
      failure = std::current_exception();
    }
    done(failure);
  } else {
    std::optional<T> value;
    try {
      value.emplace(co_await t);
    } catch (...) {
      failure = std::current_exception();
    }
    done(failure, std::move(value));
  }
}

// The detached coroutine at the root of the chain of tasks running on this
// thread: whoever resumes a chain says so, and a suspended chain's handler
// owns its root, as an Asio awaitable thread owns its frames. A handler
// destroyed unrun (its io_context went away) destroys the root, and with it
// every task of the chain and what their frames hold.
inline std::coroutine_handle<>& current_root() noexcept {
  thread_local std::coroutine_handle<> root;
  return root;
}
class resuming_root {
 public:
  explicit resuming_root(std::coroutine_handle<> root) noexcept
      : saved_(std::exchange(current_root(), root)) {}
  resuming_root(const resuming_root&) = delete;
  resuming_root& operator=(const resuming_root&) = delete;
  ~resuming_root() { current_root() = saved_; }

 private:
  std::coroutine_handle<> saved_;
};

// A coroutine handle owned by a handler: destroyed with it unless resumed.
class owned_handle {
 public:
  explicit owned_handle(std::coroutine_handle<> h = {}) noexcept : h_(h) {}
  owned_handle(owned_handle&& other) noexcept : h_(std::exchange(other.h_, {})) {}
  owned_handle& operator=(owned_handle&&) = delete;
  ~owned_handle() {
    if (h_) h_.destroy();
  }
  std::coroutine_handle<> release() noexcept { return std::exchange(h_, {}); }

 private:
  std::coroutine_handle<> h_;
};

// The posted handler that starts a detached coroutine; destroyed unrun
// (its executor went away), it destroys the coroutine and so its task and
// the task's arguments.
class starter {
 public:
  explicit starter(std::coroutine_handle<> h) noexcept : root_(h) {}
  void operator()() {
    auto root = root_.release();
    resuming_root scope(root);
    root.resume();
  }

 private:
  owned_handle root_;
};

}  // namespace task_detail

// ex's target if it is a T, else null. Not any_io_executor::target<T>()
// alone: Asio 1.22 casts to T without checking the type.
template <class T>
const T* executor_target(const asio::any_io_executor& ex) noexcept {
#if !defined(ASIO_NO_TYPEID)
  if (ex && ex.target_type() == typeid(T)) return ex.template target<T>();
#endif
  return nullptr;
}

// The backends' executor where it is a strand of an io_context (what
// init_process_group makes): handlers that name it by its own type reach
// Asio with their allocator; through any_io_executor, whose type erasure
// drops the allocator, every completion would allocate.
using io_strand = asio::strand<asio::io_context::executor_type>;

// The backends' executor where init_process_group was given an io_context
// made for one thread (concurrency hint 1): that thread already runs one
// handler at a time, so no strand is needed (serial_executor).
using io_executor = asio::io_context::executor_type;

// Calls start(handler) with `h` given the pool's allocator and, where `ex`
// is an io_strand or an io_executor, that executor by its own type.
template <class Handler, class Start>
void with_pooled_handler(const asio::any_io_executor& ex, Handler h, Start start) {
  if (auto* strand = executor_target<io_strand>(ex))
    start(asio::bind_executor(*strand, asio::bind_allocator(pool_allocator<void>{}, std::move(h))));
  else if (auto* io = executor_target<io_executor>(ex))
    start(asio::bind_executor(*io, asio::bind_allocator(pool_allocator<void>{}, std::move(h))));
  else
    start(asio::bind_allocator(pool_allocator<void>{}, std::move(h)));
}

namespace task_detail {
enum class start_mode { posted, at_once };

template <start_mode Mode, class T, class F>
void start_on(const asio::any_io_executor& executor, task<T> t, F done) {
  auto d = run_to_end(std::move(t), std::move(done));
  auto* strand = executor_target<io_strand>(executor);
  if (strand && Mode == start_mode::at_once) {
    // Asio's dispatch, without the work_dispatcher it wraps the handler in
    // (a copy of the strand that counts work, and a second pass through
    // the strand once the strand runs it): the strand's own execute runs
    // it at once where dispatch would, and queues it where dispatch would.
    asio::prefer(*strand, asio::execution::allocator(pool_allocator<void>{})).execute(starter(d.h));
    return;
  }
  auto* io = strand ? nullptr : executor_target<io_executor>(executor);
  if (io && Mode == start_mode::at_once) {
    // The same on a one-thread io_context: runs it at once on its thread.
    asio::execution::execute(asio::prefer(*io, asio::execution::allocator(pool_allocator<void>{})),
                             starter(d.h));
    return;
  }
  auto handler = asio::bind_allocator(pool_allocator<void>{}, starter(d.h));
  if (strand)
    asio::post(*strand, std::move(handler));
  else if (io)
    asio::post(*io, std::move(handler));
  else
    asio::post(executor, std::move(handler));
}
}  // namespace task_detail

// The end of a task that nothing waits for (it says itself how it failed).
// A type with a name: a lambda's, in a function the separate-compilation
// mode keeps out of line, would have no linkage (-Wsubobject-linkage).
struct ignore_end {
  void operator()(std::exception_ptr) const noexcept {}
};

// Runs t on `executor` (posted: it starts after what was posted before)
// and calls done(exception_ptr) or done(exception_ptr, optional<T>) there
// when it ends.
template <class T, class F>
void start(const asio::any_io_executor& executor, task<T> t, F done) {
  task_detail::start_on<task_detail::start_mode::posted>(executor, std::move(t), std::move(done));
}

// The same, but started at once, inside the caller, where the caller runs
// on the strand's io_context thread and the strand is idle (Asio's
// dispatch): an operation called from a coroutine on the backend's
// io_context skips a trip through the scheduler (a reactor poll, a system
// call: a third of a small shared memory call). Anywhere else it is posted,
// behind the operations started before it. Only for a task whose end is
// posted (done must never run inside the caller).
template <class T, class F>
void start_now(const asio::any_io_executor& executor, task<T> t, F done) {
  task_detail::start_on<task_detail::start_mode::at_once>(executor, std::move(t), std::move(done));
}

// Runs f through `ex`, never inside the caller (post), with its memory from
// the pool where ex is an io_context's executor or an io_strand (an
// any_io_executor cannot pass the allocator on). Not dispatch: a handler
// run inside the backend's strand would start its next operation there,
// and a strand that receives work while it runs posts itself again, an
// allocation Asio makes with its own allocator.
template <class F>
void post_pooled(const asio::any_io_executor& ex, F f) {
  // An io_context's executor that counts outstanding work (what a pending
  // operation holds on its caller's executor) is a type of its own.
  using tracked_io_executor = std::decay_t<decltype(asio::prefer(
      std::declval<asio::io_context::executor_type>(), asio::execution::outstanding_work.tracked))>;
  auto handler = asio::bind_allocator(pool_allocator<void>{}, std::move(f));
  if (auto* io = executor_target<asio::io_context::executor_type>(ex))
    asio::post(*io, std::move(handler));
  else if (auto* tracked = executor_target<tracked_io_executor>(ex))
    asio::post(*tracked, std::move(handler));
  else if (auto* strand = executor_target<io_strand>(ex))
    asio::post(*strand, std::move(handler));
  else
    asio::post(ex, std::move(handler));
}

// Posts f through `work`, an executor that counts outstanding work (what
// an operation holds on its caller's executor while it runs elsewhere),
// and hands that count to the posted function: it is dropped where f runs
// (or is destroyed unrun), not by this thread once the post has returned.
// Dropped here, after the post, it could reach an io_context that f, run
// meanwhile, let its owner destroy: dcomm::sync_wait returns as soon as
// its coroutine has, and its io_context then goes (or a new one takes its
// memory, whose count the late drop would bring to zero: stopped).
template <class Work, class F>
void post_handing_over(Work work, F f) {
  const asio::any_io_executor ex = asio::prefer(work, asio::execution::outstanding_work.untracked);
  post_pooled(ex, [work = std::move(work), f = std::move(f)]() mutable {
    std::move(f)();
    (void)work;  // dropped with this function, on the thread that ran it
  });
}

// The completion token for Asio operations awaited inside a task.
struct use_task_t {
  constexpr use_task_t() = default;
};
inline constexpr use_task_t use_task{};

namespace task_detail {
// Resumes the task where the operation completes: on the executor of the
// I/O object (a strand of the backend's), with its memory from the pool.
template <class... Args>
struct resume_handler {
  using allocator_type = pool_allocator<void>;
  std::coroutine_handle<> h;  // the awaiting task, inside the chain
  owned_handle root;          // the chain's root, destroyed if this is never run
  std::optional<std::tuple<Args...>>* out;
  allocator_type get_allocator() const noexcept { return {}; }
  void operator()(Args... args) {
    out->emplace(std::move(args)...);
    resuming_root scope(root.release());
    h.resume();
  }
};

// Starts an Asio operation whose handler resumes h: on the I/O object's
// executor, by its own type where it is an io_strand. (An initiation that
// throws, which Asio's do only for lack of memory, destroys the handler and
// so the running chain: out of memory there is the end.)
template <class... Args, class Initiation, class... InitArgs>
void initiate_resuming(Initiation& initiation, std::coroutine_handle<> h,
                       std::optional<std::tuple<Args...>>* out, InitArgs&&... args) {
  resume_handler<Args...> handler{h, owned_handle(current_root()), out};
  if constexpr (requires { initiation.get_executor(); }) {
    const asio::any_io_executor io = initiation.get_executor();
    if (auto* strand = executor_target<io_strand>(io)) {
      std::move(initiation)(asio::bind_executor(*strand, std::move(handler)),
                            std::forward<InitArgs>(args)...);
      return;
    }
    if (auto* e = executor_target<io_executor>(io)) {
      std::move(initiation)(asio::bind_executor(*e, std::move(handler)),
                            std::forward<InitArgs>(args)...);
      return;
    }
  }
  std::move(initiation)(std::move(handler), std::forward<InitArgs>(args)...);
}
}  // namespace task_detail

}  // namespace dcomm::detail

template <class R, class... Args>
struct asio::async_result<dcomm::detail::use_task_t, R(Args...)> {
  template <class Initiation, class... InitArgs>
  struct awaiter {
    Initiation initiation;
    std::tuple<InitArgs...> args;
    std::optional<std::tuple<std::decay_t<Args>...>> result{};

    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      std::apply(
          [&](auto&&... a) {
            dcomm::detail::task_detail::initiate_resuming<std::decay_t<Args>...>(
                initiation, h, &result, std::move(a)...);
          },
          std::move(args));
    }
    std::tuple<std::decay_t<Args>...> await_resume() { return std::move(*result); }
  };

  template <class Initiation, class... InitArgs>
  static awaiter<std::decay_t<Initiation>, std::decay_t<InitArgs>...> initiate(
      Initiation&& initiation, dcomm::detail::use_task_t, InitArgs&&... args) {
    return {std::forward<Initiation>(initiation), {std::forward<InitArgs>(args)...}};
  }
};
