// The RPC agent's protocol: its wire, its state, and the coroutines that
// listen, handle and call (dcomm/rpc.hpp; the agent's members are in
// rpc/impl/agent.hpp).
//
// Wire: on the agent's own group, every message between two ranks uses one
// tag, so they arrive in the order they were sent. A frame starts with a
// head of 256 bytes: a 24-byte header {magic, kind, id, bytes}, then the
// payload (rpc/impl/frame.hpp) when its `bytes` fit (a small call is one
// message each way); a larger payload is a message of its own after the
// head. Then one message per tensor the payload's table lists. All are
// started before any is awaited, on the backend's strand, so no other
// frame can come between.
//   call     name, argument signature, arguments     (id: the caller's)
//   reply    result name, result
//   failure  errc, the callee's message
//   bye      none: the last frame of a shutdown; the receiver stops
//            listening to that peer
// A rank listens to each peer with one receive at a time that lasts until
// shutdown (or until the communicator closes or the peer is lost). Calls
// that come before start() has returned wait until it has (begin_serving).
//
// Lifetime: the user's agent handles own the group's communicator; the
// listening loops and handlers hold only the state, and the group weakly,
// so a rank that drops its agent and communicator without shutdown closes
// its links (its peers see peer_lost) instead of listening for ever.
// Everything here runs on the group's executor (the backend's strand).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dcomm/detail/log.hpp"
#include "dcomm/rpc.hpp"
#include "dcomm/rpc/impl/frame.hpp"

namespace dcomm::rpc {

namespace wire {
inline constexpr std::uint32_t magic = 0x43505244;  // "DRPC"
inline constexpr int tag = 0x5250;
enum class kind : std::uint32_t { call = 1, reply, failure, bye };
// The names of the remote references' calls (never a registered name).
inline constexpr std::string_view remote_prefix = "dcomm.remote/";
inline const std::string fetch = "dcomm.fetch", release = "dcomm.release";
struct header {
  std::uint32_t magic = wire::magic;
  kind type = kind::call;
  std::uint64_t id = 0;
  std::uint64_t bytes = 0;
};
static_assert(sizeof(header) == 24);
inline constexpr std::size_t head_bytes = 256;
inline constexpr std::size_t inline_bytes = head_bytes - sizeof(header);
using head = std::array<std::uint8_t, head_bytes>;
}  // namespace wire

template <class Backend>
struct agent_state {
  using communicator_type = communicator<Backend>;

  // A call of this rank's waiting for its reply, in the caller's frame.
  struct pending_call {
    int peer;
    const std::string* name;
    asio::steady_timer* wake;
    bool done = false;
    detail::frame_in reply{};
    std::exception_ptr failure{};
  };

  std::weak_ptr<communicator_type> group;
  std::map<std::string, detail::function_entry> functions;
  agent_options o;
  asio::any_io_executor ex;
  int me = 0, n = 1;
  std::uint64_t next_id = 1;
  std::unordered_map<std::uint64_t, pending_call*> calls;
  std::vector<std::exception_ptr> gone;  // per peer: why its stream ended
  std::vector<bool> said_bye;
  int handlers = 0;                        // calls being handled here
  std::uint64_t issued = 0, received = 0;  // calls sent, calls that arrived
  // Results kept for remote references (agent::remote): their replies.
  std::unordered_map<std::uint64_t, detail::frame_out> values;
  std::uint64_t payload_bytes = 0, tensor_bytes = 0;  // sent (payloads, tensors)
  std::uint64_t next_value = 1;
  // Calls wait here until start() has handed the agent to its caller
  // (begin_serving): a handler may use the agent start() returned.
  struct held_call {
    int peer;
    std::uint64_t id;
    detail::frame_in frame;
  };
  bool serving = false;
  std::vector<held_call> held;
  bool closed = false;
  asio::steady_timer* shutdown_wake = nullptr;

  void wake_shutdown() {
    if (shutdown_wake) shutdown_wake->cancel();
  }

