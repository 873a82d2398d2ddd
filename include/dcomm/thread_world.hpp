// A thread world: N ranks as threads of this process, each with an
// io_context of its own and a communicator over one in-memory hash_store
// (Gloo's test base, as a feature), for testing code that uses dcomm without
// launching processes. The backend is real: with cpu_backend the ranks talk
// through shared memory (over loopback sockets with DCOMM_TRANSPORT=tcp).
//
//   dcomm::run_thread_world<dcomm::cpu_backend>(
//       4, [](dcomm::communicator<dcomm::cpu_backend>& comm) -> asio::awaitable<void> {
//         std::vector<int> x{comm.rank()};
//         co_await comm.all_reduce(x, dcomm::sum);
//       });
//
// run_thread_world returns once every rank is done, or throws
// errc::rank_failed naming the first rank that failed, with that rank's
// exception nested (std::rethrow_if_nested). thread_world_failures returns
// every rank's failure instead, for tests where some ranks are meant to fail.
// The world has a deadline: a rank still running then has its communicator
// aborted (its pending and later operations fail with errc::aborted), and,
// if it still has not finished a few seconds later, its io_context stopped;
// it fails with errc::timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/store/hash_store.hpp"

namespace dcomm {

template <backend Backend>
struct thread_world_options {
  // Every operation's default timeout, and init_process_group's.
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  // The whole world's, from the call: a rank still running then fails.
  std::chrono::milliseconds deadline = std::chrono::minutes(2);
  // Every rank's backend options; where backend_of is set, rank r gets
  // backend_of(r) instead. An empty bind_host (tcp) becomes 127.0.0.1.
  typename Backend::options backend{};
  std::function<typename Backend::options(int rank)> backend_of{};
};

namespace detail {

// How long a rank whose communicator was aborted at the deadline has to
// unwind before its io_context is stopped.
inline constexpr std::chrono::seconds thread_world_grace{5};

struct thread_world_outcome {
  std::vector<std::exception_ptr> failures;  // per rank; null: it succeeded
  std::vector<std::size_t> order;            // per rank: when it failed, 0 first
};

// Clears the pointer to a rank's communicator when its body ends.
template <class Comm>
struct running_scope {
  Comm*& slot;
  running_scope(Comm*& s, Comm& c) : slot(s) { slot = &c; }
  running_scope(const running_scope&) = delete;
  running_scope& operator=(const running_scope&) = delete;
  ~running_scope() { slot = nullptr; }
};

// One rank, on its own thread: its io_context, its store handle, its
// communicator, its body, and the world's deadline on its own timer (the
// context runs one thread, so the timer and the body never run at once).
// A failure takes its place in `tickets` while the rank's communicator is
// still open: before the peers can see it go, and fail because of it.
template <backend Backend, class Body>
std::exception_ptr run_thread_rank(int rank, int world_size, const Body& body,
                                   const thread_world_options<Backend>& o,
                                   const std::shared_ptr<hash_store::table>& table,
                                   clock::time_point deadline, std::atomic<std::size_t>& tickets,
                                   std::size_t& ticket) {
  asio::io_context context{1};  // run by this thread alone: the backend needs no strand
  communicator<Backend>* running = nullptr;
  bool expired = false;
  std::optional<std::size_t> taken;
  std::exception_ptr failure;
  {
    asio::steady_timer timer(context, deadline);
    timer.async_wait([&](asio::error_code ec) {
      if (ec) return;
      expired = true;
      if (running) running->abort();
      timer.expires_at(deadline + thread_world_grace);
      timer.async_wait([&](asio::error_code again) {
        if (!again) context.stop();
      });
    });
    try {
      auto store = hash_store::create(context.get_executor(), table);
      sync_wait(context, [&]() -> asio::awaitable<void> {
        init_options<Backend> io{.timeout = o.timeout, .job_token = ""};
        io.backend = o.backend_of ? o.backend_of(rank) : o.backend;
        if constexpr (requires { io.backend.bind_host; })
          if (io.backend.bind_host.empty()) io.backend.bind_host = "127.0.0.1";
        auto comm = co_await init_process_group<Backend>(context.get_executor(), store, rank,
                                                         world_size, io);
        running_scope<communicator<Backend>> scope(running, comm);
        try {
          co_await body(comm);
        } catch (...) {
          taken = tickets.fetch_add(1);
          throw;
        }
      }());
    } catch (...) {
      failure = std::current_exception();
      if (!taken) taken = tickets.fetch_add(1);
    }
    timer.cancel();
  }
  if (taken) ticket = *taken;
  if (!expired) return failure;
  if (!taken) ticket = tickets.fetch_add(1);
  return std::make_exception_ptr(error(
      errc::timeout,
      {.operation = "run_thread_world",
       .rank = rank,
       .detail = "still running at the thread world's deadline (" +
                 std::to_string(o.deadline.count()) +
                 " ms after it began), so its communicator was aborted" +
                 (failure ? "; it then failed with: " + message_of(failure) : std::string())}));
}

template <backend Backend, class Body>
thread_world_outcome run_thread_world_ranks(int world_size, const Body& body,
                                            const thread_world_options<Backend>& o) {
  static_assert(std::is_invocable_r_v<asio::awaitable<void>, const Body&, communicator<Backend>&>,
                "dcomm: a thread world's body is a coroutine "
                "asio::awaitable<void>(dcomm::communicator<Backend>&), called on every rank");
  if (world_size <= 0)
    throw_error(errc::invalid_argument, {.operation = "run_thread_world",
                                         .expected = "at least one rank",
                                         .seen = std::to_string(world_size) + " ranks"});
  const auto deadline = clock::now() + o.deadline;
  auto table = std::make_shared<hash_store::table>();
  const auto n = static_cast<std::size_t>(world_size);
  thread_world_outcome out{std::vector<std::exception_ptr>(n), std::vector<std::size_t>(n)};
  std::atomic<std::size_t> tickets{0};
  {
    std::vector<std::jthread> threads;  // joined on the way out, also if one fails to start
    threads.reserve(n);
    for (int r = 0; r < world_size; ++r)
      threads.emplace_back([&, r] {
        auto i = static_cast<std::size_t>(r);
        out.failures[i] = run_thread_rank<Backend>(r, world_size, body, o, table, deadline, tickets,
                                                   out.order[i]);
      });
  }
  return out;
}

}  // namespace detail

// Runs body(comm) on `world_size` ranks, each a thread with a
// communicator<Backend> of its own, and returns what each rank failed with
// (null where it succeeded; failures in start-up included). The body is
// called on every thread at once: it must not change shared state unlocked.
template <backend Backend, class Body>
std::vector<std::exception_ptr> thread_world_failures(int world_size, const Body& body,
                                                      thread_world_options<Backend> o = {}) {
  return detail::run_thread_world_ranks<Backend>(world_size, body, o).failures;
}

// The same, requiring every rank to succeed: throws errc::rank_failed
// naming the first rank to fail (the others' failures are often its
// consequences: errc::peer_lost), with its exception nested.
template <backend Backend, class Body>
void run_thread_world(int world_size, const Body& body, thread_world_options<Backend> o = {}) {
  auto out = detail::run_thread_world_ranks<Backend>(world_size, body, o);
  std::size_t first = out.failures.size();
  std::vector<int> others;
  for (std::size_t r = 0; r < out.failures.size(); ++r) {
    if (!out.failures[r]) continue;
    others.push_back(static_cast<int>(r));
    if (first == out.failures.size() || out.order[r] < out.order[first]) first = r;
  }
  if (first == out.failures.size()) return;
  std::erase(others, static_cast<int>(first));
  std::string what = "its error: " + detail::message_of(out.failures[first]);
  if (!others.empty())
    what += "; " + std::string(others.size() == 1 ? "rank " : "ranks ") +
            detail::format_ranks(others) + " failed after it";
  try {
    std::rethrow_exception(out.failures[first]);
  } catch (...) {
    std::throw_with_nested(error(errc::rank_failed, {.operation = "run_thread_world",
                                                     .rank = static_cast<int>(first),
                                                     .detail = std::move(what)}));
  }
}

}  // namespace dcomm
