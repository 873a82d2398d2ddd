// Rendezvous: every rank of a job finds the others through a store named by
// an init_method URL (env://, tcp://host:port, file:///path), as
// torch.distributed.init_process_group does.
//
// On the store, under "dcomm/rdzv/":
//   rank/<r>/joins   add 1: more than 1 means two processes claim rank r
//   world_size       compare_set: every rank must agree with the first
//   rank/<r>/present set once rank r has joined; everyone waits for all
//   rank/<r>/departed  set by depart(); rank 0 waits for all before leaving
//   misconfigured    set by a rank that found the job misconfigured (world
//                    sizes differ, a rank claimed twice), which also sets
//                    every absent rank/<r>/present: the others wake and fail
//                    at once with its reason instead of at the deadline
// While waiting, the ranks still missing are reported every
// progress_interval; at the deadline the error names them.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/init_method.hpp"
#include "dcomm/option_string.hpp"
#include "dcomm/store/c10d_store.hpp"
#include "dcomm/store/file_store.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/store/tcp_store.hpp"

namespace dcomm {

// Called with each line that says how a waiting rendezvous is getting on.
using progress_callback = std::function<void(std::string_view line)>;

// rendezvous's arguments. Every member is trivially destructible (text in
// option_string, callbacks by pointer), so that the options can be a braced
// temporary in a co_await on g++ 12 (option_string.hpp says why); what a
// pointer names must outlive the call.
struct rendezvous_options {
  option_string init_method = "env://";
  std::optional<int> rank{};
  std::optional<int> world_size{};
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  std::chrono::milliseconds progress_interval = std::chrono::seconds(10);
  // Called with each progress line; null: logged as a warning to stderr.
  const progress_callback* on_progress = nullptr;
  option_string job_token = detail::job_token_from_environment();
  // Where rank 0's store server listens; empty: every interface.
  option_string bind_host = "";
  // The environment to read instead of the process's (tests inject one).
  // Null: the process's.
  const env_lookup* env = nullptr;
};

struct rendezvous_result {
  std::shared_ptr<dcomm::store> store{};
  int rank = -1;
  int world_size = -1;
  std::optional<int> local_rank{};
  std::optional<int> local_world_size{};
  init_spec spec{};
};

namespace detail {

// Whether torch's agent serves the job's store (torchrun without
// --standalone, the TorchElastic agent, Kubeflow's PyTorchJob): it says so
// with TORCHELASTIC_USE_AGENT_STORE=True and listens on MASTER_ADDR:
// MASTER_PORT. Its workers use it under "/worker/attempt_<restart>/", as
// torch's env:// rendezvous does; dcomm joins it the same way.
inline bool agent_serves_store(const env_lookup& env) {
  const auto agent = env ? env("TORCHELASTIC_USE_AGENT_STORE") : std::nullopt;
  return agent && (*agent == "True" || *agent == "true" || *agent == "1");
}
inline std::string agent_store_prefix(const env_lookup& env) {
  const auto restart = env("TORCHELASTIC_RESTART_COUNT");
  return "/worker/attempt_" + restart.value_or("0") + "/";
}

// Whether a process of its own serves the job's store at MASTER_ADDR:
// MASTER_PORT (dcomm-store, docs/elastic.md): DCOMM_STORE_SERVED=1. Rank 0
// then connects to it as every rank does, and may die like any other.
inline bool store_served(const env_lookup& env) {
  const auto served = env ? env("DCOMM_STORE_SERVED") : std::nullopt;
  return served && (*served == "1" || *served == "true" || *served == "True");
}

// What to do when rank 0's port is taken.
inline std::string port_taken_hint(const init_spec& spec) {
  if (spec.kind != init_kind::env) return "choose another port in " + spec.address();
  return "choose another MASTER_PORT" +
         (spec.address_from.empty() || spec.address_from.starts_with("MASTER_ADDR and MASTER_PORT")
              ? std::string()
              : " (this one came from " + spec.address_from + ")");
}

// Whether `fd` is a socket bound to `port`: a launcher's rendezvous socket
// (DCOMM_MASTER_LISTEN_FD) is rank 0's to adopt only then. A job may name a
// port of its own (tcp://host:port, MASTER_PORT) under dcomm-run or spawn,
// which pass down the socket they bound whatever the init method.
inline bool bound_to_port(int fd, std::uint16_t port) {
  sockaddr_storage storage{};
  socklen_t length = sizeof storage;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0) return false;
  if (storage.ss_family == AF_INET)
    return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port) == port;
  if (storage.ss_family == AF_INET6)
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port) == port;
  return false;
}

