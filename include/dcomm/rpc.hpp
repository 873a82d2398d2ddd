// Remote procedure calls over a communicator's point-to-point messages
// (torch.distributed.rpc's role, native to coroutines):
//
//   dcomm::rpc::registry functions;
//   functions.add("add", [](int a, int b) { return a + b; });
//   functions.add("scaled", [](std::vector<float> v, float k) ->
//   asio::awaitable<std::vector<float>> {
//     for (auto& x : v) x *= k;
//     co_return v;                       // a handler may co_await, other calls included
//   });
//   auto rpc = co_await dcomm::rpc::start(comm, functions);   // every rank of comm
//   int three = co_await rpc.call<int>(1, "add", 1, 2);
//   std::future<int> f = rpc.call_async<int>(1, "add", 1, 2);
//   int again = rpc.call_sync<int>({1, 5s}, "add", 1, 2);   // blocking, 5 s deadline
//   co_await rpc.shutdown();                                  // every rank: graceful
//
// What happens:
// - start() makes the agent's own group of every rank of the communicator
//   (so its messages never match the program's) and, on each rank, one
//   receive per peer that lasts until shutdown: calls and replies from
//   that peer. Every rank must start with its functions registered: a
//   call never races a registration. No handler runs before start() has
//   returned on its rank (calls that come sooner wait), so a handler may
//   use the agent its caller got from start(), stored before the caller's
//   next co_await.
// - A call sends a header and its bytes (rpc/codec.hpp: the function's
//   name, its argument signature, the arguments) and waits for the reply
//   until its deadline (agent_options::timeout, or the one given with
//   the target). The callee runs the handler on the communicator's
//   executor, as a coroutine of its own: many calls run at once, and a
//   handler may call other ranks, the caller included, without deadlock.
// - Only registered functions run, with arguments that parse as their
//   signature says. The caller gets a dcomm::error: invalid_argument for
//   an unknown name, mismatch for argument or result types that differ,
//   protocol_error for bytes that do not parse, remote_error (with the
//   callee's message) for a handler that threw, timeout past the
//   deadline, peer_lost when the callee's rank is gone. None of them
//   stops the callee.
// - shutdown() is collective and graceful, like torch's rpc.shutdown():
//   it returns once no rank has a call in flight or a handler running
//   (counted across the group, twice in a row the same), then says
//   goodbye to every peer; bounded by agent_options::shutdown_timeout.
//
// Where things are: this header is the surface; rpc/codec.hpp the bytes
// of arguments and results (and how to give a type of yours a codec);
// rpc/impl/agent.hpp the agent's protocol and machinery.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/rpc/codec.hpp"
#include "dcomm/rpc/impl/frame.hpp"

