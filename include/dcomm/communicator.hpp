// communicator<Backend>: what a torch.distributed user calls a process
// group, as awaitable operations.
//
//   auto comm = dcomm::init_process_group<dcomm::cpu_backend>(   // init_process_group.hpp
//       {.init_method = "env://", .timeout = 30s});
//   comm.all_reduce(grads, dcomm::avg, dcomm::blocking);     // plain call
//   co_await comm.all_reduce(grads, dcomm::avg);             // in a coroutine
//
// Every operation is an initiating function: its last argument is a
// completion token (default asio::use_awaitable; dcomm::blocking; a
// callback void(std::exception_ptr[, result]); asio::use_future; for
// operations without a result, dcomm::as_request). Every operation takes
// op_options before the token (timeout, algorithm, stream), and
// comm.with(options) gives a handle whose operations use them by default.
// Ranks are relative to the communicator's group. Input is checked before
// anything is sent; a bad call completes with errc::invalid_argument and
// takes no sequence number (impl/call_identity.hpp: what makes calls on
// different ranks match). A communicator is a cheap handle: copies share
// the group; the connections close when the last handle of the last group
// goes away.
//
// This header is the surface; the machinery is in impl/ (Asio's layout):
// impl/communicator.hpp (each operation's checks and launch),
// impl/initiate.hpp, impl/checks.hpp and impl/call_identity.hpp. The object
// collectives are a base of their own (object_collectives.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/error.hpp"
#include "dcomm/impl/call_identity.hpp"
#include "dcomm/impl/checks.hpp"
#include "dcomm/impl/initiate.hpp"
#include "dcomm/object_collectives.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/request.hpp"
#include "dcomm/tensor.hpp"

// A call given no completion token returns an asio::awaitable that does
// nothing until it is co_awaited: `comm.all_reduce(x, dcomm::sum);` alone in
// plain code would silently not reduce. Discarding such a value (it is
// [[nodiscard]]) is an error in every file that includes this header;
// define DCOMM_ALLOW_DISCARDED_RESULTS to leave it the compiler's warning.
#if !defined(DCOMM_ALLOW_DISCARDED_RESULTS) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC diagnostic error "-Wunused-result"
#endif

namespace dcomm {

// One operation of batch_isend_irecv (torch's P2POp): made by isend_op
// or irecv_op; the buffer must stay alive until its request is done.
struct p2p_op {
  bool is_send = true;
  const_tensor_view send_buffer{};
  tensor_view recv_buffer{};
  int peer = -1;
  int tag = 0;
};
template <tensor T>
p2p_op isend_op(const T& t, int peer, int tag = 0) {
  return {.is_send = true, .send_buffer = view(t), .peer = peer, .tag = tag};
}
template <mutable_tensor T>
p2p_op irecv_op(T&& t, int peer, int tag = 0) {
  return {.is_send = false, .recv_buffer = mutable_view(t), .peer = peer, .tag = tag};
}

namespace detail {
template <backend Backend>
class comm_ops;
template <backend Backend>
class composed_ops;
template <backend Backend>
struct elastic_access;
}  // namespace detail

template <backend Backend>
class communicator : public object_collectives<communicator<Backend>> {
  using ops_type = detail::comm_ops<Backend>;
  friend ops_type;
  friend class object_collectives<communicator>;  // object_collectives.hpp
  friend class detail::object_ops<Backend>;       // impl/object_collectives.hpp
  friend class detail::composed_ops<Backend>;     // impl/composed_ops.hpp
  friend struct detail::elastic_access<Backend>;  // grow (elastic.hpp)

 public:
  using backend_type = Backend;
  using runtime = detail::comm_runtime<Backend>;

  // An empty handle, to assign a real one to later (Asio needs one too).
  communicator() = default;
  bool valid() const { return rt_ != nullptr; }

  // This process's rank in the group, and the group's size.
  int rank() const { return group_->rank; }
  int size() const { return group_->size(); }
  // The members' ranks in the world group, in group rank order.
  std::span<const int> ranks() const { return group_->ranks; }
  int global_rank(int group_rank) const {
    detail::call_checks<Backend>(*group_, *rt_->backend)
        .rank_in_range(group_rank, operation::global_rank, "group rank");
    return group_->ranks[static_cast<std::size_t>(group_rank)];
  }
  std::chrono::milliseconds timeout() const { return group_->timeout; }
  asio::any_io_executor get_executor() const { return rt_->backend->get_executor(); }
  Backend& backend() const { return *rt_->backend; }

