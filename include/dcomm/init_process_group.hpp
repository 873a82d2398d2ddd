// init_process_group: joins a job (an init_method, or a store the caller
// already has), connects every rank, and returns the world communicator.
// On its own so that a user of communicator.hpp (gradient_bucketer.hpp, a
// library taking a communicator) does not compile the stores, the
// init_method parser and the rendezvous.
//
//   auto comm = dcomm::init_process_group<dcomm::cpu_backend>(
//       {.init_method = "env://", .timeout = 30s});
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/default_group.hpp"
#include "dcomm/error.hpp"
#include "dcomm/init_method.hpp"
#include "dcomm/option_string.hpp"
#include "dcomm/rendezvous.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/store/tcp_store.hpp"
#include "dcomm/trace/error_file.hpp"

namespace dcomm {

// init_process_group's arguments, torch's names where they exist. Every
// member is trivially destructible (text in option_string, the
// environment by pointer), so that the options can be a braced temporary
// in a co_await on g++ 12 (option_string.hpp says why).
template <class Backend>
struct init_options {
  option_string init_method = "env://";
  std::optional<int> rank{};
  std::optional<int> world_size{};
  // Rendezvous and the default deadline of every operation.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  option_string job_token = detail::job_token_from_environment();
  // Where rank 0's store server listens; empty: every interface.
  option_string store_bind_host = "";
  typename Backend::options backend{};
  // Makes the world group the process's default (default_group.hpp:
  // get_rank(), default_group<Backend>(), destroy_process_group()).
  bool set_default = false;
  // The environment to read instead of the process's (tests inject one);
  // it must outlive the call. Null: the process's.
  const env_lookup* env = nullptr;
};

namespace detail {

// Closes a backend that start-up made but will not hand over, and waits
// (a second at most) for it to say goodbye on its links.
template <backend Backend>
asio::awaitable<void> close_unused(std::shared_ptr<Backend> backend) {
  auto done = std::make_shared<bool>(false);
  auto timer = std::make_shared<asio::steady_timer>(co_await asio::this_coro::executor,
                                                    std::chrono::seconds(1));
  backend->close([done, timer] {
    *done = true;
    timer->cancel();
  });
  asio::error_code ignored;
  if (!*done) co_await timer->async_wait(asio::redirect_error(asio::use_awaitable, ignored));
}

// Rank 0 waits until every rank has its connections (rank 0 serves the tcp
// store: nobody may lose it halfway through). A rank whose link closes
// meanwhile died in start-up: that fails it at once, naming the rank.
template <backend Backend>
asio::awaitable<void> wait_connected(store& s, Backend& backend, int rank, int world,
                                     detail::clock::time_point deadline) {
  std::vector<std::string> keys;
  for (int r = 1; r < world; ++r) keys.push_back("dcomm/pg/connected/" + std::to_string(r));
  for (;;) {
    bool waiting = false;
    try {
      if (!keys.empty())
        co_await s.wait(keys, std::min<std::chrono::milliseconds>(time_left(deadline),
                                                                  std::chrono::milliseconds(100)));
    } catch (const dcomm::error& e) {
      if (e.code() != errc::timeout) throw;
      waiting = true;
    }
    if (!waiting) co_return;
    std::vector<int> lost;
    if constexpr (requires { backend.lost_peers(); }) lost = backend.lost_peers();
    if (!lost.empty())
      throw_error(errc::peer_lost,
                  {.operation = "init_process_group",
                   .rank = rank,
                   .peers = (lost.size() == 1 ? "rank " + std::to_string(lost.front())
                                              : "ranks " + format_ranks(lost)),
                   .address = s.address(),
                   .detail = "connected, then lost during start-up (died?)"});
    if (detail::clock::now() < deadline) continue;
    std::vector<int> missing;
    for (int r = 1; r < world; ++r) {
      // Named, not braced in the co_await: g++ 12 destroys such temporaries twice.
      std::vector<std::string> one(1, keys[static_cast<std::size_t>(r - 1)]);
      if (!co_await s.check(one)) missing.push_back(r);
    }
    throw_error(errc::timeout, {.operation = "init_process_group",
                                .rank = rank,
                                .peers = "ranks " + format_ranks(missing),
                                .address = s.address(),
                                .detail = "these ranks did not finish start-up by the deadline "
                                          "(did they die, or stop?)"});
  }
}

// DCOMM_LOG_LEVEL=info's start-up line: who this rank is, how it joined,
// and what its backend says of itself (as NCCL_DEBUG=INFO users expect).
template <backend Backend>
void log_start_up(const Backend& b, const std::string& joined, const init_options<Backend>& o) {
  if (!log_enabled(log_level::info)) return;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string line = "rank " + std::to_string(b.rank()) + " of " + std::to_string(b.world_size()) +
                     " (pid " + std::to_string(::getpid()) + ", host " + host + "): " + joined +
                     "; timeout " + std::to_string(o.timeout.count()) + " ms; job token " +
                     (o.job_token.empty() ? "none" : "set") + "; backend " +
                     std::string(Backend::name);
  if constexpr (requires { b.describe(); }) line += ": " + b.describe();
  log(log_level::info, line);
}

template <backend Backend>
asio::awaitable<communicator<Backend>> connect_world(std::shared_ptr<store> s, int rank, int world,
                                                     std::string store_host,
                                                     init_options<Backend> o,
                                                     std::shared_ptr<io_thread> thread,
                                                     std::string joined = "") {
  const auto deadline = detail::clock::now() + o.timeout;
  auto timeline =
      trace::timeline::from_environment(rank);  // DCOMM_TRACE (refused before we connect)
  auto backend =
      co_await Backend::create(s, rank, world, o.job_token.str(), store_host, o.backend, deadline);
  std::exception_ptr failure;
  try {
    if (rank != 0)
      co_await s->set("dcomm/pg/connected/" + std::to_string(rank), "1");
    else
      co_await wait_connected(*s, *backend, rank, world, deadline);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    if constexpr (requires { backend->leave_start_up(failure); }) backend->leave_start_up(failure);
    co_await close_unused(backend);
    std::rethrow_exception(failure);
  }
  log_start_up(*backend, joined.empty() ? "joined over a store (" + s->address() + ")" : joined, o);
  auto rt = std::make_shared<detail::comm_runtime<Backend>>();
  rt->backend = std::move(backend);
  rt->thread = std::move(thread);
  rt->rendezvous_store = std::move(s);
  rt->timeline = std::move(timeline);
  dump_on_signal(*rt);
  auto world_group = communicator<Backend>::make_world(std::move(rt), o.timeout);
  if (o.set_default) set_default_group(world_group);
  co_return world_group;
}

// With DCOMM_TRACE_DIR set, SIGUSR1 writes this process's flight recorder
// there (trace/signal_dump.hpp).
template <backend Backend>
void dump_on_signal(comm_runtime<Backend>& rt) {
  const int rank = rt.backend->rank(), world = rt.backend->world_size();
  if (trace::failure_dump_path(rank).empty()) return;
  rt.on_signal =
      trace::signal_dump::start(rt.backend->get_executor(), [recorder = rt.recorder, rank, world] {
        try {
          recorder->dump_to_trace_dir(rank, world, "SIGUSR1", false);
        } catch (const std::exception&) {
          // Nobody to tell: the next signal tries again.
        }
      });
}

// A failed start-up in TORCHELASTIC_ERROR_FILE (trace/error_file.hpp).
inline void note_init_failure(const std::exception_ptr& failure) noexcept {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    trace::note_first_failure(e.what());
  } catch (...) {
  }
}

// asio::use_awaitable, named through the backend: a call that takes it is
// then resolved where init_* is instantiated, not where it is defined (a
// user's translation unit of the separate-compilation mode instantiates
// neither for cpu_backend: the library does).
template <class Backend>
inline constexpr const asio::use_awaitable_t<>& use_awaitable_of = asio::use_awaitable;

// Both entry points end in rethrow_as_dcomm_error: every failure is fixed
// at its source to be a dcomm::error with context, and a raw
// std::system_error that still gets this far (a socket error on a path
// nobody foresaw) leaves as a dcomm::error naming the rank and the address,
// its original message kept.
template <backend Backend>
asio::awaitable<communicator<Backend>> init_from_method(init_options<Backend> o,
                                                        std::shared_ptr<io_thread> thread) {
  trace::write_error_file_on_terminate();  // TORCHELASTIC_ERROR_FILE
  auto ex = co_await asio::this_coro::executor;
  error_context where{
      .operation = "init_process_group", .rank = o.rank, .address = o.init_method.str()};
  std::exception_ptr failure;
  std::shared_ptr<store> joined;
  try {
    rendezvous_options ro{.init_method = o.init_method,
                          .rank = o.rank,
                          .world_size = o.world_size,
                          .timeout = o.timeout,
                          .job_token = o.job_token,
                          .bind_host = o.store_bind_host,
                          .env = o.env};
    auto world = co_await rendezvous(ex, std::move(ro), use_awaitable_of<Backend>);
    where.rank = world.rank;
    where.address = world.spec.address();
    joined = world.store;
    std::string how = "init " + o.init_method.str();
    if (!world.spec.launcher.empty()) how += ", rank from " + world.spec.launcher;
    if (world.local_rank && world.local_world_size)
      how += ", local rank " + std::to_string(*world.local_rank) + " of " +
             std::to_string(*world.local_world_size);
    how += ", rank 0's store at " + world.spec.address();
    if (!world.spec.address_from.empty()) how += " (from " + world.spec.address_from + ")";
    co_return co_await connect_world<Backend>(world.store, world.rank, world.world_size,
                                              world.spec.host, std::move(o), std::move(thread),
                                              std::move(how));
  } catch (...) {
    failure = std::current_exception();
  }
  failure = as_dcomm_error(failure, std::move(where));
  note_init_failure(failure);
  // Rank 0 hosts the store: the others learn why it leaves (leave_store).
  if (joined) co_await leave_store(joined, failure);
  std::rethrow_exception(failure);
}

template <backend Backend>
asio::awaitable<communicator<Backend>> init_from_store(std::shared_ptr<store> s, int rank,
                                                       int world, init_options<Backend> o,
                                                       std::shared_ptr<io_thread> thread) {
  trace::write_error_file_on_terminate();  // TORCHELASTIC_ERROR_FILE
  error_context where{.operation = "init_process_group", .rank = rank, .address = s->address()};
  std::exception_ptr failure;
  try {
    rendezvous_options ro{.timeout = o.timeout, .job_token = o.job_token};
    co_await rendezvous(s, rank, world, std::move(ro), use_awaitable_of<Backend>);
    co_return co_await connect_world<Backend>(std::move(s), rank, world, "", std::move(o),
                                              std::move(thread));
  } catch (...) {
    failure = std::current_exception();
  }
  failure = as_dcomm_error(failure, std::move(where));
  note_init_failure(failure);
  std::rethrow_exception(failure);
}

// A backend whose launcher made the job (mpirun, srun: the MPI backend)
// joins without a store: Backend::create_world(executor, options) knows
// its rank and world. o.rank and o.world_size, where set, must agree.
template <class Backend>
concept joins_without_store = requires {
  Backend::joins_without_store;
};

// A backend whose process-wide set-up must run on the thread that starts
// it (MPI_Init_thread: that thread is MPI's main thread) has
// Backend::prepare_process(), which the blocking init_process_group calls
// on the caller's thread before its io thread takes over.
template <class Backend>
concept prepares_process = requires {
  Backend::prepare_process();
};

template <backend Backend>
asio::awaitable<communicator<Backend>> join_without_store(init_options<Backend> o,
                                                          std::shared_ptr<io_thread> thread) {
  trace::write_error_file_on_terminate();  // TORCHELASTIC_ERROR_FILE
  auto ex = co_await asio::this_coro::executor;
  std::exception_ptr failure;
  try {
    auto backend = Backend::create_world(ex, o.backend);
    const int rank = backend->rank(), world = backend->world_size();
    if ((o.rank && *o.rank != rank) || (o.world_size && *o.world_size != world))
      throw_error(errc::mismatch,
                  {.operation = "init_process_group",
                   .rank = rank,
                   .expected = "rank " + std::to_string(o.rank.value_or(rank)) + " of " +
                               std::to_string(o.world_size.value_or(world)) + " (init_options)",
                   .seen = "rank " + std::to_string(rank) + " of " + std::to_string(world) +
                           " (the " + std::string(Backend::name) + " launcher's)"});
    log_start_up(*backend, "joined through " + std::string(Backend::name) + "'s launcher", o);
    auto rt = std::make_shared<detail::comm_runtime<Backend>>();
    rt->backend = std::move(backend);
    rt->thread = std::move(thread);
    rt->timeline = trace::timeline::from_environment(rank);
    dump_on_signal(*rt);
    auto world_group = communicator<Backend>::make_world(std::move(rt), o.timeout);
    if (o.set_default) set_default_group(world_group);
    co_return world_group;
  } catch (...) {
    failure = std::current_exception();
  }
  failure = as_dcomm_error(failure, {.operation = "init_process_group", .rank = o.rank});
  note_init_failure(failure);
  std::rethrow_exception(failure);
}

// Start-up as the backend joins: through o.init_method's store, or its
// launcher's own way.
template <backend Backend>
asio::awaitable<communicator<Backend>> init_world(init_options<Backend> o,
                                                  std::shared_ptr<io_thread> thread) {
  if constexpr (joins_without_store<Backend>)
    return join_without_store<Backend>(std::move(o), std::move(thread));
  else
    return init_from_method<Backend>(std::move(o), std::move(thread));
}

}  // namespace detail