inline std::string rdzv_key(int rank, std::string_view what) {
  return "dcomm/rdzv/rank/" + std::to_string(rank) + "/" + std::string(what);
}

inline std::string whoami() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + " pid " + std::to_string(::getpid());
}

inline constexpr const char* misconfigured_key = "dcomm/rdzv/misconfigured";

// This rank found the job misconfigured: it tells the others (see the top
// of this file) before it fails. Best effort: where the store fails too,
// the others still have their deadline.
DCOMM_EMIT_ON_USE asio::awaitable<void> tell_misconfigured(std::shared_ptr<store> s, int rank,
                                                           int world, std::string reason) {
  try {
    co_await s->compare_set(misconfigured_key, "", "rank " + std::to_string(rank) + ": " + reason);
    // Beyond that many (a typo such as WORLD_SIZE=100000), the others find
    // the reason at the end of their current wait slice instead.
    for (int r = 0; r < std::min(world, 1024); ++r)
      co_await s->compare_set(rdzv_key(r, "present"), "", "!");
  } catch (const std::exception&) {
  }
}

// Which of `ranks` have not set their rank/<r>/<what> key yet.
DCOMM_EMIT_ON_USE asio::awaitable<std::vector<int>> ranks_without(std::shared_ptr<store> s,
                                                                  std::vector<int> ranks,
                                                                  std::string what) {
  std::vector<int> without;
  for (int r : ranks) {
    std::vector<std::string> one(1, rdzv_key(r, what));
    if (!co_await s->check(one)) without.push_back(r);
  }
  co_return without;
}

// The exception a failed start-up leaves with: a dcomm::error (see
// rethrow_as_dcomm_error).
inline std::exception_ptr as_dcomm_error(std::exception_ptr failure, error_context ctx) {
  try {
    rethrow_as_dcomm_error(failure, std::move(ctx));
  } catch (...) {
    return std::current_exception();
  }
}

// Start-up failed in the process that hosts the job's tcp store: before the
// store goes, its clients are told why, so that they blame the cause (the
// ranks this failure names) and not the store's host.
DCOMM_EMIT_ON_USE asio::awaitable<void> leave_store(std::shared_ptr<store> s,
                                                    std::exception_ptr failure) {
  auto* tcp = dynamic_cast<tcp_store*>(s.get());
  if (!tcp || !tcp->server()) co_return;
  std::optional<dcomm::error> why;
  try {
    std::rethrow_exception(failure);
  } catch (const dcomm::error& e) {
    why.emplace(e);
  } catch (...) {
  }
  if (why) co_await tcp->leave(*why);
}

// This rank's claim on its place: what it finds wrong ("" if nothing: a
// rank claimed twice, a world size other ranks disagree with), and the
// size the ranks that agreed wait for. The public operations, not the
// *_impl coroutines: those must run on the store's own executor (a strand
// for tcp_store), and this may not.
DCOMM_EMIT_ON_USE asio::awaitable<std::pair<std::string, int>> claim_place(std::shared_ptr<store> s,
                                                                           int rank,
                                                                           int world_size) {
  std::string wrong;
  int others = world_size;
  auto joins = co_await s->add(rdzv_key(rank, "joins"), 1);
  if (joins > 1) {
    wrong = "rank " + std::to_string(rank) +
            " is claimed by more than one process (a rank given twice, or a stale store left by "
            "an earlier job at this address)";
  } else {
    auto agreed = co_await s->compare_set("dcomm/rdzv/world_size", "", std::to_string(world_size));
    if (agreed != std::to_string(world_size)) {
      wrong = "ranks disagree on the world size: rank " + std::to_string(rank) + " says " +
              std::to_string(world_size) + ", an earlier rank said " + agreed;
      try {
        others = std::stoi(agreed);
      } catch (const std::exception&) {
      }
    }
  }
  co_return std::pair{std::move(wrong), others};
}