  // Fails every pending and future operation of every group at once.
  void abort() const {
    rt_->backend->abort();
    if (rt_->thread) rt_->thread->drive().hand_back();  // run at once (detail::io_drive)
  }

  // Revokes this group (ULFM's MPIX_Comm_revoke, NCCL's ncclCommRevoke):
  // every pending and later operation of it, and of the groups made from
  // it, fails on every member with errc::revoked, naming this rank and
  // `why`. Not collective: any one member may call it, and it returns at
  // once; the members learn it over their links, from whichever member
  // tells them first. What survives a revocation: docs/elastic.md.
  void revoke(std::string why = {}) const {
    static_assert(revocable_backend<Backend>,
                  "dcomm: this backend cannot revoke (the CPU backend can; MPI would need ULFM's "
                  "MPIX_Comm_revoke, NCCL's ncclCommRevoke is not mapped yet: docs/elastic.md)");
    if constexpr (revocable_backend<Backend>) {
      rt_->backend->revoke(group_, std::move(why));
      if (rt_->thread) rt_->thread->drive().hand_back();  // run at once, as abort()
    }
  }

  // Fault-tolerant agreement (ULFM's MPIX_Comm_agree): every live member
  // calls it; each that returns gets the same agreement, the AND of the
  // flags counted and the members known failed then (group ranks), also
  // when members die while it runs, and also on a revoked group. Members
  // must make their agree calls on a group in the same order (they are
  // numbered apart from the collectives). errc::timeout at the deadline,
  // naming the members not heard from. docs/elastic.md.
  template <completion_token_for<agreement> Token = default_token_t>
  auto agree(bool flag, Token&& token = {}) const {
    return agree(flag, op_options{}, std::forward<Token>(token));
  }
  template <completion_token_for<agreement> Token = default_token_t>
  auto agree(bool flag, op_options o, Token&& token = {}) const {
    static_assert(agreeing_backend<Backend>,
                  "dcomm: this backend cannot agree (the CPU backend can; MPI would need ULFM's "
                  "MPIX_Comm_agree, NCCL has none: docs/elastic.md)");
    if constexpr (agreeing_backend<Backend>)
      return ops().agree(flag, o, std::forward<Token>(token));
  }

  // The survivors' communicator (ULFM's MPIX_Comm_shrink, NCCL's
  // ncclCommShrink): an agreement among the live members (as agree), then
  // a group of those not failed, ranked in their old order, over the links
  // they already have. Works on a revoked group; the new group is not
  // revoked with it. Every live member calls it (in agree's order).
  template <completion_token_for<communicator> Token = default_token_t>
  auto shrink(Token&& token = {}) const {
    return shrink(op_options{}, std::forward<Token>(token));
  }
  template <completion_token_for<communicator> Token = default_token_t>
  auto shrink(op_options o, Token&& token = {}) const {
    static_assert(shrinkable_backend<Backend>,
                  "dcomm: this backend cannot shrink (the CPU backend can; MPI would need ULFM's "
                  "MPIX_Comm_shrink, NCCL's ncclCommShrink is not mapped yet: docs/elastic.md)");
    if constexpr (shrinkable_backend<Backend>) return ops().shrink(o, std::forward<Token>(token));
  }

  // Writes this process's flight recorder (its last operations, every
  // group's: trace/flight_recorder.hpp describes the format) to `path`.
  // A timeout, a lost peer, a mismatch or an abort writes it on its own to
  // $DCOMM_TRACE_DIR/dcomm-trace-rank<r>.json where that is set.
  void dump_trace(const std::string& path) const {
    rt_->recorder->dump(path, rt_->backend->rank(), rt_->backend->world_size(), "dump_trace");
  }
  // The same records, for a program's own use.
  std::vector<trace::op_record> trace_records() const { return rt_->recorder->snapshot(); }

