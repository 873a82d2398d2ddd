// grow and join: growing a job in place (docs/elastic.md): a new process joins through the
// job's store and is admitted at the members' next grow(), with a rank after
// theirs (NCCL's ncclCommGrow, torchft's and PCCL's joiners).
//
//   // a member, at a step boundary (every member of comm calls it):
//   comm = co_await dcomm::grow(comm, options);   // comm itself if nobody waits
//   // a new process, through the job's store (env://: MASTER_ADDR, MASTER_PORT):
//   auto comm = dcomm::join<dcomm::cpu_backend>(options);   // blocking; or (ex, store, options)
//
// What happens: a joiner takes a ticket (the store's counter
// "dcomm/elastic/tickets") and waits for its call. At grow(), the members'
// rank 0 numbers a new generation and calls every ticket taken since the
// last admission; the joiners answer, and those that answer within
// joiner_answer_window (one that died waiting never does) are admitted:
// rank 0 writes each its rank (the members keep theirs, 0 to n-1; joiners
// follow in ticket order), the others "expired" (a joiner alive but late
// takes a new ticket), and broadcasts the generation and the new size to
// the members. Then members and joiners
// meet as a new world through the store under "dcomm/elastic/<generation>/"
// (the rendezvous and the backend's connections, as init_process_group's),
// and grow() returns its communicator; the old one stays open until its
// last handle goes. Several joiners are admitted at one grow().
//
// The store must outlive the ranks that may die: a server of its own
// (dcomm-store, whose members set DCOMM_STORE_SERVED=1 for env://, or
// tcp_store_server in a process of the program's), not rank 0's. A grow() that
// fails (a member or a joiner lost while the new world meets) fails on
// every member: they keep the old communicator (shrink it if a member died)
// and may grow again; joiners of that generation time out of join() and
// join again. The store's keys, counters and admissions stay in the store.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"
#include "dcomm/init_method.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/rendezvous.hpp"
#include "dcomm/store/prefix_store.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/store/tcp_store.hpp"