// The protocol, on any store (thread worlds pass a shared hash_store).
DCOMM_EMIT_ON_USE asio::awaitable<void> join_world(std::shared_ptr<store> s, int rank,
                                                   int world_size, std::string address,
                                                   const rendezvous_options& options) {
  const auto start = detail::clock::now();
  const auto deadline = start + options.timeout;
  auto fail = [&](errc code, std::string detail, std::string peers = {}) {
    throw_error(code, {.operation = "rendezvous",
                       .rank = rank,
                       .peers = std::move(peers),
                       .address = address,
                       .detail = std::move(detail)});
  };

  // What this rank finds wrong, the others are told before it fails.
  auto [wrong, others] = co_await claim_place(s, rank, world_size);
  if (!wrong.empty()) {
    co_await tell_misconfigured(s, rank, others, wrong);
    fail(errc::mismatch, wrong);
  }
  co_await s->set(rdzv_key(rank, "present"), whoami());

  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) missing.push_back(r);
  const std::vector<std::string> told(1, misconfigured_key);  // by a rank (the top of this file)
  auto last_line = start;
  for (;;) {
    std::vector<std::string> keys;
    for (int r : missing) keys.push_back(rdzv_key(r, "present"));
    auto slice = std::min(time_left(deadline), options.progress_interval);
    try {
      co_await s->wait(keys, slice);
      break;
    } catch (const dcomm::error& e) {
      if (e.code() != errc::timeout) throw;
    }
    if (co_await s->check(told)) break;  // its reason: below
    missing = co_await ranks_without(s, missing, "present");
    if (missing.empty()) break;
    using std::chrono::duration_cast;
    using std::chrono::seconds;
    if (detail::clock::now() >= deadline)
      fail(errc::timeout,
           "ranks still missing after " +
               std::to_string(duration_cast<seconds>(options.timeout).count()) +
               " s; every rank must start with the same init_method and world size " +
               std::to_string(world_size),
           "ranks " + format_ranks(missing));
    // One line per interval: the slices shrink to nothing before the
    // deadline, and each would otherwise say the same again.
    if (detail::clock::now() - last_line < options.progress_interval * 9 / 10) continue;
    last_line = detail::clock::now();
    auto line = "rank " + std::to_string(rank) + " waiting for ranks " + format_ranks(missing) +
                " at " + address + ", " +
                std::to_string(duration_cast<seconds>(detail::clock::now() - start).count()) +
                " s of " + std::to_string(duration_cast<seconds>(options.timeout).count()) + " s";
    if (options.on_progress && *options.on_progress)
      (*options.on_progress)(line);
    else
      log(log_level::warning, line);
  }
  // Woken by a rank that found the job misconfigured: its reason, now.
  if (co_await s->check(told)) {
    const std::string why = co_await s->get(told.front(), time_left(deadline));
    fail(errc::mismatch, "the job is misconfigured, as " + why, why.substr(0, why.find(':')));
  }
  // A duplicate that joined after us is only visible now.
  if (std::stoll(co_await s->get(rdzv_key(rank, "joins"), time_left(deadline))) > 1) {
    wrong = "rank " + std::to_string(rank) + " is claimed by more than one process";
    co_await tell_misconfigured(s, rank, world_size, wrong);
    fail(errc::mismatch, wrong);
  }
}

// Every rank but 0 says it is done with the store; rank 0, which serves a
// tcp store, waits until all have said so, so nobody loses the store while
// still using it.
DCOMM_EMIT_ON_USE asio::awaitable<void> depart_op(std::shared_ptr<store> s, int rank,
                                                  int world_size,
                                                  detail::clock::time_point deadline) {
  if (rank != 0) {
    co_await s->set(rdzv_key(rank, "departed"), "1");
    co_return;
  }
  std::vector<std::string> keys;
  for (int r = 1; r < world_size; ++r) keys.push_back(rdzv_key(r, "departed"));
  try {
    co_await s->wait(keys, time_left(deadline));
    co_return;
  } catch (const dcomm::error& e) {
    if (e.code() != errc::timeout) throw;
  }
  // Timed out: name who is still there (no co_await inside a handler).
  std::vector<int> others;
  for (int r = 1; r < world_size; ++r) others.push_back(r);
  auto missing = co_await ranks_without(s, others, "departed");
  throw_error(errc::timeout, {.operation = "depart",
                              .rank = rank,
                              .peers = "ranks " + format_ranks(missing),
                              .address = s->address(),
                              .detail = "these ranks had not left when the deadline passed"});
}

