// communicator<Backend>: what a torch.distributed user calls a process
// group, as awaitable operations.
//
//   auto comm = dcomm::init_process_group<dcomm::tcp_backend>(
//       {.init_method = "env://", .timeout = 30s});
//   comm.all_reduce(grads, dcomm::avg, dcomm::blocking);     // plain call
//   co_await comm.all_reduce(grads, dcomm::avg);             // in a coroutine
//
// Every operation is an initiating function: its last argument is a
// completion token (default asio::use_awaitable; dcomm::blocking; a
// callback void(std::exception_ptr[, result]); asio::use_future). Ranks
// are relative to the communicator's group. Input is checked before
// anything is sent; a bad call completes with errc::invalid_argument.
// A communicator is a cheap handle: copies share the group; the
// connections close when the last handle of the last group goes away.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"
#include "dcomm/init_method.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/rendezvous.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm {

// init_process_group's arguments, torch's names where they exist.
template <class Backend>
struct init_options {
  std::string init_method = "env://";
  std::optional<int> rank{};
  std::optional<int> world_size{};
  // Rendezvous and the default deadline of every operation.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  std::string job_token = detail::job_token_from_environment();
  // Where rank 0's store server listens; empty: every interface.
  std::string store_bind_host = "";
  typename Backend::options backend{};
  env_lookup env = process_environment();
};

// A trivially copyable value, a std::string, or a std::vector of trivially
// copyable elements: what the object collectives carry.
template <class T>
concept object_value = std::is_trivially_copyable_v<T> || std::same_as<T, std::string> ||
    (requires { typename T::value_type; } && std::same_as<T, std::vector<typename T::value_type>> &&
     std::is_trivially_copyable_v<typename T::value_type>);

namespace detail {

template <object_value T>
std::vector<std::uint8_t> to_bytes(const T& v) {
  std::vector<std::uint8_t> out;
  if constexpr (std::is_trivially_copyable_v<T>) {
    out.resize(sizeof(T));
    std::memcpy(out.data(), &v, sizeof(T));
  } else {
    out.resize(v.size() * sizeof(typename T::value_type));
    if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  }
  return out;
}

template <object_value T>
T from_bytes(const std::uint8_t* p, std::size_t n, const char* operation) {
  T v{};
  if constexpr (std::is_trivially_copyable_v<T>) {
    if (n != sizeof(T))
      throw_error(errc::mismatch, {.operation = operation,
                                   .expected = std::to_string(sizeof(T)) + " bytes",
                                   .seen = std::to_string(n) + " bytes",
                                   .detail = "ranks passed objects of different types"});
    std::memcpy(&v, p, n);
  } else {
    using E = typename T::value_type;
    if (n % sizeof(E) != 0)
      throw_error(errc::mismatch, {.operation = operation,
                                   .seen = std::to_string(n) + " bytes",
                                   .detail = "not a whole number of elements of " +
                                             std::to_string(sizeof(E)) + " bytes"});
    v.resize(n / sizeof(E));
    if (n) std::memcpy(v.data(), p, n);
  }
  return v;
}

inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Does [a, a+an) overlap [b, b+bn) other than being identical?
inline bool partly_overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  if (an == 0 || bn == 0) return false;
  return pa < pb + bn && pb < pa + an;
}

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
              asio::co_spawn(executor, wait_op(std::move(s)), std::move(handler));
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
  template <backend>
  friend class communicator;

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

  static asio::awaitable<void> wait_op(std::shared_ptr<state> s) {
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
    for (;;) {
      {
        std::lock_guard lock(s->mutex);
        if (s->done) break;
      }
      asio::error_code ec;
      co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      if (!ec) break;
    }
    std::erase(s->waiters, &timer);
    std::lock_guard lock(s->mutex);
    if (!s->done)
      throw_error(errc::timeout, {.operation = s->operation,
                                  .detail = "the operation did not complete by its deadline"});
    if (s->failure) std::rethrow_exception(s->failure);
  }

  void check_valid() const {
    if (!state_)
      throw_error(errc::invalid_argument,
                  {.operation = "request", .detail = "an empty request (default-constructed)"});
  }

  std::shared_ptr<state> state_;
};

template <backend Backend>
class communicator {
 public:
  using backend_type = Backend;

  // An empty handle, to assign a real one to later (Asio needs one too).
  communicator() = default;
  bool valid() const { return rt_ != nullptr; }

  // This process's rank in the group, and the group's size.
  int rank() const { return group_->rank; }
  int size() const { return group_->size(); }
  // The members' ranks in the world group, in group rank order.
  std::span<const int> ranks() const { return group_->ranks; }
  int global_rank(int group_rank) const {
    check_rank(group_rank, "global_rank", "group rank");
    return group_->ranks[static_cast<std::size_t>(group_rank)];
  }
  std::chrono::milliseconds timeout() const { return group_->timeout; }
  asio::any_io_executor get_executor() const { return rt_->backend->get_executor(); }
  Backend& backend() const { return *rt_->backend; }

  // Fails every pending and future operation of every group at once.
  void abort() const { rt_->backend->abort(); }

  // ---------------------------------------------------------------- p2p
  // Sizes must match exactly between sender and receiver (errc::mismatch).

