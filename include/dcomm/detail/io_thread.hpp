// An io_context with a thread of its own, for objects a user creates
// without giving them an executor (the blocking API of torch.distributed
// users), and io_drive: how a blocking call runs that context on the
// calling thread instead of waiting for the io thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/await_task.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/task.hpp"

// Asio's scheduler, which as_handler below works with: with
// ASIO_SEPARATE_COMPILATION, <asio.hpp> does not bring all of it.
#include <asio/detail/scheduler.hpp>
#include <asio/detail/scheduler_thread_info.hpp>

namespace dcomm::detail {

// Who runs an io_thread's context: its thread, or, for a while, threads
// that make blocking calls.
//
// Why: a blocking call that posts its operation to the io thread and
// sleeps until it has ended pays two thread wake-ups, the io thread's (out
// of epoll_wait) and its own (out of a futex wait): several times a small
// operation over shared memory. Instead the calling thread runs the context
// (io_context::run_one) until its operation has ended, while the io thread
// is parked inside a handler of the context, so that it runs nothing else:
// one thread at a time runs the handlers, as a context made for one thread
// requires (concurrency hint 1: the backends run on it without a strand).
// Each hand-over goes through one mutex, which orders the handlers' work
// on either side of it.
//
// The io thread parks when a blocking call asks (that call still pays the
// wake-ups), and stays parked for `linger` after the last blocking call has
// ended, so that blocking calls in a row pay none; then it takes the context
// back. Between calls, meanwhile, nothing runs the context: what peers send
// waits for the next call (as with MPI, which makes progress inside its
// calls), and so does whatever is posted there, except where the poster
// hands the context back at once (hand_back: a communicator operation
// started with another token, request.wait(), new_group, abort, close).
// Several threads may make blocking calls: one runs the context, the others
// wait for their ends (the runner runs their operations too) or their turn.
class io_drive : public asio::execution_context::service {
 public:
  static inline asio::execution_context::id id;
  static constexpr std::chrono::microseconds default_linger{1000};

  explicit io_drive(asio::execution_context& owner,
                    std::chrono::microseconds linger = default_linger)
      : asio::execution_context::service(owner),
        linger_(linger),
        scheduler_(asio::use_service<asio::detail::scheduler>(owner)) {}

  // The io_drive of the io_context behind ex (itself, or a strand of it)
  // where an io_thread runs that context; else null.
  static io_drive* of(const asio::any_io_executor& ex) {
    asio::io_context* context = nullptr;
    if (auto* e = executor_target<asio::io_context::executor_type>(ex))
      context = &e->context();
    else if (auto* s = executor_target<io_strand>(ex))
      context = &s->get_inner_executor().context();
    if (!context || !asio::has_service<io_drive>(*context)) return nullptr;
    return &asio::use_service<io_drive>(*context);
  }