DCOMM_EMIT_ON_USE asio::awaitable<rendezvous_result> rendezvous_op(asio::any_io_executor executor,
                                                                   rendezvous_options options) {
  const env_lookup env = options.env ? *options.env : process_environment();
  // Bad input fails here, before any socket or file is touched.
  init_spec spec =
      parse_init_method(options.init_method.str(), options.rank, options.world_size, env);
  rendezvous_result result{.rank = spec.rank,
                           .world_size = spec.world_size,
                           .local_rank = spec.local_rank,
                           .local_world_size = spec.local_world_size,
                           .spec = spec};
  if (spec.kind == init_kind::file) {
    result.store = file_store::create(executor, spec.path, spec.world_size, options.timeout);
  } else if (spec.kind == init_kind::env && agent_serves_store(env)) {
    result.store = c10d_store::create(executor, {.host = spec.host,
                                                 .port = spec.port,
                                                 .prefix = agent_store_prefix(env),
                                                 .timeout = options.timeout,
                                                 .rank = spec.rank,
                                                 .server_name = "torchrun's agent store"});
  } else {
    const bool served = store_served(env);
    bool host_server = spec.rank == 0 && !served;
    int listen_fd = -1;
    // A launcher that bound the port for rank 0 passes the socket down.
    if (auto fd = env("DCOMM_MASTER_LISTEN_FD"); fd && host_server) {
      try {
        listen_fd = std::stoi(*fd);
      } catch (const std::exception&) {
        throw_error(errc::invalid_argument, {.operation = "rendezvous",
                                             .key = "DCOMM_MASTER_LISTEN_FD",
                                             .seen = "'" + *fd + "'",
                                             .detail = "must be a file descriptor number"});
      }
      // Adopted only where it is bound to the port rank 0 is asked to
      // listen on. Another one is left open, not closed: for a later
      // rendezvous of this process the number may name another file.
      if (!bound_to_port(listen_fd, spec.port)) {
        log(log_level::info, "rendezvous: DCOMM_MASTER_LISTEN_FD=" + *fd +
                                 " is not a socket bound to port " + std::to_string(spec.port) +
                                 " (" + spec.address() + "): rank 0 listens there itself");
        listen_fd = -1;
      }
    }
    try {
      result.store = tcp_store::create(executor, {.host = spec.host,
                                                  .port = spec.port,
                                                  .is_server = host_server,
                                                  .bind_host = options.bind_host.str(),
                                                  .listen_fd = listen_fd,
                                                  .timeout = options.timeout,
                                                  .job_token = options.job_token.str(),
                                                  .rank = spec.rank,
                                                  .server_rank = served ? -1 : 0});
    } catch (const dcomm::error& e) {
      if (e.code() != errc::address_in_use) throw;
      auto ctx = e.context();
      ctx.operation = "rendezvous";
      ctx.rank = spec.rank;
      ctx.detail = "rank 0 cannot listen on port " + std::to_string(spec.port) +
                   ": another process holds it; " + detail::port_taken_hint(spec);
      throw error(e.code(), ctx);
    }
  }
  // The store's own errors are dcomm::errors; a raw socket error from a
  // path nobody foresaw leaves as one too, naming this rank and the store.
  std::exception_ptr failure;
  try {
    co_await join_world(result.store, spec.rank, spec.world_size, spec.address(), options);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    failure = as_dcomm_error(
        failure, {.operation = "rendezvous", .rank = spec.rank, .address = spec.address()});
    co_await leave_store(result.store, failure);
    std::rethrow_exception(failure);
  }
  co_return result;
}

}  // namespace detail

