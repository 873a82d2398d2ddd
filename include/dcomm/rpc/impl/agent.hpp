// The RPC agent's members, start and shutdown, registry::add, and remote
// references (dcomm/rpc.hpp); the protocol under them is in
// rpc/impl/protocol.hpp.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcomm/rpc.hpp"
#include "dcomm/rpc/impl/protocol.hpp"

namespace dcomm::rpc {

template <class F>
registry& registry::add(std::string name, F f) {
  using traits = detail::callable<F>;
  using arguments = typename traits::args;
  using returned = typename traits::result;
  using result = typename detail::awaited<returned>::type;
  static_assert(!codec_detail::is_span<std::remove_cvref_t<result>>::value,
                "dcomm::rpc: a handler returns a std::vector, not a std::span (what a span "
                "shows may change or go before the reply is sent)");
  detail::function_entry e;
  e.arguments = detail::tuple_signature<arguments>::get();
  e.result = result_name<result>();
  e.run = [f = std::move(f),
           result_sig = e.result](reader& r) mutable -> asio::awaitable<detail::frame_out> {
    arguments args;
    r(args);
    if (r.left()) throw payload_error(std::to_string(r.left()) + " bytes follow the arguments");
    if (r.tensors_left())
      throw payload_error(std::to_string(r.tensors_left()) + " tensors follow the arguments");
    if constexpr (std::is_void_v<result>) {
      if constexpr (std::is_same_v<returned, result>)
        std::apply(f, std::move(args));
      else
        co_await std::apply(f, std::move(args));
      co_return detail::make_frame([&](writer& w) { w(result_sig); });
    } else {
      // The result lives in the reply: its tensors are sent from it.
      std::shared_ptr<const result> value;
      if constexpr (std::is_same_v<returned, result>)
        value = std::make_shared<const result>(std::apply(f, std::move(args)));
      else
        value = std::make_shared<const result>(co_await std::apply(f, std::move(args)));
      co_return detail::make_frame(
          [&](writer& w) {
            w(result_sig);
            w(*value);
          },
          value);
    }
  };
  functions_[std::move(name)] = std::move(e);
  return *this;
}

template <class Backend>
int agent<Backend>::rank() const {
  return state_->me;
}
template <class Backend>
int agent<Backend>::size() const {
  return state_->n;
}
template <class Backend>
typename agent<Backend>::traffic_counts agent<Backend>::traffic() const {
  return {state_->payload_bytes, state_->tensor_bytes};
}
template <class Backend>
asio::any_io_executor agent<Backend>::executor() const {
  return state_->ex;
}
template <class Backend>
dcomm::detail::clock::duration agent<Backend>::call_limit(const to& target) const {
  return (target.timeout.count() > 0 ? target.timeout : state_->o.timeout) +
         dcomm::detail::blocking_grace;
}
template <class Backend>
dcomm::detail::clock::duration agent<Backend>::shutdown_limit() const {
  return state_->o.shutdown_timeout + dcomm::detail::blocking_grace;
}

// `keep`: the group lives while a call of it is in flight.
template <class Backend>
template <class R>
asio::awaitable<R> agent<Backend>::typed_call(std::shared_ptr<agent_state<Backend>> s,
                                              std::shared_ptr<communicator_type> keep, to target,
                                              std::string name,
                                              std::shared_ptr<const detail::frame_out> call) {
  const std::string what = s->call_name(name);
  const auto timeout = target.timeout.count() > 0 ? target.timeout : s->o.timeout;
  detail::frame_in reply = co_await dcomm::detail::spawn(
      s->ex, detail::raw_call<Backend>(s, target.rank, timeout, name, std::move(call)),
      asio::use_awaitable);
  keep.reset();
  std::string fault;
  try {
    reader r(reply.body, &reply.tensors);
    const auto returned = r.read<std::string>();
    if (returned != result_name<R>())
      throw_error(errc::mismatch, {.operation = what,
                                   .rank = s->me,
                                   .peers = "rank " + std::to_string(target.rank),
                                   .detail = "'" + name + "' returns " + returned +
                                             "; the call expects " + result_name<R>()});
    if constexpr (std::is_void_v<R>) {
      if (r.left() == 0 && r.tensors_left() == 0) co_return;
    } else {
      R value = r.read<R>();
      if (r.left() == 0 && r.tensors_left() == 0) co_return value;
    }
    fault = std::to_string(r.left()) + " bytes and " + std::to_string(r.tensors_left()) +
            " tensors follow the result";
  } catch (const payload_error& e) {
    fault = e.what();
  }
  throw_error(errc::protocol_error, {.operation = what,
                                     .rank = s->me,
                                     .peers = "rank " + std::to_string(target.rank),
                                     .detail = "the reply does not parse: " + fault});
}

template <class Backend>
std::size_t agent<Backend>::values_held() const {
  return state_->values.size();
}

template <class Backend>
template <class R, class... Args>
asio::awaitable<remote_ref<R, Backend>> agent<Backend>::remote(to target, std::string_view name,
                                                               Args&&... args) const {
  return make_remote<R>(
      state_, group_, target, std::string(name),
      pack(std::string(wire::remote_prefix) + std::string(name), std::forward<Args>(args)...));
}

template <class Backend>
template <class R>
asio::awaitable<remote_ref<R, Backend>> agent<Backend>::make_remote(
    std::shared_ptr<agent_state<Backend>> s, std::shared_ptr<communicator_type> keep, to target,
    std::string name, std::shared_ptr<const detail::frame_out> call) {
  auto [id, returns] = co_await typed_call<std::tuple<std::uint64_t, std::string>>(
      s, std::move(keep), target, std::string(wire::remote_prefix) + name, std::move(call));
  remote_ref<R, Backend> ref;  // released on the owner if the type is wrong
  ref.held_ = std::make_shared<typename remote_ref<R, Backend>::holder>(s, target.rank, id);
  if (returns != result_name<R>())
    throw_error(errc::mismatch, {.operation = "rpc.remote '" + name + "'",
                                 .rank = s->me,
                                 .peers = "rank " + std::to_string(target.rank),
                                 .detail = "'" + name + "' returns " + returns +
                                           "; the reference is to " + result_name<R>()});
  co_return ref;
}

template <class R, class Backend>
asio::awaitable<R> remote_ref<R, Backend>::to_here(std::chrono::milliseconds timeout) const {
  auto held = held_;  // the value lives on its owner while it is fetched
  auto s = held->state.lock();
  if (!s)
    throw_error(errc::closed,
                {.operation = "rpc.remote_ref.to_here", .detail = "the agent is gone"});
  co_return co_await agent<Backend>::template typed_call<R>(
      s, s->group.lock(), to{held->owner, timeout}, wire::fetch,
      agent<Backend>::pack(wire::fetch, held->id));
}

template <class R, class Backend>
remote_ref<R, Backend>::holder::~holder() {
  auto s = state.lock();
  if (!s) return;
  // Not awaited: a release that fails (the owner or the agent is gone)
  // has nothing left to free.
  asio::co_spawn(s->ex,
                 detail::raw_call<Backend>(s, owner, s->o.timeout, wire::release,
                                           agent<Backend>::pack(wire::release, id)),
                 asio::detached);
}

template <class Backend>
asio::awaitable<void> agent<Backend>::shutdown_op(std::shared_ptr<agent_state<Backend>> s,
                                                  std::shared_ptr<communicator_type> g) {
  const auto deadline = dcomm::detail::clock::now() + s->o.shutdown_timeout;
  auto left = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 dcomm::detail::clock::now());
  };
  asio::steady_timer wake(s->ex);
  s->shutdown_wake = &wake;
  struct unhook {
    agent_state<Backend>* s;
    ~unhook() { s->shutdown_wake = nullptr; }
  } unhook_on_exit{s.get()};
  auto idle = [&] { return s->calls.empty() && s->handlers == 0; };
  // Quiet: every call sent has arrived, and nobody is busy, the same
  // twice in a row (a call in flight keeps its caller busy).
  std::vector<std::int64_t> before{-1, -1, -1};
  for (;;) {
    while (!idle()) {
      if (left().count() <= 0)
        throw_error(errc::timeout,
                    {.operation = "rpc.shutdown",
                     .rank = s->me,
                     .detail = std::to_string(s->calls.size()) + " calls of this rank and " +
                               std::to_string(s->handlers) + " handlers still running"});
      wake.expires_after(std::min(left(), std::chrono::milliseconds(10)));
      asio::error_code ec;
      co_await wake.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    std::vector<std::int64_t> counts{static_cast<std::int64_t>(s->issued),
                                     static_cast<std::int64_t>(s->received), idle() ? 0 : 1};
    co_await g->all_reduce(counts, dcomm::sum,
                           op_options{.timeout = std::max(left(), std::chrono::milliseconds(1))});
    if (counts[0] == counts[1] && counts[2] == 0 && counts == before) break;
    if (counts == before) {  // a call still on its way: give it time to land
      wake.expires_after(std::min(left(), std::chrono::milliseconds(1)));
      asio::error_code ec;
      co_await wake.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    before = counts;
  }
  s->closed = true;
  // A goodbye to every peer, even one whose goodbye came first (it waits
  // for ours) or whose stream to us broke (its reading of ours did not);
  // one that cannot be sent goes to a peer that is gone.
  for (int p = 0; p < s->n; ++p) {
    if (p == s->me) continue;
    try {
      co_await detail::send_frame<Backend>(s, p, wire::kind::bye, 0, nullptr,
                                           std::max(left(), std::chrono::milliseconds(1)));
    } catch (const std::exception&) {
    }
  }
  for (;;) {
    std::string waiting;
    for (int p = 0; p < s->n; ++p)
      if (p != s->me && !s->said_bye[static_cast<std::size_t>(p)] &&
          !s->gone[static_cast<std::size_t>(p)])
        waiting += (waiting.empty() ? "" : ",") + std::to_string(p);
    if (waiting.empty()) break;
    if (left().count() <= 0)
      throw_error(errc::timeout, {.operation = "rpc.shutdown",
                                  .rank = s->me,
                                  .peers = "ranks {" + waiting + "}",
                                  .detail = "no goodbye from them"});
    wake.expires_after(left());
    asio::error_code ec;
    co_await wake.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
}

template <class Backend>
asio::awaitable<agent<Backend>> start(const communicator<Backend>& comm, registry functions,
                                      agent_options o) {
  std::vector<int> everyone(static_cast<std::size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) everyone[static_cast<std::size_t>(r)] = r;
  auto group = std::make_shared<communicator<Backend>>(*comm.new_group(everyone));
  auto s = std::make_shared<agent_state<Backend>>();
  s->group = group;
  s->functions = std::move(functions.functions_);
  s->o = o;
  s->ex = group->get_executor();
  s->me = group->rank();
  s->n = group->size();
  s->gone.resize(static_cast<std::size_t>(s->n));
  s->said_bye.resize(static_cast<std::size_t>(s->n));
  for (int p = 0; p < s->n; ++p)
    if (p != s->me) asio::co_spawn(s->ex, detail::serve<Backend>(s, p), asio::detached);
  // Every rank listens before any call: calls never meet a rank that
  // has not started (a barrier of the agent's group).
  co_await group->barrier();
  // A call that came in meanwhile (a peer passed the barrier first) waits,
  // and so does every call until this job runs: the caller's coroutine
  // goes on from the co_return without a pause, and the job is posted
  // behind it on its executor (a strand or one thread), so the caller holds
  // the agent, and has stored it, before any handler can run.
  auto caller = co_await asio::this_coro::executor;
  asio::post(caller, [s] { asio::dispatch(s->ex, [s] { detail::begin_serving(s); }); });
  co_return agent<Backend>(std::move(s), std::move(group));
}

}  // namespace dcomm::rpc