  // Every group's calls of this process so far: per operation, calls,
  // failures, bytes, and time from the call to its end (mean and
  // quantiles, from one call in 16: trace/op_stats.hpp); per world rank,
  // how often it called a collective last and how long after the first
  // rank, measured from the calls' own messages (trace/stragglers.hpp).
  trace::comm_stats stats() const {
    trace::comm_stats s;
    s.operations = rt_->stats.summary();
    s.collectives_measured = rt_->stragglers.collectives_measured();
    s.ranks = rt_->stragglers.ranks();
    s.own_late_mean_us = rt_->stragglers.own_late_mean_us();
    return s;
  }

  // A handle to the same group whose operations use `o` where a call gives
  // no options of its own, field by field (a call's timeout, algorithm or
  // stream wins where it sets one; with() on such a handle adds to its
  // defaults the same way):
  //   co_await comm.with({.timeout = 5s}).all_reduce(grads, dcomm::avg);
  // An algorithm default is checked like a call's own: an operation that
  // lacks it is refused. Groups made from the handle (new_group, split)
  // start without these defaults.
  communicator with(op_options o) const {
    communicator c = *this;
    c.defaults_ = detail::effective_options(o, defaults_);
    return c;
  }
  const op_options& defaults() const { return defaults_; }

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
    return ops().send(operation::send, view(t), dst, tag, o, std::forward<Token>(token));
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
    return ops().recv(operation::recv, mutable_view(t), src, tag, o, std::forward<Token>(token));
  }

  // Start at once; the buffer must stay alive until the request is done.
  template <tensor T>
  request isend(const T& t, int dst, int tag = 0, op_options o = {}) const {
    return ops().send(operation::isend, view(t), dst, tag, o, as_request);
  }
  template <mutable_tensor T>
  request irecv(T&& t, int src, int tag = 0, op_options o = {}) const {
    return ops().recv(operation::irecv, mutable_view(t), src, tag, o, as_request);
  }

  // MPI_Sendrecv: sends send_buf to dst and receives recv_buf from src at
  // once, one tag for both (a ring's shift without the deadlock of
  // send-then-recv on every rank). dst and src may both be this rank (a
  // copy; sizes must match); one of them alone may not.
  template <tensor S, mutable_tensor R, completion_token_for Token = default_token_t>
  auto sendrecv(const S& send_buf, int dst, R&& recv_buf, int src, Token&& token = {}) const {
    return sendrecv(send_buf, dst, std::forward<R>(recv_buf), src, 0, op_options{},
                    std::forward<Token>(token));
  }
  template <tensor S, mutable_tensor R, completion_token_for Token = default_token_t>
  auto sendrecv(const S& send_buf, int dst, R&& recv_buf, int src, int tag, op_options o,
                Token&& token = {}) const {
    return composed().sendrecv(view(send_buf), dst, mutable_view(recv_buf), src, tag, o,
                               std::forward<Token>(token));
  }
  // MPI_Sendrecv_replace: sends buf's elements and receives into buf.
  template <mutable_tensor T, completion_token_for Token = default_token_t>
  auto sendrecv_replace(T&& buf, int dst, int src, Token&& token = {}) const {
    return sendrecv_replace(std::forward<T>(buf), dst, src, 0, op_options{},
                            std::forward<Token>(token));
  }
  template <mutable_tensor T, completion_token_for Token = default_token_t>
  auto sendrecv_replace(T&& buf, int dst, int src, int tag, op_options o,
                        Token&& token = {}) const {
    return composed().sendrecv_replace(mutable_view(buf), dst, src, tag, o,
                                       std::forward<Token>(token));
  }

  // torch's batch_isend_irecv: every operation checked first (a bad one
  // throws errc::invalid_argument and none starts), then all started at
  // once; their requests, in order (dcomm::wait_all, request.hpp).
  std::vector<request> batch_isend_irecv(std::span<const p2p_op> list, op_options o = {}) const {
    return composed().batch_isend_irecv(list, o);
  }

  // -------------------------------------------------------- collectives

  template <op_token Token = default_token_t>
  auto barrier(Token&& token = {}) const {
    return barrier(op_options{}, std::forward<Token>(token));
  }
  template <op_token Token = default_token_t>
  auto barrier(op_options o, Token&& token = {}) const {
    return ops().barrier(o, std::forward<Token>(token));
  }