// Joins the job named by o.init_method and connects to every rank (a
// backend that joins through its launcher, mpi_backend, ignores
// init_method). The backend runs on a strand of `executor`, or on
// `executor` itself where it is an io_context's made for one thread
// (`asio::io_context ctx{1}`: concurrency hint 1, the promise that one
// thread runs it, which makes small calls faster).
template <backend Backend, completion_token_for<communicator<Backend>> Token = default_token_t>
auto init_process_group(asio::any_io_executor executor, init_options<Backend> o,
                        Token&& token = {}) {
  asio::any_io_executor strand = detail::serial_executor(executor);
  auto limit = o.timeout * 2 + detail::blocking_grace;
  return detail::initiate(strand, detail::init_world<Backend>(std::move(o), nullptr),
                          std::forward<Token>(token), "init_process_group", limit);
}

// The blocking form for plain code: the backend gets an io thread of its own.
template <backend Backend>
communicator<Backend> init_process_group(init_options<Backend> o) {
  if constexpr (detail::prepares_process<Backend>) Backend::prepare_process();
  auto thread = std::make_shared<detail::io_thread>();
  auto limit = o.timeout * 2 + detail::blocking_grace;
  return detail::initiate(thread->get_executor(), detail::init_world<Backend>(std::move(o), thread),
                          blocking, "init_process_group", limit);
}

// Over a store the caller already has (torch's init_process_group(store=)):
// thread worlds share a hash_store this way. Runs the rendezvous protocol.
template <backend Backend, completion_token_for<communicator<Backend>> Token = default_token_t>
auto init_process_group(asio::any_io_executor executor, std::shared_ptr<store> s, int rank,
                        int world_size, init_options<Backend> o, Token&& token = {}) {
  if (world_size <= 0 || rank < 0 || rank >= world_size)
    throw_error(errc::invalid_argument, {.operation = "init_process_group",
                                         .expected = "0 <= rank < world_size",
                                         .seen = "rank " + std::to_string(rank) + ", world size " +
                                                 std::to_string(world_size)});
  asio::any_io_executor strand = detail::serial_executor(executor);
  auto limit = o.timeout * 2 + detail::blocking_grace;
  return detail::initiate(
      strand,
      detail::init_from_store<Backend>(std::move(s), rank, world_size, std::move(o), nullptr),
      std::forward<Token>(token), "init_process_group", limit);
}

}  // namespace dcomm