namespace dcomm::rpc {

struct agent_options {
  // A call's deadline when its target names none.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  // How long shutdown() waits for the group to go quiet.
  std::chrono::milliseconds shutdown_timeout = std::chrono::seconds(60);
  // Larger call or reply bytes are refused (the sender's call fails).
  std::size_t max_message_bytes = std::size_t{1} << 30;
};

// Where a call goes: a rank of the communicator, and optionally its own
// deadline: rpc.call<int>({1, 5s}, "add", 1, 2).
struct to {
  to(int rank) : rank(rank) {}  // NOLINT: a rank is a target
  to(int rank, std::chrono::milliseconds timeout) : rank(rank), timeout(timeout) {}
  int rank;
  std::chrono::milliseconds timeout{0};  // 0: agent_options::timeout
};

namespace detail {

template <class T>
struct awaited {
  using type = T;
};
template <class T, class E>
struct awaited<asio::awaitable<T, E>> {
  using type = T;
};

// A callable's arguments and result: plain functions, lambdas and
// function objects with one call operator.
template <class F>
struct callable : callable<decltype(&F::operator())> {};
template <class R, class... A>
struct callable<R (*)(A...)> {
  using result = R;
  using args = std::tuple<std::remove_cvref_t<A>...>;
};
template <class R, class... A>
struct callable<R (*)(A...) noexcept> : callable<R (*)(A...)> {};
template <class C, class R, class... A>
struct callable<R (C::*)(A...)> : callable<R (*)(A...)> {};
template <class C, class R, class... A>
struct callable<R (C::*)(A...) const> : callable<R (*)(A...)> {};
template <class C, class R, class... A>
struct callable<R (C::*)(A...) noexcept> : callable<R (*)(A...)> {};
template <class C, class R, class... A>
struct callable<R (C::*)(A...) const noexcept> : callable<R (*)(A...)> {};

template <class Tuple>
struct tuple_signature;
template <class... Ts>
struct tuple_signature<std::tuple<Ts...>> {
  static std::string get() { return signature<Ts...>(); }
};

// A registered function: its signatures and how to run it on the bytes of
// its arguments (the reply's bytes: the result's name, then the result).
struct function_entry {
  std::string arguments;
  std::string result;
  std::function<asio::awaitable<frame_out>(reader&)> run;
};

}  // namespace detail

template <class Backend>
class agent;
template <class Backend>
struct agent_state;
class registry;

// A value that agent::remote left on its owner (torch's RRef): to_here()
// fetches a copy; the owner frees it once the last copy of the reference
// is gone (a release message, sent without waiting). Copies share one
// reference.
template <class R, class Backend>
class remote_ref {
 public:
  int owner() const { return held_->owner; }
  std::uint64_t id() const { return held_->id; }
  // The value, fetched from its owner (0: agent_options::timeout).
  asio::awaitable<R> to_here(std::chrono::milliseconds timeout = {}) const;

 private:
  friend class agent<Backend>;
  struct holder {  // one per reference, never copied: its end releases the value
    holder(std::weak_ptr<agent_state<Backend>> s, int o, std::uint64_t i)
        : state(std::move(s)), owner(o), id(i) {}
    holder(const holder&) = delete;
    holder& operator=(const holder&) = delete;
    ~holder();
    std::weak_ptr<agent_state<Backend>> state;
    int owner;
    std::uint64_t id;
  };
  std::shared_ptr<holder> held_;
};

// Starts the agent on every rank of comm (collective: each rank must call
// it, with the functions it serves). Serving begins only after it has
// returned: behind the caller's coroutine on its executor (a strand or one
// thread), so that coroutine can store the agent where handlers look for
// it before any handler runs.
template <class Backend>
asio::awaitable<agent<Backend>> start(const communicator<Backend>& comm, registry functions,
                                      agent_options o = {});

// The functions a rank serves, by name.
class registry {
 public:
  // Registers f under `name` (replacing one of that name). f takes values
  // that have a codec and returns one (or void), or an asio::awaitable of
  // one; it runs on the communicator's executor.
  template <class F>
  registry& add(std::string name, F f);

  bool contains(const std::string& name) const { return functions_.count(name) != 0; }

 private:
  template <class Backend>
  friend asio::awaitable<agent<Backend>> start(const communicator<Backend>& comm,
                                               registry functions, agent_options o);
  std::map<std::string, detail::function_entry> functions_;
};

// A rank's RPC agent: calls to the others and service of theirs. Copies
// share one agent.
template <class Backend>
class agent {
 public:
  using communicator_type = communicator<Backend>;

  int rank() const;
  int size() const;

  // Calls `name` on target.rank with `args` and returns its result, of
  // type R (the callee's must be the same; void for none). The arguments
  // are taken at once (moved, or copied from an lvalue): the awaitable
  // owns them. Tensors (a std::vector of a dtype, rpc/codec.hpp) are sent
  // from there, never copied into the call's bytes; a std::span of a
  // dtype is sent from the caller's memory, which must stay valid until
  // the call completes.
  // (g++ 12: a temporary with a destructor inside a co_await expression
  // is destroyed twice; name such arguments, or make the awaitable first:
  // `auto op = rpc.call<R>(...); co_await std::move(op);`.)
  template <class R = void, class... Args>
  asio::awaitable<R> call(to target, std::string_view name, Args&&... args) const {
    return typed_call<R>(state_, group_, target, std::string(name),
                         pack(name, std::forward<Args>(args)...));
  }
  // The same, started at once; the future holds the result.
  template <class R = void, class... Args>
  std::future<R> call_async(to target, std::string_view name, Args&&... args) const {
    return asio::co_spawn(executor(), call<R>(target, name, std::forward<Args>(args)...),
                          asio::use_future);
  }
  // The same, blocking (never on the communicator's own thread).
  template <class R = void, class... Args>
  R call_sync(to target, std::string_view name, Args&&... args) const {
    return dcomm::detail::initiate(executor(), call<R>(target, name, std::forward<Args>(args)...),
                                   blocking, "rpc.call", call_limit(target));
  }