  std::string call_name(const std::string& name) const { return "rpc.call '" + name + "'"; }

  // Fails every call waiting on `peer` with `why`.
  void peer_gone(int peer, std::exception_ptr why) {
    gone[static_cast<std::size_t>(peer)] = why;
    for (auto& [id, p] : calls)
      if (p->peer == peer && !p->done) {
        p->failure = as_call_error(*p->name, peer, why);
        p->done = true;
        if (p->wake) p->wake->cancel();
      }
    wake_shutdown();
  }

  // `why` (a failure of the stream from `peer`) as the error of a call of
  // `name`: its code kept, the call and the peer named.
  std::exception_ptr as_call_error(const std::string& name, int peer,
                                   std::exception_ptr why) const {
    errc code = errc::peer_lost;
    std::string detail = "the stream from the callee ended";
    try {
      std::rethrow_exception(why);
    } catch (const dcomm::error& e) {
      if (e.code().category() == dcomm::error_category())
        code = static_cast<errc>(e.code().value());
      detail = e.what();
    } catch (const std::exception& e) {
      detail = e.what();
    }
    return std::make_exception_ptr(error(code, {.operation = call_name(name),
                                                .rank = me,
                                                .peers = "rank " + std::to_string(peer),
                                                .detail = detail}));
  }