  // Starts an operation (start()) and runs the context on this thread
  // until ready(), once the io thread has parked and no other caller runs
  // it: then start() runs as a handler of the context would (as_handler),
  // so that the operation starts at once and may end there. Else start()
  // posts it, and this thread waits (for the park, for the other caller,
  // or for the end, which calls notify(), where another thread runs it).
  // False if the deadline came first. Never from a thread that runs the
  // context (run_one may not nest).
  template <class Start, class Ready>
  bool drive(Start start, Ready ready, clock::time_point deadline) {
    std::shared_ptr<void> keep;  // destroyed after `lock` is released
    std::unique_lock lock(mutex_);
    bool started = false;
    for (;;) {
      if (started && ready()) return true;
      if (parked_ && !driving_ && !leave_ && !stopping_ && (keep || (keep = keep_.lock()))) {
        driving_ = true;
        const auto last_end = idle_since_;
        {
          // Whatever leaves run() (a handler's exception too) gives the
          // context up: else the parked io thread would wait for ever.
          struct give_up {
            io_drive& d;
            std::unique_lock<std::mutex>& lock;
            ~give_up() {
              lock.lock();
              d.driving_ = false;
              d.idle_since_ = clock::now();
              if (d.waiting_.load() > 0 || d.leave_ || d.stopping_) d.changed_.notify_all();
            }
          } on_exit{*this, lock};
          lock.unlock();
          run(start, started, ready, last_end, deadline);
        }
        // Not ended: the deadline came, or the context was stopped (the
        // io_thread goes), which no operation outlives.
        if (!ready() && (idle_since_ >= deadline || io().stopped())) return false;
        continue;
      }
      // The io thread is to park once it has run what is queued, this
      // operation included (posted first): asked for with the operation,
      // even where the io thread ends it before this thread looks again,
      // so that the next call finds it parked.
      const bool ask = !engaged_.load(std::memory_order_relaxed) && !stopping_;
      if (ask) engaged_.store(true, std::memory_order_relaxed);
      if (!started || ask) {
        lock.unlock();
        // The park asked for is posted even where start() throws: else
        // engaged_ would stay set, and no later call would ask again.
        struct post_park {
          io_drive& d;
          bool ask;
          ~post_park() {
            if (ask) asio::post(d.io(), [&d = d] { d.park(); });
          }
        } on_exit{*this, ask};
        if (!started) start();
        lock.lock();
        started = true;
        continue;
      }
      if (clock::now() >= deadline) return false;
      waiting_.fetch_add(1, std::memory_order_seq_cst);
      if (!ready()) changed_.wait_until(lock, deadline);
      waiting_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // An operation that a caller may wait for in drive() has ended (its
  // ready() true, stored before this, seq_cst: a caller counts itself in
  // waiting_ before its last look at ready(), so either it sees the end or
  // this sees it waiting, and takes the lock it waits under).
  void notify() {
    if (waiting_.load(std::memory_order_seq_cst) == 0) return;
    std::lock_guard lock(mutex_);
    changed_.notify_all();
  }

  // Lets the io thread take the context back now, if it is parked or on
  // its way there: something was posted that no blocking call will run.
  void hand_back() {
    if (!engaged_.load(std::memory_order_relaxed)) return;
    std::lock_guard lock(mutex_);
    if (engaged_.load(std::memory_order_relaxed) && !leave_) {
      leave_ = true;
      changed_.notify_all();
    }
  }

 private:
  friend class io_thread;

  asio::io_context& io() {
    return static_cast<asio::io_context&>(asio::execution_context::service::context());
  }

  // Runs f on this thread as a handler of the context, the way Asio
  // 1.22's scheduler runs one (do_run_one and its work_cleanup): inside the
  // scheduler's call stack, so that dispatch and running_in_this_thread
  // take this thread for one that runs the context (an operation started
  // inside runs at once, and what it dispatches too, as on the io thread);
  // what it posts meanwhile (in this thread's private queue, the context
  // being made for one thread) joins the queue behind what was there.
  // Only for the thread that runs the context now.
  template <class F>
  void as_handler(F&& f) {
    asio::detail::scheduler_thread_info info;
    info.private_outstanding_work = 0;
    struct flush {
      asio::detail::scheduler& s;
      asio::detail::scheduler_thread_info& info;
      ~flush() {
        for (long i = 0; i < info.private_outstanding_work; ++i) s.work_started();
        s.post_deferred_completions(info.private_op_queue);
      }
    } on_exit{scheduler_, info};
    {
      asio::detail::call_stack<asio::detail::thread_context,
                               asio::detail::thread_info_base>::context inside(&scheduler_, info);
      std::forward<F>(f)();
    }
    info.rethrow_pending_exception();
  }

  // The driving caller's turn: starts the operation as a handler (if not
  // yet started), then runs handlers until it has ended. An operation that
  // ends at once runs none, as a co_awaited one that ends inside its start
  // does (detail/await_task.hpp), for the same reasons: the scheduler's
  // round costs a third of a small shared memory call, and the transport's
  // settle_bell, queued, lets peers ring this rank's bell once it has run.
  // But after inline_turns such ends, or linger_ since the last round
  // (`last_end`: when the previous blocking call ended), the context runs
  // what is ready, so that nothing queued waits long.
  template <class Start, class Ready>
  void run(Start& start, bool& started, Ready& ready, clock::time_point last_end,
           clock::time_point deadline) {
    auto& context = io();
    if (!started) {
      started = true;
      as_handler(start);
      if (ready() && ++inline_streak_ < await_task_detail::inline_turns &&
          last_end - last_round_ < linger_)
        return;
    }
    inline_streak_ = 0;
    last_round_ = last_end;
    context.poll();
    while (!ready())
      if (context.run_one_until(deadline) == 0 && (context.stopped() || clock::now() >= deadline))
        return;
  }

  // The handler the io thread parks in, until it may take the context back.
  void park() {
    std::unique_lock lock(mutex_);
    if (!stopping_ && !leave_) {
      parked_ = true;
      idle_since_ = clock::now();
      changed_.notify_all();  // callers waiting for the context
      // Until no caller has run the context for linger_ (or hand_back):
      // while one does, or is about to, a look every linger_ will do.
      while (!stopping_ && (driving_ || (!leave_ && (waiting_.load() > 0 ||
                                                     clock::now() < idle_since_ + linger_))))
        changed_.wait_until(lock,
                            (driving_ || waiting_ > 0 ? clock::now() : idle_since_) + linger_);
      parked_ = false;
    }
    leave_ = false;
    engaged_.store(false, std::memory_order_relaxed);
    if (waiting_.load() > 0) changed_.notify_all();  // now the io thread runs their operations
  }

  // The io_thread goes: its context is stopped, no more parking.
  void stop() {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }

  void shutdown() override {}

  const std::chrono::microseconds linger_;
  asio::detail::scheduler& scheduler_;  // the context's (as_handler)
  std::weak_ptr<void> keep_;            // what holds the context (the io_thread's state)
  std::mutex mutex_;
  std::condition_variable changed_;
  std::atomic<bool> engaged_{false};  // a park asked for, or parked (written under mutex_)
  bool parked_ = false;               // the io thread waits in park(): callers run the context
  bool driving_ = false;              // a caller runs the context
  bool leave_ = false;                // hand_back: the io thread takes the context back
  bool stopping_ = false;
  std::atomic<int> waiting_{0};  // callers waiting in drive() (changed under mutex_)
  // The driving caller's: its operations that ended at once in a row, and
  // when it last ran the context's handlers (see run).
  int inline_streak_ = 0;
  clock::time_point last_round_{};
  clock::time_point idle_since_{};
};

// An io_context with a thread of its own. The owner may be destroyed on
// that very thread (its last reference dropped by a completing operation):
// then the thread is detached, and the context, shared with it, lives
// until run() has returned (and until a caller's drive has).
class io_thread {
 public:
  explicit io_thread(std::chrono::microseconds linger = io_drive::default_linger)
      : state_(std::make_shared<state>()),
        drive_(&asio::make_service<io_drive>(state_->context, linger)) {
    drive_->keep_ = state_;
    thread_ = std::thread([s = state_] { s->context.run(); });
  }
  io_thread(const io_thread&) = delete;
  io_thread& operator=(const io_thread&) = delete;
  ~io_thread() {
    state_->guard.reset();
    state_->context.stop();  // first: a parked thread let go runs nothing more
    drive_->stop();
    if (thread_.get_id() == std::this_thread::get_id())
      thread_.detach();
    else
      thread_.join();
  }
  asio::any_io_executor get_executor() { return state_->context.get_executor(); }
  io_drive& drive() { return *drive_; }

 private:
  struct state {
    asio::io_context context{1};
    asio::executor_work_guard<asio::io_context::executor_type> guard{context.get_executor()};
  };
  std::shared_ptr<state> state_;
  io_drive* drive_;
  std::thread thread_;
};

}  // namespace dcomm::detail