  // Every rank's buffer ends up equal to the root's.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto broadcast(T&& buf, int root, Token&& token = {}) const {
    return broadcast(std::forward<T>(buf), root, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto broadcast(T&& buf, int root, op_options o, Token&& token = {}) const {
    return ops().broadcast(mutable_view(buf), root, o, std::forward<Token>(token));
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
    return ops().template reduce<element_t<T>>(v, v, root, op, o, std::forward<Token>(token));
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
    detail::same_element<In, Out>();
    return ops().template reduce<element_t<In>>(view(in), mutable_view(out), root, op, o,
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
    return ops().template all_reduce<element_t<T>>(v, v, op, o, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce(const In& in, Out&& out, const Op& op,
                                        Token&& token = {}) const {
    return all_reduce(in, std::forward<Out>(out), op, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce(const In& in, Out&& out, const Op& op, op_options o,
                                        Token&& token = {}) const {
    detail::same_element<In, Out>();
    return ops().template all_reduce<element_t<In>>(view(in), mutable_view(out), op, o,
                                                    std::forward<Token>(token));
  }

  // torch's all_reduce_coalesced: several buffers of one dtype reduced in
  // one call (packed into one; builtin ops). Host memory.
  template <class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto all_reduce_coalesced(std::span<const tensor_view> bufs, const Op& op,
                                                  op_options o = {}, Token&& token = {}) const {
    return composed().all_reduce_coalesced(std::vector<tensor_view>(bufs.begin(), bufs.end()), op,
                                           o, std::forward<Token>(token));
  }

  // torch's monitored_barrier: a barrier whose deadline is `timeout`; its
  // errc::timeout names every rank that had not come (wait_all_ranks=True
  // is how it always reports).
  template <op_token Token = default_token_t>
  auto monitored_barrier(std::chrono::milliseconds timeout, Token&& token = {}) const {
    return barrier(op_options{.timeout = timeout}, std::forward<Token>(token));
  }

  // in (root): size() blocks of out's size; block i goes to rank i.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto scatter(const In& in, Out&& out, int root, Token&& token = {}) const {
    return scatter(in, std::forward<Out>(out), root, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto scatter(const In& in, Out&& out, int root, op_options o, Token&& token = {}) const {
    detail::same_element<In, Out>();
    return ops().scatter(view(in), mutable_view(out), root, o, std::forward<Token>(token));
  }
  // In place: every rank passes size() blocks; rank r's block r is written.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto scatter(T&& buf, int root, Token&& token = {}) const {
    return scatter(std::forward<T>(buf), root, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto scatter(T&& buf, int root, op_options o, Token&& token = {}) const {
    return ops().scatter_in_place(mutable_view(buf), root, o, std::forward<Token>(token));
  }

  // out (root): size() blocks of in's size; block i comes from rank i.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto gather(const In& in, Out&& out, int root, Token&& token = {}) const {
    return gather(in, std::forward<Out>(out), root, op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto gather(const In& in, Out&& out, int root, op_options o, Token&& token = {}) const {
    detail::same_element<In, Out>();
    return ops().gather(view(in), mutable_view(out), root, o, std::forward<Token>(token));
  }
  // In place: rank r's contribution is block r of its buffer.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto gather(T&& buf, int root, Token&& token = {}) const {
    return gather(std::forward<T>(buf), root, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto gather(T&& buf, int root, op_options o, Token&& token = {}) const {
    return ops().gather_in_place(mutable_view(buf), root, o, std::forward<Token>(token));
  }

  // out: size() blocks of in's size, block i from rank i.
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto all_gather(const In& in, Out&& out, Token&& token = {}) const {
    return all_gather(in, std::forward<Out>(out), op_options{}, std::forward<Token>(token));
  }
  template <tensor In, mutable_tensor Out, op_token Token = default_token_t>
  auto all_gather(const In& in, Out&& out, op_options o, Token&& token = {}) const {
    detail::same_element<In, Out>();
    return ops().all_gather(view(in), mutable_view(out), o, std::forward<Token>(token));
  }
  // In place: rank r's contribution is block r of its buffer.
  template <mutable_tensor T, op_token Token = default_token_t>
  auto all_gather(T&& buf, Token&& token = {}) const {
    return all_gather(std::forward<T>(buf), op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto all_gather(T&& buf, op_options o, Token&& token = {}) const {
    return ops().all_gather_in_place(mutable_view(buf), o, std::forward<Token>(token));
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
    detail::same_element<In, Out>();
    return ops().template reduce_scatter<element_t<In>>(view(in), mutable_view(out), op, o,
                                                        std::forward<Token>(token));
  }
  // In place: the result is written to block r of the buffer.
  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce_scatter(T&& buf, const Op& op, Token&& token = {}) const {
    return reduce_scatter(std::forward<T>(buf), op, op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, class Op, op_token Token = default_token_t>
  requires(!tensor<Op>) auto reduce_scatter(T&& buf, const Op& op, op_options o,
                                            Token&& token = {}) const {
    return ops().template reduce_scatter_in_place<element_t<T>>(mutable_view(buf), op, o,
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
    detail::same_element<In, Out>();
    return ops().all_to_all(view(in), mutable_view(out), o, std::forward<Token>(token));
  }
  // In place (through a copy of the buffer).
  template <mutable_tensor T, op_token Token = default_token_t>
  auto all_to_all(T&& buf, Token&& token = {}) const {
    return all_to_all(std::forward<T>(buf), op_options{}, std::forward<Token>(token));
  }
  template <mutable_tensor T, op_token Token = default_token_t>
  auto all_to_all(T&& buf, op_options o, Token&& token = {}) const {
    return ops().all_to_all_in_place(mutable_view(buf), o, std::forward<Token>(token));
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
    return ops().all_gather_v(view(in), out, o, std::forward<Token>(token));
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
    return ops().all_to_all_v(view(in), std::move(send_counts), out, o, std::forward<Token>(token));
  }

  // ------------------------------------------------------------ objects
  // broadcast_object, broadcast_object_list, all_gather_object,
  // gather_object and scatter_object: object_collectives.hpp.

  // ------------------------------------------------------------- groups

  // A group of some of this group's ranks (group ranks, any order; the new
  // group numbers them in increasing order, like torch). Every member of
  // this group must call it, in the same order as its other new_group and
  // split calls; non-members get std::nullopt. Sends nothing, so it takes
  // no options; a bad list throws errc::invalid_argument.
  std::optional<communicator> new_group(std::vector<int> members) const {
    return ops().new_group(std::move(members));
  }

  // MPI_Comm_split: ranks passing the same color form a group, ordered by
  // (key, rank in this group); a negative color joins none (std::nullopt).
  // A collective on this group (no algorithm to choose).
  template <completion_token_for<std::optional<communicator>> Token = default_token_t>
  auto split(int color, int key, Token&& token = {}) const {
    return split(color, key, op_options{}, std::forward<Token>(token));
  }
  template <completion_token_for<std::optional<communicator>> Token = default_token_t>
  auto split(int color, int key, op_options o, Token&& token = {}) const {
    return ops().split(color, key, o, std::forward<Token>(token));
  }

  // -------------------------------------------------------- construction

  // For init_process_group: the world group over a connected backend.
  static communicator make_world(std::shared_ptr<runtime> rt, std::chrono::milliseconds timeout) {
    auto g = std::make_shared<group_state>();
    g->id = detail::world_group_id;
    g->rank = rt->backend->rank();
    for (int r = 0; r < rt->backend->world_size(); ++r) g->ranks.push_back(r);
    g->timeout = timeout;
    rt->recorder->name_group(g->id, g->name, g->ranks);
    if (rt->timeline) rt->timeline->name_group(g->id, g->name);
    rt->stragglers.set_world(rt->backend->world_size(), rt->backend->rank());
    auto owner = std::shared_ptr<closer>(new closer{rt});
    return communicator(std::move(rt), std::move(owner), std::move(g));
  }

 private:
  using closer = detail::comm_closer<Backend>;

  communicator(std::shared_ptr<runtime> rt, std::shared_ptr<closer> owner,
               std::shared_ptr<group_state> g)
      : rt_(std::move(rt)), owner_(std::move(owner)), group_(std::move(g)) {}

  ops_type ops() const { return ops_type(*this); }
  detail::composed_ops<Backend> composed() const { return detail::composed_ops<Backend>(*this); }

  std::shared_ptr<runtime> rt_;
  std::shared_ptr<closer> owner_;
  std::shared_ptr<group_state> group_;
  op_options defaults_{};  // with()'s
};

}  // namespace dcomm

#include "dcomm/impl/communicator.hpp"
#include "dcomm/impl/composed_ops.hpp"
#include "dcomm/impl/object_collectives.hpp"