namespace dcomm {
namespace detail {

inline constexpr const char* elastic_tickets_key = "dcomm/elastic/tickets";
inline constexpr const char* elastic_admitted_key = "dcomm/elastic/admitted";
inline constexpr const char* elastic_generation_key = "dcomm/elastic/generation";
inline constexpr const char* elastic_closed_key = "dcomm/elastic/closed";
// The call and the admission of a ticket taken before close_joins().
inline constexpr const char* closed_admission = "closed";
// The admission of a ticket whose joiner did not answer its call in time:
// it takes another ticket (one gone takes nothing).
inline constexpr const char* expired_admission = "expired";
// How long the admitting rank waits for the called joiners' answers: a
// live joiner waits on its call and answers at once; a dead one never.
inline constexpr std::chrono::milliseconds joiner_answer_window{1000};

// Rank 0 calls each waiting ticket (the key holds the generation), the
// joiner answers, then reads its admission.
inline std::string call_key(std::int64_t ticket) {
  return "dcomm/elastic/call/" + std::to_string(ticket);
}
inline std::string answer_key(std::int64_t generation, std::int64_t ticket) {
  return "dcomm/elastic/answer/" + std::to_string(generation) + "/" + std::to_string(ticket);
}
inline std::string admission_key(std::int64_t ticket) {
  return "dcomm/elastic/admit/" + std::to_string(ticket);
}

// The store a generation's world meets through.
inline std::shared_ptr<store> generation_store(std::shared_ptr<store> job, std::int64_t g) {
  return prefix_store::create("dcomm/elastic/" + std::to_string(g), std::move(job));
}

// What a joiner is told: "generation rank world".
struct admission {
  std::int64_t generation = 0;
  int rank = 0;
  int world = 0;
};

inline std::string encode(const admission& a) {
  return std::to_string(a.generation) + " " + std::to_string(a.rank) + " " +
         std::to_string(a.world);
}

inline admission decode_admission(const std::string& text, const std::string& key) {
  long long g = 0;
  int rank = 0, world = 0;
  if (std::sscanf(text.c_str(), "%lld %d %d", &g, &rank, &world) != 3 || g < 1 || rank < 0 ||
      world <= rank)
    throw_error(errc::protocol_error, {.operation = "join",
                                       .key = key,
                                       .seen = "'" + text + "'",
                                       .detail = "an admission reads 'generation rank world'"});
  return {.generation = g, .rank = rank, .world = world};
}

// The communicator's runtime, for grow (communicator.hpp befriends it).
template <backend Backend>
struct elastic_access {
  static const std::shared_ptr<comm_runtime<Backend>>& runtime(const communicator<Backend>& c) {
    return c.rt_;
  }
};

// The executor under a backend's strand: the new world gets a strand of
// its own on it (or it itself, an io_context's made for one thread).
inline asio::any_io_executor underlying_executor(const asio::any_io_executor& ex) {
  if (auto* s = executor_target<asio::strand<asio::any_io_executor>>(ex))
    return s->get_inner_executor();
  if (auto* s = executor_target<asio::strand<asio::io_context::executor_type>>(ex))
    return s->get_inner_executor();
  return ex;
}

// On the members' rank 0: calls the tickets taken since the last
// admission and admits those whose joiners answer within
// joiner_answer_window (a joiner that died waiting costs the members that
// window once, not a meeting's timeout). Returns {generation, new size};
// {0, n} when nobody (alive) waits.
inline asio::awaitable<std::vector<std::int64_t>> admit_joiners(std::shared_ptr<store> s, int n,
                                                                clock::duration timeout) {
  // Named, not braced in the co_await: g++ 12 mishandles such temporaries.
  const std::vector<std::string> closed{elastic_closed_key};
  if (co_await s->check(closed)) co_return std::vector<std::int64_t>{0, n};
  const std::int64_t taken = co_await s->add(elastic_tickets_key, 0);
  const std::int64_t admitted = co_await s->add(elastic_admitted_key, 0);
  if (taken <= admitted) co_return std::vector<std::int64_t>{0, n};
  const std::int64_t g = co_await s->add(elastic_generation_key, 1);
  for (std::int64_t t = admitted + 1; t <= taken; ++t)
    co_await s->set(call_key(t), std::to_string(g));
  const auto deadline = clock::now() + std::min<clock::duration>(joiner_answer_window, timeout);
  std::vector<bool> answered;
  for (std::int64_t t = admitted + 1; t <= taken; ++t) {
    try {
      co_await s->get(answer_key(g, t), time_left(deadline));
      answered.push_back(true);
    } catch (const dcomm::error& e) {
      if (e.code() != errc::timeout) throw;
      answered.push_back(false);
    }
  }
  const int world = n + static_cast<int>(std::count(answered.begin(), answered.end(), true));
  int next = n;
  for (std::int64_t t = admitted + 1; t <= taken; ++t) {
    // Named, not a conditional's temporary in the co_await (g++ 12).
    std::string admission = expired_admission;
    if (answered[static_cast<std::size_t>(t - admitted - 1)])
      admission = encode({.generation = g, .rank = next++, .world = world});
    co_await s->set(admission_key(t), std::move(admission));
  }
  co_await s->add(elastic_admitted_key, taken - admitted);
  co_return std::vector<std::int64_t>{world > n ? g : 0, world};
}

// The new world of generation g, as init_process_group over a store makes
// one; its runtime remembers the job's store, for the next grow.
template <backend Backend>
asio::awaitable<communicator<Backend>> meet_generation(std::shared_ptr<store> job, std::int64_t g,
                                                       int rank, int world, init_options<Backend> o,
                                                       std::shared_ptr<io_thread> thread) {
  auto comm = co_await init_from_store<Backend>(generation_store(job, g), rank, world, std::move(o),
                                                std::move(thread));
  elastic_access<Backend>::runtime(comm)->job_store = std::move(job);
  co_return comm;
}

template <backend Backend>
asio::awaitable<communicator<Backend>> grow_op(communicator<Backend> comm,
                                               init_options<Backend> o) {
  const auto& rt = elastic_access<Backend>::runtime(comm);
  std::shared_ptr<store> job = rt->job_store ? rt->job_store : rt->rendezvous_store;
  std::vector<std::int64_t> decision{0, comm.size()};
  if (comm.rank() == 0) decision = co_await admit_joiners(job, comm.size(), o.timeout);
  // Named, not braced in the co_await: g++ 12 destroys such temporaries twice.
  op_options bo{.timeout = o.timeout};
  co_await comm.broadcast(decision, 0, bo, use_awaitable_of<Backend>);
  if (decision[0] == 0) co_return comm;
  co_return co_await meet_generation<Backend>(std::move(job), decision[0], comm.rank(),
                                              static_cast<int>(decision[1]), std::move(o),
                                              rt->thread);
}

template <backend Backend>
asio::awaitable<communicator<Backend>> join_op(std::shared_ptr<store> job, init_options<Backend> o,
                                               std::shared_ptr<io_thread> thread) {
  error_context where{.operation = "join", .address = job->address()};
  std::exception_ptr failure;
  try {
    const auto deadline = clock::now() + o.timeout;
    for (;;) {  // a ticket whose call came too late for its answer expires: another
      const std::int64_t ticket = co_await job->add(elastic_tickets_key, 1);
      std::string key = call_key(ticket);
      auto closed = [&] {
        throw_error(errc::closed, {.operation = "join",
                                   .key = key,
                                   .address = job->address(),
                                   .detail = "the job closed its joins (dcomm::close_joins): no "
                                             "member admits this process"});
      };
      // After the ticket: a close_joins() that read the tickets before this
      // one was taken set the key before it read them.
      const std::vector<std::string> closed_keys{elastic_closed_key};
      if (co_await job->check(closed_keys)) closed();
      std::string text;
      try {
        text = co_await job->get(key, time_left(deadline));
      } catch (const dcomm::error& e) {
        if (e.code() != errc::timeout) throw;
        throw_error(errc::timeout, {.operation = "join",
                                    .key = key,
                                    .address = job->address(),
                                    .detail = "no member's grow() admitted this joiner (ticket " +
                                              std::to_string(ticket) + ") by the deadline"});
      }
      if (text == closed_admission) closed();
      co_await job->set(answer_key(std::atoll(text.c_str()), ticket), "1");
      key = admission_key(ticket);
      text = co_await job->get(key, time_left(deadline));
      if (text == closed_admission) closed();
      if (text == expired_admission) continue;
      const admission a = decode_admission(text, key);
      co_return co_await meet_generation<Backend>(std::move(job), a.generation, a.rank, a.world,
                                                  std::move(o), std::move(thread));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  std::rethrow_exception(as_dcomm_error(failure, std::move(where)));
}

// Marks the job closed, then calls every ticket not yet admitted with the
// mark: each waiting joiner learns it at once, and a later one from the mark.
inline asio::awaitable<void> close_joins_op(std::shared_ptr<store> job) {
  co_await job->set(elastic_closed_key, "1");
  const std::int64_t taken = co_await job->add(elastic_tickets_key, 0);
  const std::int64_t admitted = co_await job->add(elastic_admitted_key, 0);
  for (std::int64_t t = admitted + 1; t <= taken; ++t) {
    co_await job->set(call_key(t), closed_admission);
    co_await job->set(admission_key(t), closed_admission);
  }
}

// A client of the job's store named by an init_method, env:// or tcp://
// (a server of its own: DCOMM_STORE_SERVED): a joiner has no rank yet and
// hosts nothing.
template <class Backend>
std::shared_ptr<store> joiners_store(asio::any_io_executor ex, const init_options<Backend>& o) {
  const env_lookup env = o.env ? *o.env : process_environment();
  const init_spec spec = parse_init_method(o.init_method.str(), 0, 1, env);
  if (spec.kind == init_kind::file)
    throw_error(errc::invalid_argument,
                {.operation = "join",
                 .expected = "env:// or tcp://host:port",
                 .seen = spec.url,
                 .detail = "a joiner reaches the job's store over TCP (a file store has no "
                           "server to outlive the ranks)"});
  return tcp_store::create(
      std::move(ex),
      {.host = spec.host, .port = spec.port, .timeout = o.timeout, .job_token = o.job_token.str()});
}

}  // namespace detail

// Admits the processes waiting in join() (every member of comm calls it,
// as a collective): the communicator of the members and the joiners, the
// members ranked as in comm, the joiners after them in the order they
// came; comm itself when nobody waits. `o` makes the new world as
// init_process_group's options do (its init_method and rank are not read):
// its timeout bounds the admission and the meeting. The backend needs a
// store: comm's world met through one (init_process_group over a store,
// or an init_method).
template <backend Backend, completion_token_for<communicator<Backend>> Token = default_token_t>
auto grow(const communicator<Backend>& comm, init_options<Backend> o, Token&& token = {}) {
  const auto& rt = detail::elastic_access<Backend>::runtime(comm);
  if (!rt || !(rt->job_store || rt->rendezvous_store))
    throw_error(errc::invalid_argument,
                {.operation = "grow",
                 .detail = "the communicator met through no store (joiners come through one)"});
  asio::any_io_executor ex = detail::serial_executor(
      rt->thread ? rt->thread->get_executor() : detail::underlying_executor(comm.get_executor()));
  if (rt->thread) rt->thread->drive().hand_back();
  const auto limit = o.timeout * 3 + detail::blocking_grace;
  return detail::initiate(ex, detail::grow_op<Backend>(comm, std::move(o)),
                          std::forward<Token>(token), "grow", limit);
}

// Closes the job to joiners, for good: the processes waiting in join(), and
// those that come later, fail with errc::closed, and grow() admits nobody.
// Not collective: one member calls it (the members' rank 0, once its last
// grow() has returned), when the job is done, so that replacements still
// waiting end instead of waiting out their timeout.
template <backend Backend, completion_token_for Token = default_token_t>
auto close_joins(const communicator<Backend>& comm, Token&& token = {}) {
  const auto& rt = detail::elastic_access<Backend>::runtime(comm);
  if (!rt || !(rt->job_store || rt->rendezvous_store))
    throw_error(errc::invalid_argument,
                {.operation = "close_joins",
                 .detail = "the communicator met through no store (joiners come through one)"});
  std::shared_ptr<store> job = rt->job_store ? rt->job_store : rt->rendezvous_store;
  asio::any_io_executor ex = detail::serial_executor(
      rt->thread ? rt->thread->get_executor() : detail::underlying_executor(comm.get_executor()));
  if (rt->thread) rt->thread->drive().hand_back();
  const auto limit = job->timeout() + detail::blocking_grace;
  return detail::initiate(ex, detail::close_joins_op(std::move(job)), std::forward<Token>(token),
                          "close_joins", limit);
}

// Joins a running job through its store: waits (up to o.timeout) until a
// member's grow() admits this process, then meets the members; returns the
// new world's communicator, this process ranked after the members. The
// backend runs on a strand of `executor`, as init_process_group's. Some
// thread must run `executor` and the store's (dcomm::blocking waits for
// them, as every blocking call on a caller's executor does).
template <backend Backend, completion_token_for<communicator<Backend>> Token = default_token_t>
auto join(asio::any_io_executor executor, std::shared_ptr<store> job, init_options<Backend> o,
          Token&& token = {}) {
  if (!job) throw_error(errc::invalid_argument, {.operation = "join", .detail = "no store"});
  asio::any_io_executor strand = detail::serial_executor(executor);
  const auto limit = o.timeout * 3 + detail::blocking_grace;
  return detail::initiate(strand, detail::join_op<Backend>(std::move(job), std::move(o), nullptr),
                          std::forward<Token>(token), "join", limit);
}

// The same through o.init_method's store: env:// (MASTER_ADDR and
// MASTER_PORT) or tcp://host:port, served by a process of its own
// (dcomm-store; DCOMM_STORE_SERVED=1 for the members' env://).
template <backend Backend, completion_token_for<communicator<Backend>> Token = default_token_t>
auto join(asio::any_io_executor executor, init_options<Backend> o, Token&& token = {}) {
  auto job = detail::joiners_store(executor, o);
  return join<Backend>(std::move(executor), std::move(job), std::move(o),
                       std::forward<Token>(token));
}

// The blocking form for plain code: the backend and the store's client get
// an io thread of their own. A process with a RANK (a launcher's restart of
// a rank's slot) whose rank has not yet been claimed in the job's first
// rendezvous (the job is still starting: the slot's first process died
// before it got there) takes that place instead, as init_process_group.
template <backend Backend>
communicator<Backend> join(init_options<Backend> o) {
  auto thread = std::make_shared<detail::io_thread>();
  auto job = detail::joiners_store(thread->get_executor(), o);
  const env_lookup env = o.env ? *o.env : process_environment();
  if (const auto rank = env("RANK");
      rank && o.init_method.str().starts_with("env://") &&
      job->add(detail::rdzv_key(std::atoi(rank->c_str()), "joins"), 0, blocking) == 0) {
    job.reset();
    thread.reset();
    return init_process_group<Backend>(std::move(o));
  }
  const auto limit = o.timeout * 3 + detail::blocking_grace;
  return detail::initiate(thread->get_executor(),
                          detail::join_op<Backend>(std::move(job), std::move(o), thread), blocking,
                          "join", limit);
}

}  // namespace dcomm