// Joins the job described by options.init_method; the store it returns is
// served by rank 0 (tcp), by torch's agent (env:// under torchrun: see
// agent_serves_store) or lives in a file (file://). Its operations run on
// `executor`.
template <completion_token_for<rendezvous_result> Token = default_token_t>
auto rendezvous(asio::any_io_executor executor, rendezvous_options options, Token&& token = {}) {
  auto limit = options.timeout + detail::blocking_grace;
  return detail::initiate(executor, detail::rendezvous_op(executor, std::move(options)),
                          std::forward<Token>(token), "rendezvous", limit);
}

// Blocking rendezvous on a store with an io thread of its own, for code
// outside coroutines: auto world = dcomm::rendezvous({.init_method = "env://"});
DCOMM_DECL rendezvous_result rendezvous(rendezvous_options options);
#if !defined(DCOMM_SEPARATE_COMPILATION) || defined(DCOMM_SOURCE)
DCOMM_DECL rendezvous_result rendezvous(rendezvous_options options) {
  auto thread = std::make_shared<detail::io_thread>();
  auto result = rendezvous(thread->get_executor(), std::move(options), blocking);
  // The store keeps the thread that runs it.
  result.store =
      std::shared_ptr<store>(result.store.get(), [keep = result.store, thread](store*) mutable {
        keep.reset();
        thread.reset();
      });
  return result;
}
#endif

// Leaves the job: rank 0 completes once every other rank has departed (at
// most the store's timeout); the others complete at once. Call it last.
template <completion_token_for Token = default_token_t>
auto depart(const rendezvous_result& world, Token&& token = {}) {
  auto timeout = world.store->timeout();
  return detail::initiate(
      world.store->get_executor(),
      detail::depart_op(world.store, world.rank, world.world_size, detail::clock::now() + timeout),
      std::forward<Token>(token), "depart", timeout + detail::blocking_grace);
}

// The same protocol on a store the caller already has (thread worlds).
template <completion_token_for Token = default_token_t>
auto rendezvous(std::shared_ptr<store> s, int rank, int world_size, rendezvous_options options = {},
                Token&& token = {}) {
  if (world_size <= 0 || rank < 0 || rank >= world_size)
    throw_error(errc::invalid_argument, {.operation = "rendezvous",
                                         .expected = "0 <= rank < world_size",
                                         .seen = "rank " + std::to_string(rank) + ", world size " +
                                                 std::to_string(world_size)});
  auto executor = s->get_executor();
  auto address = s->address();
  auto limit = options.timeout + detail::blocking_grace;
  return detail::initiate(
      executor,
      [](std::shared_ptr<store> s, int rank, int world, std::string address,
         rendezvous_options options) -> asio::awaitable<void> {
        std::exception_ptr failure;
        try {
          co_await detail::join_world(std::move(s), rank, world, address, options);
        } catch (...) {
          failure = std::current_exception();
        }
        if (failure)
          detail::rethrow_as_dcomm_error(
              failure, {.operation = "rendezvous", .rank = rank, .address = address});
      }(std::move(s), rank, world_size, std::move(address), std::move(options)),
      std::forward<Token>(token), "rendezvous", limit);
}

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::detail::tell_misconfigured<void>(std::shared_ptr<store> s, int rank, int world, std::string reason) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::ranks_without<void>(std::shared_ptr<store> s, std::vector<int> ranks, std::string what) -> asio::awaitable<std::vector<int>>)
DCOMM_INSTANTIATE(auto dcomm::detail::leave_store<void>(std::shared_ptr<store> s, std::exception_ptr failure) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::claim_place<void>(std::shared_ptr<store> s, int rank, int world_size) -> asio::awaitable<std::pair<std::string, int>>)
DCOMM_INSTANTIATE(auto dcomm::detail::join_world<void>(std::shared_ptr<store> s, int rank, int world_size, std::string address, const rendezvous_options& options) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::depart_op<void>(std::shared_ptr<store> s, int rank, int world_size, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::rendezvous_op<void>(asio::any_io_executor executor, rendezvous_options options) -> asio::awaitable<rendezvous_result>)
// clang-format on
// End of the separate-compilation block.