  template <tensor T, op_token Token = default_token_t>
  auto send(const T& t, int dst, Token&& token = {}) const {
    return send(t, dst, 0, op_options{}, std::forward<Token>(token));
  }
  template <tensor T, op_token Token = default_token_t>
  auto send(const T& t, int dst, int tag, Token&& token = {}) const {
    return send(t, dst, tag, op_options{}, std::forward<Token>(token));
  }
  template <tensor T, op_token Token = default_token_t>
  auto send(const T& t, int dst, int tag, op_options o, Token&& token = {}) const {
    auto in = view(t);
    auto bad = check([&] {
      check_peer(dst, "send", in);
      check_options("send", o);
    });
    return launch<void>("send", std::forward<Token>(token), bad, p2p_context(tag, o),
                        [in, dst](Backend& b, const op_context& c) { return b.send(c, in, dst); });
  }

  template <mutable_tensor T, op_token Token = default_token_t>
  auto recv(T&& t, int src, Token&& token = {}) const {
    return recv(std::forward<T>(t), src, 0, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto recv(T&& t, int src, int tag, Token&& token = {}) const {
    return recv(std::forward<T>(t), src, tag, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto recv(T&& t, int src, int tag, op_options o, Token&& token = {}) const {
    auto out = mutable_view(t);
    auto bad = check([&] {
      check_peer(src, "recv", out);
      check_options("recv", o);
    });
    return launch<void>(
        "recv", std::forward<Token>(token), bad, p2p_context(tag, o),
        [out, src](Backend& b, const op_context& c) { return b.recv(c, out, src); });
  }

  // Start at once; the buffer must stay alive until the request is done.
  template <tensor T>
  request isend(const T& t, int dst, int tag = 0, op_options o = {}) const {
    auto in = view(t);
    auto bad = check([&] {
      check_peer(dst, "isend", in);
      check_options("isend", o);
    });
    return start_request("isend", bad, p2p_context(tag, o),
                         [in, dst](Backend& b, const op_context& c) { return b.send(c, in, dst); });
  }
  template <mutable_tensor T>
  request irecv(T&& t, int src, int tag = 0, op_options o = {}) const {
    auto out = mutable_view(t);
    auto bad = check([&] {
      check_peer(src, "irecv", out);
      check_options("irecv", o);
    });
    return start_request(
        "irecv", bad, p2p_context(tag, o),
        [out, src](Backend& b, const op_context& c) { return b.recv(c, out, src); });
  }

  // -------------------------------------------------------- collectives

  template <op_token Token = default_token_t>
  auto barrier(Token&& token = {}) const {
    return barrier(op_options{}, std::forward<Token>(token));
  }
  template <op_token Token = default_token_t>
  auto barrier(op_options o, Token&& token = {}) const {
    std::exception_ptr bad;
    auto ctx = coll_context("barrier", o, bad);
    return launch<void>("barrier", std::forward<Token>(token), bad, ctx,
                        [](Backend& b, const op_context& c) { return b.barrier(c); });
  }

  // Every rank's buffer ends up equal to the root's.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto broadcast(T&& buf, int root, Token&& token = {}) const {
    return broadcast(std::forward<T>(buf), root, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto broadcast(T&& buf, int root, op_options o, Token&& token = {}) const {
    auto v = mutable_view(buf);
    auto bad = check([&] {
      check_tensor(v, "broadcast");
      check_rank(root, "broadcast", "root");
    });
    auto ctx = coll_context("broadcast", o, bad);
    return launch<void>(
        "broadcast", std::forward<Token>(token), bad, ctx,
        [v, root](Backend& b, const op_context& c) { return b.broadcast(c, v, root); });
  }

  // The root's buffer becomes the reduction of everyone's; the others'
  // buffers are left as they were.
  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce(T&& buf, int root, const Op& op, Token&& token = {}) const {
    return reduce(std::forward<T>(buf), root, op, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce(T&& buf, int root, const Op& op, op_options o,
                                    Token&& token = {}) const {
    auto v = mutable_view(buf);
    return reduce_impl<element_t<T>>(v, v, root, op, o, std::forward<Token>(token));
  }
  // Out of place: `out` is written on the root only (other ranks may pass
  // an empty buffer).
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce(const In& in, Out&& out, int root, const Op& op,
                                    Token&& token = {}) const {
    return reduce(in, std::forward<Out>(out), root, op, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce(const In& in, Out&& out, int root, const Op& op, op_options o,
                                    Token&& token = {}) const {
    same_element<In, Out>();
    return reduce_impl<element_t<In>>(view(in), mutable_view(out), root, op, o,
                                      std::forward<Token>(token));
  }

  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce(T&& buf, const Op& op, Token&& token = {}) const {
    return all_reduce(std::forward<T>(buf), op, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce(T&& buf, const Op& op, op_options o,
                                        Token&& token = {}) const {
    auto v = mutable_view(buf);
    return all_reduce_impl<element_t<T>>(v, v, op, o, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce(const In& in, Out&& out, const Op& op,
                                        Token&& token = {}) const {
    return all_reduce(in, std::forward<Out>(out), op, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce(const In& in, Out&& out, const Op& op, op_options o,
                                        Token&& token = {}) const {
    same_element<In, Out>();
    return all_reduce_impl<element_t<In>>(view(in), mutable_view(out), op, o,
                                          std::forward<Token>(token));
  }

  // in (root): size() blocks of out's size; block i goes to rank i.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto scatter(const In& in, Out&& out, int root, Token&& token = {}) const {
    return scatter(in, std::forward<Out>(out), root, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto scatter(const In& in, Out&& out, int root, op_options o, Token&& token = {}) const {
    same_element<In, Out>();
    auto i = view(in);
    auto w = mutable_view(out);
    auto bad = check([&] {
      check_rank(root, "scatter", "root");
      check_types(i, w, "scatter");
      if (rank() == root) {
        check_blocks(i, w.count, "scatter", "the root's input", "the output");
        check_no_partial_overlap(i, w, "scatter", w.data == root_block(i, w.count));
      }
    });
    auto ctx = coll_context("scatter", o, bad);
    return launch<void>(
        "scatter", std::forward<Token>(token), bad, ctx,
        [i, w, root](Backend& b, const op_context& c) { return b.scatter(c, i, w, root); });
  }
  // In place: every rank passes size() blocks; rank r's block r is written.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto scatter(T&& buf, int root, Token&& token = {}) const {
    auto v = mutable_view(buf);
    auto block = v.count / static_cast<std::size_t>(size());
    tensor_view mine{
        static_cast<char*>(v.data) + block * size_of(v.type) * static_cast<std::size_t>(rank()),
        block, v.type, v.device};
    return scatter(const_tensor_view(v), mine, root, op_options{}, std::forward<Token>(token));
  }

  // out (root): size() blocks of in's size; block i comes from rank i.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto gather(const In& in, Out&& out, int root, Token&& token = {}) const {
    return gather(in, std::forward<Out>(out), root, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto gather(const In& in, Out&& out, int root, op_options o, Token&& token = {}) const {
    same_element<In, Out>();
    auto i = view(in);
    auto w = mutable_view(out);
    auto bad = check([&] {
      check_rank(root, "gather", "root");
      check_types(i, w, "gather");
      if (rank() == root) {
        check_blocks(w, i.count, "gather", "the root's output", "the input");
        check_no_partial_overlap(i, w, "gather", i.data == root_block(w, i.count));
      }
    });
    auto ctx = coll_context("gather", o, bad);
    return launch<void>(
        "gather", std::forward<Token>(token), bad, ctx,
        [i, w, root](Backend& b, const op_context& c) { return b.gather(c, i, w, root); });
  }
  // In place: rank r's contribution is block r of its buffer.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto gather(T&& buf, int root, Token&& token = {}) const {
    auto v = mutable_view(buf);
    return gather(own_block(v), v, root, op_options{}, std::forward<Token>(token));
  }

  // out: size() blocks of in's size, block i from rank i.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto all_gather(const In& in, Out&& out, Token&& token = {}) const {
    return all_gather(in, std::forward<Out>(out), op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto all_gather(const In& in, Out&& out, op_options o, Token&& token = {}) const {
    same_element<In, Out>();
    auto i = view(in);
    auto w = mutable_view(out);
    auto bad = check([&] {
      check_types(i, w, "all_gather");
      check_blocks(w, i.count, "all_gather", "the output", "the input");
      check_no_partial_overlap(i, w, "all_gather", i.data == root_block(w, i.count));
    });
    auto ctx = coll_context("all_gather", o, bad);
    return launch<void>("all_gather", std::forward<Token>(token), bad, ctx,
                        [i, w](Backend& b, const op_context& c) { return b.all_gather(c, i, w); });
  }
  // In place: rank r's contribution is block r of its buffer.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto all_gather(T&& buf, Token&& token = {}) const {
    auto v = mutable_view(buf);
    return all_gather(own_block(v), v, op_options{}, std::forward<Token>(token));
  }

  // in: size() blocks of out's size; rank r gets the reduction of block r.
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce_scatter(const In& in, Out&& out, const Op& op,
                                            Token&& token = {}) const {
    return reduce_scatter(in, std::forward<Out>(out), op, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce_scatter(const In& in, Out&& out, const Op& op, op_options o,
                                            Token&& token = {}) const {
    same_element<In, Out>();
    auto i = view(in);
    auto w = mutable_view(out);
    auto bad = check([&] {
      check_types(i, w, "reduce_scatter");
      check_blocks(i, w.count, "reduce_scatter", "the input", "the output");
      check_no_partial_overlap(i, w, "reduce_scatter", w.data == root_block(i, w.count));
    });
    return with_reducer<element_t<In>>("reduce_scatter", op, w.type, bad, o,
                                       std::forward<Token>(token),
                                       [i, w](Backend& b, const op_context& c, reducer r) {
                                         return b.reduce_scatter(c, i, w, r);
                                       });
  }
  // In place: the result is written to block r of the buffer.
  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce_scatter(T&& buf, const Op& op, Token&& token = {}) const {
    auto v = mutable_view(buf);
    auto mine = own_block(v);
    return reduce_scatter_view<element_t<T>>(
        v, tensor_view{const_cast<void*>(mine.data), mine.count, mine.type, mine.device}, op,
        std::forward<Token>(token));
  }

  // in, out: size() blocks; block j of rank i's in becomes block i of
  // rank j's out.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto all_to_all(const In& in, Out&& out, Token&& token = {}) const {
    return all_to_all(in, std::forward<Out>(out), op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto all_to_all(const In& in, Out&& out, op_options o, Token&& token = {}) const {
    same_element<In, Out>();
    auto i = view(in);
    auto w = mutable_view(out);
    auto bad = check([&] {
      check_types(i, w, "all_to_all");
      if (i.count != w.count || i.count % static_cast<std::size_t>(size()) != 0)
        invalid("all_to_all",
                "input and output must have the same size, a multiple of the group "
                "size " +
                    std::to_string(size()) + "; got " + std::to_string(i.count) + " and " +
                    std::to_string(w.count) + " elements");
      if (detail::partly_overlaps(i.data, i.bytes(), w.data, w.bytes()) ||
          (i.data == w.data && i.count))
        invalid("all_to_all", "input and output overlap; use the one-buffer (in-place) form");
    });
    auto ctx = coll_context("all_to_all", o, bad);
    return launch<void>("all_to_all", std::forward<Token>(token), bad, ctx,
                        [i, w](Backend& b, const op_context& c) { return b.all_to_all(c, i, w); });
  }
  // In place (through a copy of the buffer).
  template <mutable_tensor T, op_token Token = default_token_t>
  auto all_to_all(T&& buf, Token&& token = {}) const {
    auto v = mutable_view(buf);
    auto bad = check([&] { check_tensor(v, "all_to_all"); });
    // Host memory is copied aside here; a device backend gets in == out and
    // keeps its own copy on the device.
    std::shared_ptr<std::vector<std::byte>> copy;
    const_tensor_view i = v;
    if (!bad && v.device.type == device::kind::cpu) {
      copy = std::make_shared<std::vector<std::byte>>(
          static_cast<const std::byte*>(v.data), static_cast<const std::byte*>(v.data) + v.bytes());
      i.data = copy->data();
    }
    if (!bad)
      bad = check([&] {
        if (v.count % static_cast<std::size_t>(size()) != 0)
          invalid("all_to_all", "the buffer's " + std::to_string(v.count) +
                                    " elements are not a multiple of the group size " +
                                    std::to_string(size()));
      });
    auto ctx = coll_context("all_to_all", op_options{}, bad);
    return launch<void>(
        "all_to_all", std::forward<Token>(token), bad, ctx,
        [i, v, copy](Backend& b, const op_context& c) { return b.all_to_all(c, i, v); });
  }

  // Every rank contributes any number of elements; `out` is resized to
  // hold all of them in rank order. Completes with each rank's count.
  template <tensor In, class E,
            completion_token_for<std::vector<std::size_t>> Token = default_token_t>
  auto all_gather_v(const In& in, std::vector<E>& out, Token&& token = {}) const {
    return all_gather_v(in, out, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, class E,
            completion_token_for<std::vector<std::size_t>> Token = default_token_t>
  auto all_gather_v(const In& in, std::vector<E>& out, op_options o, Token&& token = {}) const {
    static_assert(std::is_same_v<element_t<In>, E>,
                  "dcomm: all_gather_v: the output vector's element type must be the input's");
    auto i = view(in);
    auto bad = check([&] { check_tensor(i, "all_gather_v"); });
    output_allocator alloc = [&out](std::span<const std::size_t> counts) {
      out.resize(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
      return mutable_view(out);
    };
    auto ctx = coll_context("all_gather_v", o, bad);
    return launch<std::vector<std::size_t>>(
        "all_gather_v", std::forward<Token>(token), bad, ctx,
        [i, alloc](Backend& b, const op_context& c) { return b.all_gather_v(c, i, alloc); });
  }

  // send_counts[j] elements of `in` (in rank order) go to rank j; `out` is
  // resized to what arrives, in rank order. Completes with the counts
  // received from each rank.
  template <tensor In, class E,
            completion_token_for<std::vector<std::size_t>> Token = default_token_t>
  auto all_to_all_v(const In& in, std::vector<std::size_t> send_counts, std::vector<E>& out,
                    Token&& token = {}) const {
    return all_to_all_v(in, std::move(send_counts), out, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, class E,
            completion_token_for<std::vector<std::size_t>> Token = default_token_t>
  auto all_to_all_v(const In& in, std::vector<std::size_t> send_counts, std::vector<E>& out,
                    op_options o, Token&& token = {}) const {
    static_assert(std::is_same_v<element_t<In>, E>,
                  "dcomm: all_to_all_v: the output vector's element type must be the input's");
    auto i = view(in);
    auto bad = check([&] {
      check_tensor(i, "all_to_all_v");
      if (send_counts.size() != static_cast<std::size_t>(size()))
        invalid("all_to_all_v", "send_counts has " + std::to_string(send_counts.size()) +
                                    " entries; the group has " + std::to_string(size()) + " ranks");
      auto total = std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0});
      if (total != i.count)
        invalid("all_to_all_v", "send_counts add up to " + std::to_string(total) +
                                    " elements; the input has " + std::to_string(i.count));
    });
    output_allocator alloc = [&out](std::span<const std::size_t> counts) {
      out.resize(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
      return mutable_view(out);
    };
    auto ctx = coll_context("all_to_all_v", o, bad);
    return launch<std::vector<std::size_t>>(
        "all_to_all_v", std::forward<Token>(token), bad, ctx,
        [i, counts = std::move(send_counts), alloc](Backend& b, const op_context& c) {
          return b.all_to_all_v(c, i, counts, alloc);
        });
  }

  // ------------------------------------------------------------ objects

  // obj becomes the root's value on every rank (strings and vectors may
  // change size).
  template <object_value T, op_token Token = default_token_t>
  auto broadcast_object(T& obj, int root, Token&& token = {}) const {
    auto bad = check([&] { check_rank(root, "broadcast_object", "root"); });
    auto ctx = coll_context("broadcast_object", op_options{}, bad);
    auto data_seq = bad ? 0 : group_->next_seq.fetch_add(1);  // the payload's own call
    auto payload = rank() == root ? detail::to_bytes(obj) : std::vector<std::uint8_t>{};
    return launch<void>("broadcast_object", std::forward<Token>(token), bad, ctx,
                        [&obj, root, data_seq, payload = std::move(payload)](
                            Backend& b, const op_context& c) mutable -> detail::task<void> {
                          auto size = static_cast<std::int64_t>(payload.size());
                          tensor_view size_view = mutable_view(std::span<std::int64_t>(&size, 1));
                          co_await b.broadcast(c, size_view, root);
                          payload.resize(static_cast<std::size_t>(size));
                          op_context data = c;
                          data.seq = data_seq;
                          tensor_view payload_view = mutable_view(payload);
                          co_await b.broadcast(data, payload_view, root);
                          obj = detail::from_bytes<T>(payload.data(), payload.size(),
                                                      "broadcast_object");
                        });
  }

  // Every rank's obj, in rank order.
  template <object_value T, completion_token_for<std::vector<T>> Token = default_token_t>
  auto all_gather_object(const T& obj, Token&& token = {}) const {
    auto bytes = detail::to_bytes(obj);
    std::exception_ptr bad;
    auto ctx = coll_context("all_gather_object", op_options{}, bad);
    return launch<std::vector<T>>(
        "all_gather_object", std::forward<Token>(token), bad, ctx,
        [bytes = std::move(bytes)](Backend& b,
                                   const op_context& c) -> detail::task<std::vector<T>> {
          std::vector<std::uint8_t> all;
          output_allocator alloc = [&all](std::span<const std::size_t> counts) {
            all.resize(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
            return mutable_view(all);
          };
          const_tensor_view mine = view(bytes);
          auto counts = co_await b.all_gather_v(c, mine, alloc);
          std::vector<T> out;
          std::size_t at = 0;
          for (auto n : counts) {
            out.push_back(detail::from_bytes<T>(all.data() + at, n, "all_gather_object"));
            at += n;
          }
          co_return out;
        });
  }

  // ------------------------------------------------------------- groups

  // A group of some of this group's ranks (group ranks, any order; the new
  // group numbers them in increasing order, like torch). Every member of
  // this group must call it, in the same order as its other new_group and
  // split calls; non-members get std::nullopt. Sends nothing.
  std::optional<communicator> new_group(std::vector<int> members) const {
    std::sort(members.begin(), members.end());
    for (std::size_t i = 0; i < members.size(); ++i) {
      check_rank(members[i], "new_group", "member");
      if (i > 0 && members[i] == members[i - 1])
        invalid("new_group", "rank " + std::to_string(members[i]) + " is listed twice");
    }
    if (members.empty()) invalid("new_group", "a group needs at least one rank");
    const std::uint64_t index = group_->children.fetch_add(1);
    std::uint64_t id = detail::mix64(group_->id ^ detail::mix64(index + 1));
    for (int m : members) id = detail::mix64(id ^ static_cast<std::uint64_t>(m));
    std::vector<int> global;
    for (int m : members) global.push_back(global_rank(m));
    auto me = std::find(members.begin(), members.end(), rank());
    std::shared_ptr<group_state> child;
    if (me != members.end())
      child = make_group_state(id, std::move(global), static_cast<int>(me - members.begin()));
    rt_->backend->group_created(group_, child, 0, child ? child->rank : 0);
    if (!child) return std::nullopt;
    return communicator(rt_, owner_, std::move(child));
  }

  // MPI_Comm_split: ranks passing the same color form a group, ordered by
  // (key, rank in this group); a negative color joins none (std::nullopt).
  // A collective on this group.
  template <completion_token_for<std::optional<communicator>> Token = default_token_t>
  auto split(int color, int key, Token&& token = {}) const {
    const std::uint64_t index = group_->children.fetch_add(1);
    std::array<std::int64_t, 2> mine{color, key};
    auto self = *this;
    std::exception_ptr bad;
    auto ctx = coll_context("split", op_options{}, bad);
    return launch<std::optional<communicator>>(
        "split", std::forward<Token>(token), bad, ctx,
        [self, mine, index](Backend& b,
                            const op_context& c) -> detail::task<std::optional<communicator>> {
          std::vector<std::int64_t> all(2 * static_cast<std::size_t>(self.size()));
          const_tensor_view in = view(mine);
          tensor_view out = mutable_view(all);
          co_await b.all_gather(c, in, out);
          if (mine[0] < 0) {
            self.rt_->backend->group_created(self.group_, nullptr, -1, 0);
            co_return std::nullopt;
          }
          std::vector<std::pair<std::int64_t, int>> members;  // (key, group rank)
          for (int r = 0; r < self.size(); ++r)
            if (all[2 * static_cast<std::size_t>(r)] == mine[0])
              members.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
          std::sort(members.begin(), members.end());
          std::uint64_t id = detail::mix64(self.group_->id ^ detail::mix64(index + 1) ^
                                           detail::mix64(static_cast<std::uint64_t>(mine[0]) << 1));
          std::vector<int> global;
          int my_rank = 0;
          for (auto& [k, r] : members) {
            if (r == self.rank()) my_rank = static_cast<int>(global.size());
            global.push_back(self.global_rank(r));
          }
          auto child = self.make_group_state(id, std::move(global), my_rank);
          self.rt_->backend->group_created(self.group_, child, static_cast<int>(mine[0]), my_rank);
          co_return communicator(self.rt_, self.owner_, std::move(child));
        });
  }

  // -------------------------------------------------------- construction

  struct runtime {
    std::shared_ptr<Backend> backend;
    std::shared_ptr<detail::io_thread> thread;  // when the backend runs on our own thread
    std::shared_ptr<store> rendezvous_store;
  };

  // For init_process_group: the world group over a connected backend.
  static communicator make_world(std::shared_ptr<runtime> rt, std::chrono::milliseconds timeout) {
    auto g = std::make_shared<group_state>();
    g->id = 0;
    g->rank = rt->backend->rank();
    for (int r = 0; r < rt->backend->world_size(); ++r) g->ranks.push_back(r);
    g->timeout = timeout;
    auto owner = std::shared_ptr<closer>(new closer{rt});
    return communicator(std::move(rt), std::move(owner), std::move(g));
  }

 private:
  // Closes the connections when the last handle of every group is gone.
  struct closer {
    std::shared_ptr<runtime> rt;
    ~closer() {
      auto done = std::make_shared<std::promise<void>>();
      auto future = done->get_future();
      rt->backend->close([done] { done->set_value(); });
      // Our own io thread: let the close finish (links flushed and closed,
      // bounded by the backend) before the thread and its context stop.
      if (rt->thread && !detail::running_in_this_thread(rt->backend->get_executor()))
        future.wait_for(std::chrono::seconds(5));
    }
  };

  communicator(std::shared_ptr<runtime> rt, std::shared_ptr<closer> owner,
               std::shared_ptr<group_state> g)
      : rt_(std::move(rt)), owner_(std::move(owner)), group_(std::move(g)) {}

  std::shared_ptr<group_state> make_group_state(std::uint64_t id, std::vector<int> global,
                                                int my_rank) const {
    auto g = std::make_shared<group_state>();
    g->id = id;
    g->ranks = std::move(global);
    g->rank = my_rank;
    g->timeout = group_->timeout;
    g->name = "group " + detail::format_ranks(g->ranks);
    return g;
  }

  [[noreturn]] static void invalid(const char* operation, std::string detail) {
    throw_error(errc::invalid_argument, {.operation = operation, .detail = std::move(detail)});
  }

  template <class F>
  static std::exception_ptr check(F&& f) {
    try {
      f();
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  void check_rank(int r, const char* operation, const char* what) const {
    if (r < 0 || r >= size())
      invalid(operation, std::string(what) + " " + std::to_string(r) + " is out of range: the " +
                             (group_->id == 0 ? std::string("world") : group_->name) + " has " +
                             std::to_string(size()) + " ranks");
  }
  // Where the tensor lives and its dtype: the backend's call (host memory
  // for tcp, its own GPU for nccl).
  void check_tensor(const const_tensor_view& v, const char* operation) const {
    rt_->backend->check_tensor(v, operation);
  }
  template <class View>
  void check_peer(int peer, const char* operation, const View& v) const {
    check_tensor(v, operation);
    check_rank(peer, operation, "peer");
    if (peer == rank())
      invalid(operation, "rank " + std::to_string(peer) + " cannot send to or receive from itself");
  }
  void check_types(const const_tensor_view& in, const tensor_view& out,
                   const char* operation) const {
    check_tensor(in, operation);
    check_tensor(out, operation);
    if (in.type != out.type)
      invalid(operation, "input is " + std::string(name(in.type)) + ", output is " +
                             std::string(name(out.type)));
  }
  template <class View>
  void check_blocks(const View& big, std::size_t block, const char* operation, const char* big_name,
                    const char* block_name) const {
    if (big.count != block * static_cast<std::size_t>(size()))
      invalid(operation, std::string(big_name) + " has " + std::to_string(big.count) +
                             " elements; it must hold " + std::to_string(size()) + " blocks of " +
                             block_name + "'s " + std::to_string(block));
  }
  // Where this rank's block lies in a buffer of size() blocks.
  template <class View>
  const void* root_block(const View& big, std::size_t block) const {
    return static_cast<const char*>(big.data) +
           block * size_of(big.type) * static_cast<std::size_t>(rank());
  }
  // In and out may coincide where the in-place form allows (exact_ok),
  // never partly overlap.
  static void check_no_partial_overlap(const const_tensor_view& a, const const_tensor_view& b,
                                       const char* operation, bool exact_ok) {
    if (exact_ok) return;
    if (detail::partly_overlaps(a.data, a.bytes(), b.data, b.bytes()))
      invalid(operation,
              "input and output overlap; only this rank's own block may be shared "
              "(the in-place form)");
  }
  const_tensor_view own_block(const tensor_view& v) const {
    auto block = v.count / static_cast<std::size_t>(size());
    return {static_cast<const char*>(v.data) +
                block * size_of(v.type) * static_cast<std::size_t>(rank()),
            block, v.type, v.device};
  }

  template <class In, class Out>
  static constexpr void same_element() {
    static_assert(std::is_same_v<element_t<In>, element_t<Out>>,
                  "dcomm: input and output must have the same element type");
  }

  op_context p2p_context(int tag, const op_options& o) const {
    return {group_, static_cast<std::uint64_t>(static_cast<std::int64_t>(tag)),
            detail::clock::now() + o.timeout.value_or(group_->timeout), o.algorithm, o.stream};
  }
  // A collective takes the group's next sequence number, unless it is
  // refused: its input already (`bad`), or its options here. A refused call
  // takes no number, so the next call still matches the other ranks'.
  op_context coll_context(const char* operation, const op_options& o,
                          std::exception_ptr& bad) const {
    if (!bad) bad = check([&] { check_options(operation, o); });
    return {group_, bad ? 0 : group_->next_seq.fetch_add(1),
            detail::clock::now() + o.timeout.value_or(group_->timeout), o.algorithm, o.stream};
  }
  // What the backend cannot do with these options.
  static void check_options(const char* operation, const op_options& o) {
    if (o.stream && !Backend::supports_streams)
      invalid(operation, "op_options::stream is set, but the " + std::string(Backend::name) +
                             " backend has no streams; leave it null");
    Backend::check_algorithm(operation, o.algorithm);
  }

  template <class R, class F>
  static detail::task<R> hold(std::shared_ptr<runtime> rt, op_context ctx, F f) {
    co_return co_await f(*rt->backend, ctx);
  }
  template <class R, class Token, class F>
  auto launch(const char* operation, Token&& token, std::exception_ptr bad, op_context ctx,
              F f) const {
    if constexpr (std::is_same_v<std::decay_t<Token>, as_request_t>) {
      static_assert(std::is_void_v<R>, "dcomm::as_request: only for operations without a result");
      return start_request(operation, bad, std::move(ctx), std::move(f));
    } else {
      return initiate_op<R>(operation, std::forward<Token>(token), bad, std::move(ctx),
                            std::move(f));
    }
  }
  template <class R, class Token, class F>
  auto initiate_op(const char* operation, Token&& token, std::exception_ptr bad, op_context ctx,
                   F f) const {
    auto limit = ctx.deadline - detail::clock::now() + detail::blocking_grace;
    auto op = bad ? refuse_any<R>(bad) : hold<R>(rt_, std::move(ctx), std::move(f));
    return detail::initiate(rt_->backend->get_executor(), std::move(op), std::forward<Token>(token),
                            operation, limit);
  }
  template <class R>
  static detail::task<R> refuse_any(std::exception_ptr e) {
    if constexpr (std::is_void_v<R>) {
      std::rethrow_exception(e);
      co_return;
    } else {
      std::rethrow_exception(e);
      co_return R{};
    }
  }

  template <class F>
  request start_request(const char* operation, std::exception_ptr bad, op_context ctx, F f) const {
    auto s = std::make_shared<request::state>();
    s->executor = rt_->backend->get_executor();
    s->operation = operation;
    s->deadline = ctx.deadline;
    auto op = bad ? refuse_any<void>(bad) : hold<void>(rt_, std::move(ctx), std::move(f));
    detail::start(s->executor, guarded(std::move(op), request_guard(s)), [](std::exception_ptr) {});
    return request(std::move(s));
  }
  // If the executor is destroyed with the operation still pending (a user's
  // io_context that stops running), the request still finishes: with
  // errc::closed, instead of leaving wait() to its deadline. A parameter,
  // not a local: the coroutine may be destroyed before it ever ran.
  struct request_guard {
    std::shared_ptr<request::state> s;
    explicit request_guard(std::shared_ptr<request::state> state) : s(std::move(state)) {}
    request_guard(request_guard&& other) noexcept : s(std::move(other.s)) {}
    request_guard& operator=(request_guard&&) = delete;
    ~request_guard() {
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
  static detail::task<void> guarded(detail::task<void> op, request_guard guard) {
    std::exception_ptr failure;
    try {
      co_await std::move(op);
    } catch (...) {
      failure = std::current_exception();
    }
    auto s = std::move(guard.s);
    request::finish(s, std::move(failure));
  }

  // Builds the reducer where the functor lives (the op's coroutine frame).
  template <class E, class Op, class Token, class F>
  auto with_reducer(const char* operation, const Op& op, dtype type, std::exception_ptr bad,
                    const op_options& o, Token&& token, F f) const {
    static_assert(reduce_kind_of_v<Op> != reduce_kind::custom || Backend::supports_custom_reduce,
                  "dcomm: this backend does not support custom reduce functors");
    static_assert(!detail::is_bitwise(reduce_kind_of_v<Op>) || Backend::supports_bitwise_reduce,
                  "dcomm: this backend does not support bitwise reduce ops");
    if constexpr (std::is_void_v<E>) {
      static_assert(reduce_kind_of_v<Op> != reduce_kind::custom,
                    "dcomm: a custom reduce functor needs a tensor whose element type is known at "
                    "compile time");
    } else {
      check_reduce_op<E, Op>();
    }
    if (!bad)
      bad = check([&] {
        if constexpr (std::is_void_v<E>) check_reduce_op(reduce_kind_of_v<Op>, type);
      });
    auto ctx = coll_context(operation, o, bad);
    return launch<void>(operation, std::forward<Token>(token), bad, ctx,
                        [op, type, f](Backend& b, const op_context& c) {
                          return run_reduction<E>(b, c, op, type, f);
                        });
  }
  template <class E, class Op, class F>
  static detail::task<void> run_reduction(Backend& b, op_context c, Op op, dtype type, F f) {
    reducer r;
    if constexpr (std::is_void_v<E>)
      r = make_reducer(op, type);  // refers to `op`, alive in this frame
    else
      r = make_reducer<E>(op);  // refers to `op`, alive in this frame
    co_await f(b, c, r);
  }

  template <class E, class Op, class Token>
  auto reduce_impl(const_tensor_view in, tensor_view out, int root, const Op& op,
                   const op_options& o, Token&& token) const {
    auto bad = check([&] {
      check_rank(root, "reduce", "root");
      check_tensor(in, "reduce");
      if (rank() == root) {
        check_types(in, out, "reduce");
        if (in.count != out.count)
          invalid("reduce", "the root's output has " + std::to_string(out.count) +
                                " elements, its input " + std::to_string(in.count));
        check_no_partial_overlap(in, out, "reduce", in.data == out.data);
      }
    });
    return with_reducer<E>("reduce", op, in.type, bad, o, std::forward<Token>(token),
                           [in, out, root](Backend& b, const op_context& c, reducer r) {
                             return b.reduce(c, in, out, r, root);
                           });
  }

  template <class E, class Op, class Token>
  auto all_reduce_impl(const_tensor_view in, tensor_view out, const Op& op, const op_options& o,
                       Token&& token) const {
    auto bad = check([&] {
      check_types(in, out, "all_reduce");
      if (in.count != out.count)
        invalid("all_reduce", "the output has " + std::to_string(out.count) +
                                  " elements, the input " + std::to_string(in.count));
      check_no_partial_overlap(in, out, "all_reduce", in.data == out.data);
    });
    return with_reducer<E>("all_reduce", op, out.type, bad, o, std::forward<Token>(token),
                           [in, out](Backend& b, const op_context& c, reducer r) {
                             return b.all_reduce(c, in, out, r);
                           });
  }

  template <class E, class Op, class Token>
  auto reduce_scatter_view(tensor_view all, tensor_view mine, const Op& op, Token&& token) const {
    auto bad = check([&] {
      check_tensor(all, "reduce_scatter");
      if (all.count % static_cast<std::size_t>(size()) != 0)
        invalid("reduce_scatter", "the buffer's " + std::to_string(all.count) +
                                      " elements are not a multiple of the group size " +
                                      std::to_string(size()));
    });
    const_tensor_view in = all;
    return with_reducer<E>("reduce_scatter", op, all.type, bad, op_options{},
                           std::forward<Token>(token),
                           [in, mine](Backend& b, const op_context& c, reducer r) {
                             return b.reduce_scatter(c, in, mine, r);
                           });
  }

  std::shared_ptr<runtime> rt_;
  std::shared_ptr<closer> owner_;
  std::shared_ptr<group_state> group_;
};

// ------------------------------------------------------ init_process_group

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

template <backend Backend>
asio::awaitable<communicator<Backend>> connect_world(std::shared_ptr<store> s, int rank, int world,
                                                     std::string store_host,
                                                     init_options<Backend> o,
                                                     std::shared_ptr<io_thread> thread) {
  const auto deadline = detail::clock::now() + o.timeout;
  auto backend =
      co_await Backend::create(s, rank, world, o.job_token, store_host, o.backend, deadline);
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
    co_await close_unused(backend);
    std::rethrow_exception(failure);
  }
  auto rt = std::make_shared<typename communicator<Backend>::runtime>();
  rt->backend = std::move(backend);
  rt->thread = std::move(thread);
  rt->rendezvous_store = std::move(s);
  co_return communicator<Backend>::make_world(std::move(rt), o.timeout);
}

// Both entry points end in rethrow_as_dcomm_error: every failure is fixed
// at its source to be a dcomm::error with context, and a raw
// std::system_error that still gets this far (a socket error on a path
// nobody foresaw) leaves as a dcomm::error naming the rank and the address,
// its original message kept.
template <backend Backend>
asio::awaitable<communicator<Backend>> init_from_method(init_options<Backend> o,
                                                        std::shared_ptr<io_thread> thread) {
  auto ex = co_await asio::this_coro::executor;
  error_context where{.operation = "init_process_group", .rank = o.rank, .address = o.init_method};
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
    auto world = co_await rendezvous(ex, std::move(ro), asio::use_awaitable);
    where.rank = world.rank;
    where.address = world.spec.address();
    joined = world.store;
    co_return co_await connect_world<Backend>(world.store, world.rank, world.world_size,
                                              world.spec.host, std::move(o), std::move(thread));
  } catch (...) {
    failure = std::current_exception();
  }
  failure = as_dcomm_error(failure, std::move(where));
  // Rank 0 hosts the store: the others learn why it leaves (leave_store).
  if (joined) co_await leave_store(joined, failure);
  std::rethrow_exception(failure);
}

template <backend Backend>
asio::awaitable<communicator<Backend>> init_from_store(std::shared_ptr<store> s, int rank,
                                                       int world, init_options<Backend> o,
                                                       std::shared_ptr<io_thread> thread) {
  error_context where{.operation = "init_process_group", .rank = rank, .address = s->address()};
  std::exception_ptr failure;
  try {
    rendezvous_options ro{.timeout = o.timeout, .job_token = o.job_token};
    co_await rendezvous(s, rank, world, std::move(ro), asio::use_awaitable);
    co_return co_await connect_world<Backend>(std::move(s), rank, world, "", std::move(o),
                                              std::move(thread));
  } catch (...) {
    failure = std::current_exception();
  }
  rethrow_as_dcomm_error(failure, std::move(where));
}

}  // namespace detail

// Joins the job named by o.init_method and connects to every rank. The
// backend runs on a strand of `executor`.
template <backend Backend, completion_token_for<communicator<Backend>> Token = default_token_t>
auto init_process_group(asio::any_io_executor executor, init_options<Backend> o,
                        Token&& token = {}) {
  asio::any_io_executor strand = detail::serial_executor(executor);
  auto limit = o.timeout * 2 + detail::blocking_grace;
  return detail::initiate(strand, detail::init_from_method<Backend>(std::move(o), nullptr),
                          std::forward<Token>(token), "init_process_group", limit);
}

// The blocking form for plain code: the backend gets an io thread of its own.
template <backend Backend>
communicator<Backend> init_process_group(init_options<Backend> o) {
  auto thread = std::make_shared<detail::io_thread>();
  auto limit = o.timeout * 2 + detail::blocking_grace;
  return detail::initiate(thread->get_executor(),
                          detail::init_from_method<Backend>(std::move(o), thread), blocking,
                          "init_process_group", limit);
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