  // Runs `name` on target.rank like call, but the result stays there: a
  // reference to it (torch's rpc.remote), checked to be an R.
  template <class R, class... Args>
  asio::awaitable<remote_ref<R, Backend>> remote(to target, std::string_view name,
                                                 Args&&... args) const;
  // How many values of remote calls this rank holds for others (on the
  // communicator's executor).
  std::size_t values_held() const;
  // What this rank's agent sent so far (on the communicator's executor):
  // bytes of payloads (names, signatures, small values), and of tensors.
  struct traffic_counts {
    std::uint64_t payload_bytes = 0;
    std::uint64_t tensor_bytes = 0;
  };
  traffic_counts traffic() const;

  // Collective and graceful (see above). After it, calls fail with closed.
  template <completion_token_for Token = default_token_t>
  auto shutdown(Token&& token = {}) const {
    return dcomm::detail::initiate(executor(), shutdown_op(state_, group_),
                                   std::forward<Token>(token), "rpc.shutdown", shutdown_limit());
  }

  // The agent's own group (its messages never match the program's).
  const communicator_type& group() const { return *group_; }

 private:
  template <class B>
  friend asio::awaitable<agent<B>> start(const communicator<B>& comm, registry functions,
                                         agent_options o);
  template <class R2, class B2>
  friend class remote_ref;
  agent(std::shared_ptr<agent_state<Backend>> s, std::shared_ptr<communicator_type> g)
      : state_(std::move(s)), group_(std::move(g)) {}

  // A call's frame: the name it travels under, the arguments' signature,
  // the arguments (held by the frame: its tensors point into them).
  template <class... Args>
  static std::shared_ptr<const detail::frame_out> pack(std::string_view wire_name, Args&&... args) {
    auto held = std::make_shared<const std::tuple<wire_type<Args>...>>(std::forward<Args>(args)...);
    return std::make_shared<const detail::frame_out>(detail::make_frame(
        [&](writer& w) {
          w(std::string(wire_name));
          w(signature<wire_type<Args>...>());
          std::apply([&](const auto&... a) { (w(a), ...); }, *held);
        },
        held));
  }
  template <class R>
  static asio::awaitable<R> typed_call(std::shared_ptr<agent_state<Backend>> s,
                                       std::shared_ptr<communicator_type> keep, to target,
                                       std::string name,
                                       std::shared_ptr<const detail::frame_out> call);
  template <class R>
  static asio::awaitable<remote_ref<R, Backend>> make_remote(
      std::shared_ptr<agent_state<Backend>> s, std::shared_ptr<communicator_type> keep, to target,
      std::string name, std::shared_ptr<const detail::frame_out> call);
  asio::any_io_executor executor() const;
  dcomm::detail::clock::duration call_limit(const to& target) const;
  dcomm::detail::clock::duration shutdown_limit() const;
  static asio::awaitable<void> shutdown_op(std::shared_ptr<agent_state<Backend>> s,
                                           std::shared_ptr<communicator_type> g);

  std::shared_ptr<agent_state<Backend>> state_;
  std::shared_ptr<communicator_type> group_;
};

}  // namespace dcomm::rpc

// The protocol, then (from its end) the members: whichever of the three
// headers comes first, each is read after what it needs.
#include "dcomm/rpc/impl/protocol.hpp"