  // A reply or failure for call `id` from `peer`.
  void complete(std::uint64_t id, int peer, wire::kind type, detail::frame_in payload) {
    auto it = calls.find(id);
    if (it == calls.end() || it->second->peer != peer) return;  // it timed out meanwhile
    auto& p = *it->second;
    if (type == wire::kind::failure) {
      std::uint32_t code = static_cast<std::uint32_t>(errc::protocol_error);
      std::string detail;
      try {
        reader r(payload.body);
        r(code);
        r(detail);
      } catch (const payload_error& e) {
        detail = std::string("the callee's failure does not parse: ") + e.what();
      }
      p.failure = std::make_exception_ptr(
          error(static_cast<errc>(code), {.operation = call_name(*p.name),
                                          .rank = me,
                                          .peers = "rank " + std::to_string(peer),
                                          .detail = detail}));
    } else {
      p.reply = std::move(payload);
    }
    p.done = true;
    if (p.wake) p.wake->cancel();  // a call to oneself waits on no timer
  }
};

namespace detail {

inline frame_out failure_frame(errc code, const std::string& detail) {
  return make_frame([&](writer& w) {
    w(static_cast<std::uint32_t>(code));
    w(detail);
  });
}

// Waits for every request, then throws the first failure.
DCOMM_EMIT_ON_USE asio::awaitable<void> wait_all(std::vector<request>& requests) {
  std::exception_ptr failure;
  for (auto& r : requests) {
    try {
      co_await r.async_wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

inline std::span<const std::uint8_t> bytes_of(const tensor_out& t) {
  return {static_cast<const std::uint8_t*>(t.data),
          static_cast<std::size_t>(t.count * size_of(t.type))};
}

// Sends a frame to `peer`: the header, the payload and the tensors, all
// started before any is awaited. The frame lives until every send is done.
template <class Backend>
asio::awaitable<void> send_frame(std::shared_ptr<agent_state<Backend>> s, int peer, wire::kind type,
                                 std::uint64_t id, std::shared_ptr<const frame_out> frame,
                                 std::chrono::milliseconds timeout) {
  wire::header h;
  h.type = type;
  h.id = id;
  h.bytes = frame ? frame->payload.size() : 0;
  const bool in_head = h.bytes <= wire::inline_bytes;
  auto head = std::make_shared<wire::head>();
  std::memcpy(head->data(), &h, sizeof h);
  if (h.bytes && in_head)
    std::memcpy(head->data() + sizeof h, frame->payload.data(), frame->payload.size());
  std::vector<request> sends;
  {
    auto g = s->group.lock();
    if (!g)
      throw_error(errc::closed, {.operation = "rpc", .rank = s->me, .detail = "the agent is gone"});
    const op_options o{.timeout = timeout};
    sends.push_back(g->isend(std::span<const std::uint8_t>(*head), peer, wire::tag, o));
    if (h.bytes) {
      if (!in_head) sends.push_back(g->isend(frame->payload, peer, wire::tag, o));
      for (const auto& t : frame->tensors)
        sends.push_back(g->isend(bytes_of(t), peer, wire::tag, o));
      s->payload_bytes += frame->payload.size();
      s->tensor_bytes += frame->tensor_bytes();
    }
  }
  co_await wait_all(sends);
}

// Runs a call's bytes against the registered functions: the reply's kind
// and bytes. Nothing the bytes say can take this rank down.
template <class Backend>
asio::awaitable<std::pair<wire::kind, frame_out>> run_call(std::shared_ptr<agent_state<Backend>> s,
                                                           frame_in& call) {
  std::string name;
  errc code = errc::remote_error;
  std::string detail;
  try {
    reader r(call.body, &call.tensors);
    r(name);
    const auto arguments = r.read<std::string>();
    if (name == wire::fetch || name == wire::release) {  // a remote reference's value
      if (arguments != signature<std::uint64_t>())
        throw payload_error(name + " takes (u64), not " + arguments);
      const auto id = r.read<std::uint64_t>();
      auto v = s->values.find(id);
      if (v == s->values.end()) {
        code = errc::invalid_argument;
        detail = "no remote value #" + std::to_string(id) + " on rank " + std::to_string(s->me) +
                 " (released already?)";
      } else if (name == wire::fetch) {
        co_return std::pair{wire::kind::reply, v->second};
      } else {
        s->values.erase(v);
        co_return std::pair{wire::kind::reply,
                            make_frame([](writer& w) { w(std::string("void")); })};
      }
      co_return std::pair{wire::kind::failure, failure_frame(code, detail)};
    }
    // agent::remote: run it, keep the result here, reply with its id.
    const bool keep = name.starts_with(wire::remote_prefix);
    if (keep) name.erase(0, wire::remote_prefix.size());
    auto it = s->functions.find(name);
    if (it == s->functions.end()) {
      code = errc::invalid_argument;
      detail = "no function named '" + name + "' is registered on rank " + std::to_string(s->me);
    } else if (arguments != it->second.arguments) {
      code = errc::mismatch;
      detail = "'" + name + "' on rank " + std::to_string(s->me) + " takes " +
               it->second.arguments + "; the call passed " + arguments;
    } else {
      frame_out out = co_await it->second.run(r);
      if (keep) {
        const auto id = s->next_value++;
        s->values.emplace(id, std::move(out));
        out = make_frame([&](writer& w) {
          w(signature<std::uint64_t, std::string>());
          w(id);
          w(it->second.result);
        });
      }
      co_return std::pair{wire::kind::reply, std::move(out)};
    }
  } catch (const payload_error& e) {
    code = errc::protocol_error;
    detail = "the call's bytes do not parse as its signature says: " + std::string(e.what());
  } catch (const std::exception& e) {
    detail = "'" + name + "' threw on rank " + std::to_string(s->me) + ": " + e.what();
  } catch (...) {
    detail = "'" + name + "' threw on rank " + std::to_string(s->me) + " (not a std::exception)";
  }
  co_return std::pair{wire::kind::failure, failure_frame(code, detail)};
}

// A call from `peer`: run it, send the reply (a caller that is gone or
// gave up meanwhile is no error of ours).
template <class Backend>
asio::awaitable<void> handle(std::shared_ptr<agent_state<Backend>> s, int peer, std::uint64_t id,
                             frame_in call) {
  auto [type, out] = co_await run_call(s, call);
  if (out.total_bytes() > s->o.max_message_bytes) {
    type = wire::kind::failure;
    out = failure_frame(errc::invalid_argument,
                        "the reply's " + std::to_string(out.total_bytes()) +
                            " bytes exceed agent_options::max_message_bytes (" +
                            std::to_string(s->o.max_message_bytes) + ") on rank " +
                            std::to_string(s->me));
  }
  try {
    co_await send_frame(s, peer, type, id, std::make_shared<const frame_out>(std::move(out)),
                        s->o.timeout);
  } catch (const std::exception& e) {
    dcomm::detail::log(dcomm::detail::log_level::debug,
                       "rpc: the reply to rank " + std::to_string(peer) + " was lost: " + e.what());
  }
  --s->handlers;
  s->wake_shutdown();
}

// A payload from `peer` split from its tensors' table, the tensors
// allocated. A table that does not parse ends the stream: what follows it
// cannot be told apart.
template <class Backend>
frame_in receive_tensors(const agent_state<Backend>& s, int peer, bytes payload) {
  const std::uint64_t room = s.o.max_message_bytes - payload.size();
  try {
    return unseal(std::move(payload), room);
  } catch (const payload_error& e) {
    throw_error(errc::protocol_error, {.operation = "rpc",
                                       .rank = s.me,
                                       .peers = "rank " + std::to_string(peer),
                                       .detail = std::string("a frame's tensors: ") + e.what()});
  }
}

// Serving begins: the calls held until start() returned are handled, and
// every later one as it comes.
template <class Backend>
void begin_serving(const std::shared_ptr<agent_state<Backend>>& s) {
  s->serving = true;
  for (auto& c : std::exchange(s->held, {}))
    asio::co_spawn(s->ex, handle(s, c.peer, c.id, std::move(c.frame)), asio::detached);
}

// Listens to `peer` until its bye, its loss or the agent's end.
template <class Backend>
asio::awaitable<void> serve(std::shared_ptr<agent_state<Backend>> s, int peer) {
  // Listening is not waiting for a result: it lasts as long as the agent.
  const op_options listen{.timeout = std::chrono::hours(24 * 365)};
  try {
    for (;;) {
      wire::head head;
      request r;
      {
        auto g = s->group.lock();
        if (!g) co_return;
        r = g->irecv(std::span<std::uint8_t>(head), peer, wire::tag, listen);
      }
      co_await r.async_wait();
      wire::header h;
      std::memcpy(&h, head.data(), sizeof h);
      if (h.magic != wire::magic || h.type < wire::kind::call || h.type > wire::kind::bye ||
          h.bytes > s->o.max_message_bytes)
        throw_error(errc::protocol_error,
                    {.operation = "rpc",
                     .rank = s->me,
                     .peers = "rank " + std::to_string(peer),
                     .detail = "a frame header that is not the agent's (magic, kind or size)"});
      frame_in frame;
      if (h.bytes) {
        bytes payload;
        if (h.bytes <= wire::inline_bytes) {
          payload.assign(head.begin() + sizeof h, head.begin() + sizeof h + h.bytes);
        } else {
          payload.resize(h.bytes);
          {
            auto g = s->group.lock();
            if (!g) co_return;
            r = g->irecv(payload, peer, wire::tag, listen);
          }
          co_await r.async_wait();
        }
        frame = receive_tensors(*s, peer, std::move(payload));
        if (!frame.tensors.empty()) {
          std::vector<request> receives;
          {
            auto g = s->group.lock();
            if (!g) co_return;
            for (auto& t : frame.tensors)
              receives.push_back(g->irecv(
                  std::span<std::uint8_t>(static_cast<std::uint8_t*>(t.data),
                                          static_cast<std::size_t>(t.count * size_of(t.type))),
                  peer, wire::tag, listen));
          }
          co_await wait_all(receives);
        }
      }
      switch (h.type) {
        case wire::kind::call:
          ++s->handlers;
          ++s->received;
          if (s->serving)
            asio::co_spawn(s->ex, handle(s, peer, h.id, std::move(frame)), asio::detached);
          else
            s->held.push_back({peer, h.id, std::move(frame)});
          break;
        case wire::kind::reply:
        case wire::kind::failure:
          s->complete(h.id, peer, h.type, std::move(frame));
          break;
        case wire::kind::bye:
          s->said_bye[static_cast<std::size_t>(peer)] = true;
          s->peer_gone(peer, std::make_exception_ptr(
                                 error(errc::closed, {.operation = "rpc",
                                                      .rank = s->me,
                                                      .peers = "rank " + std::to_string(peer),
                                                      .detail = "the callee's agent shut down"})));
          co_return;
      }
    }
  } catch (...) {
    s->peer_gone(peer, std::current_exception());
  }
}

// A call of this rank's: to a peer, or run here when it names this rank.
// `call` is the sealed frame: name, argument signature, arguments.
template <class Backend>
asio::awaitable<frame_in> raw_call(std::shared_ptr<agent_state<Backend>> s, int dst,
                                   std::chrono::milliseconds timeout, std::string name,
                                   std::shared_ptr<const frame_out> call) {
  const std::string what = s->call_name(name);
  if (dst < 0 || dst >= s->n)
    throw_error(errc::invalid_argument,
                {.operation = what,
                 .rank = s->me,
                 .detail = "rank " + std::to_string(dst) + " is out of range for a group of " +
                           std::to_string(s->n)});
  if (s->closed)
    throw_error(errc::closed, {.operation = what, .rank = s->me, .detail = "the agent shut down"});
  if (call->total_bytes() > s->o.max_message_bytes)
    throw_error(errc::invalid_argument,
                {.operation = what,
                 .rank = s->me,
                 .detail = "the call's " + std::to_string(call->total_bytes()) +
                           " bytes exceed agent_options::max_message_bytes (" +
                           std::to_string(s->o.max_message_bytes) + ")"});
  const auto id = s->next_id++;
  if (dst == s->me) {  // no message: the handler runs here
    ++s->issued;
    ++s->received;
    ++s->handlers;
    frame_in here = loopback(*call);
    auto [type, out] = co_await run_call(s, here);
    --s->handlers;
    typename agent_state<Backend>::pending_call p{.peer = dst, .name = &name, .wake = nullptr};
    s->calls.emplace(id, &p);
    s->complete(id, dst, type, loopback(out));
    s->calls.erase(id);
    s->wake_shutdown();
    if (p.failure) std::rethrow_exception(p.failure);
    co_return std::move(p.reply);
  }
  if (auto why = s->gone[static_cast<std::size_t>(dst)])
    std::rethrow_exception(s->as_call_error(name, dst, why));
  ++s->issued;  // counted once it is sent (shutdown compares with calls received)
  asio::steady_timer wake(s->ex, timeout);
  typename agent_state<Backend>::pending_call p{.peer = dst, .name = &name, .wake = &wake};
  s->calls.emplace(id, &p);
  std::exception_ptr send_failure;
  try {
    co_await send_frame<Backend>(s, dst, wire::kind::call, id, call, timeout);
  } catch (...) {
    send_failure = std::current_exception();
  }
  if (!send_failure && !p.done) {
    asio::error_code ec;
    co_await wake.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  s->calls.erase(id);
  s->wake_shutdown();
  if (p.failure) std::rethrow_exception(p.failure);
  if (send_failure) std::rethrow_exception(s->as_call_error(name, dst, send_failure));
  if (!p.done)
    throw_error(errc::timeout, {.operation = what,
                                .rank = s->me,
                                .peers = "rank " + std::to_string(dst),
                                .detail = "no reply within " + std::to_string(timeout.count()) +
                                          " ms (the callee may be busy, stopped or hung)"});
  co_return std::move(p.reply);
}

}  // namespace detail

}  // namespace dcomm::rpc

#include "dcomm/rpc/impl/agent.hpp"
