// The CPU backend: ranks of one host talk through shared memory, ranks of different hosts
// over TCP (a full mesh of authenticated sockets, one per pair of ranks, shared by every
// group); framed messages matched by group, tag or sequence number. Use it through
// communicator<cpu_backend> (communicator.hpp). Its parts are in cpu/ (the links and the
// algorithms) and shm/ (the host's segment): the start (cpu/startup/connect.hpp), the
// algorithms and the rule that picks one (cpu/algorithms/dispatch.hpp), the staging of CUDA tensors
// (cpu/staging.hpp), one call in progress (cpu/call.hpp) and the transport under it all
// (cpu/transport/transport.hpp). dcomm/tcp_backend.hpp keeps the name tcp_backend as an alias.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cpu/algorithms/dispatch.hpp"
#include "dcomm/cpu/backend_options.hpp"
#include "dcomm/cpu/call.hpp"
#include "dcomm/cpu/staging.hpp"
#include "dcomm/cpu/startup/connect.hpp"
#include "dcomm/cpu/transport/transport.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

class cpu_backend {
 public:
  static constexpr std::string_view name = "cpu";
  static constexpr bool supports_custom_reduce = true;
  static constexpr bool supports_bitwise_reduce = true;
  static constexpr bool supports_streams = false;

  // Per-backend options (cpu/backend_options.hpp has each one's meaning).
  using options = cpu::backend_options;

  // Connects to every peer through the store. Runs on (and stays on) the
  // executor it is awaited from, which must be a strand or a one-thread
  // context: the backend's state is not locked.
  DCOMM_EMIT_ON_USE static asio::awaitable<std::shared_ptr<cpu_backend>> create(
      std::shared_ptr<store> s, int rank, int world, std::string job_token, std::string store_host,
      options o, detail::clock::time_point deadline);

  cpu_backend(const cpu_backend&) = delete;
  cpu_backend& operator=(const cpu_backend&) = delete;

  const asio::any_io_executor& get_executor() const { return ex_; }
  int rank() const { return net_->rank(); }
  int world_size() const { return net_->world(); }
  // Whom the links closed so far blame (those that left in order, done,
  // aside): ranks that died, or the culprits named by ranks that left
  // because of them. On the backend's executor; start-up uses it to name a
  // rank that died before the job began.
  std::vector<int> lost_peers() const {
    std::vector<int> blamed;
    for (int p = 0; p < world_size(); ++p)
      if (p != rank() && net_->peer_lost(p) && !net_->left_in_order(p))
        blamed.push_back(net_->blame_for_loss(p));
    std::sort(blamed.begin(), blamed.end());
    blamed.erase(std::unique(blamed.begin(), blamed.end()), blamed.end());
    return blamed;
  }

  // How frames reach rank `peer` (a global rank, not this one): "shm"
  // (shared memory, a rank of this host) or "tcp". On the backend's
  // executor, or once start-up is over (links never change after).
  std::string_view link_to(int peer) const { return net_->link_name(peer); }
  // Bytes (headers included) written on the link to `peer`, and bytes read
  // from its memory in one copy (options::shm_single_copy); on the executor.
  std::uint64_t bytes_sent_to(int peer) const { return net_->bytes_sent_to(peer); }
  std::uint64_t bytes_read_directly_from(int peer) const {
    return net_->bytes_read_directly_from(peer);
  }

  // What DCOMM_LOG_LEVEL=info says of this rank's backend at start-up: the
  // host address it gave its peers, which link reaches which rank, whether the
  // world's collectives meet in the host's arena, the algorithm table in force
  // (cpu/algorithms/dispatch.hpp), the thresholds.
  std::string describe() const {
    std::vector<int> shm, tcp;
    for (int p = 0; p < world_size(); ++p)
      if (p != rank()) (net_->link_name(p) == "shm" ? shm : tcp).push_back(p);
    auto ranks = [](const std::vector<int>& v) {
      return v.empty() ? std::string("none") : "ranks " + detail::format_ranks(v);
    };
    group_state world;
    world.rank = rank();
    for (int p = 0; p < world_size(); ++p) world.ranks.push_back(p);
    return "reached at " + address_ + "; links: shared memory to " + ranks(shm) + ", tcp to " +
           ranks(tcp) + "; the world's collectives " +
           (world_size() > 1 && net_->arena_serves(world) ? "in the host's arena" : "by messages") +
           "; eager limit " + std::to_string(o_.eager_limit) + " B, chunk " +
           std::to_string(o_.chunk_bytes) + " B; algorithms: " + dispatch_.describe() +
           "; DCOMM_TRANSPORT=" + o_.transport.str() +
           (o_.algorithms.empty() ? "" : ", DCOMM_ALGO=" + o_.algorithms.str()) +
           (o_.confirm_rooted ? "" : ", rooted calls unconfirmed") +
           (o_.shm_single_copy ? ", single copy on" : "");
  }

  // Fails every pending and future operation at once; closes every link.
  // Thread-safe: runs on the backend's executor.
  void abort() {
    asio::dispatch(ex_, [net = net_] { net->abort(); });
  }
  // Start-up failed after the backend was made: goodbyes name the cause.
  void leave_start_up(std::exception_ptr failure) {
    asio::dispatch(ex_, [net = net_, failure] { net->leave_start_up(failure); });
  }
  // Called by the last communicator handle going away (not by the destructor,
  // which may run while the executor itself is being destroyed); `closed`
  // runs on the executor once every link is closed (its queued frames flushed).
  void close(std::function<void()> closed = {}) {
    asio::dispatch(
        ex_, [net = net_, closed = std::move(closed)]() mutable { net->close(std::move(closed)); });
  }

  // Refuses, before the call takes a sequence number, an algorithm the
  // operation does not have.
  static void check_algorithm(operation op, algorithm a) {
    if (auto why = cpu::refuse_algorithm(op, a); !why.empty())
      throw_error(errc::invalid_argument, {.operation = dcomm::name(op), .detail = why});
  }

  // Host memory, and CUDA tensors where the program includes dcomm/cuda.hpp:
  // those are staged through page-locked host memory (Gloo's way for GPUs
  // without NCCL's connectivity).
  void check_tensor(const const_tensor_view& v, const char* operation) const {
    if (v.device.type != device::kind::cpu && !detail::device_memory())
      throw_error(errc::invalid_argument,
                  {.operation = operation,
                   .expected = "a tensor in host memory",
                   .seen = "a CUDA tensor on device " + std::to_string(v.device.index),
                   .detail = "the CPU backend takes CUDA tensors only where the program includes "
                             "dcomm/cuda.hpp (Meson's dcomm_cuda); or use the nccl backend"});
  }
  // Groups share the mesh: the transport only learns the members, to whom
  // a revocation goes (cpu/transport/revocations.hpp).
  void group_created(const std::shared_ptr<group_state>& parent,
                     const std::shared_ptr<group_state>& child, int, int) {
    if (!child) return;
    asio::dispatch(ex_, [net = net_, parent = parent->id, id = child->id, name = child->name,
                         ranks = child->ranks, alive = std::weak_ptr<const void>(child)]() mutable {
      net->add_group(parent, id, std::move(name), std::move(ranks), std::move(alive));
    });
  }

  // communicator::shrink: the survivors' group, over the same links; a
  // root of its own (a revocation of `parent` does not reach it).
  void group_shrunk(const std::shared_ptr<group_state>&, const std::shared_ptr<group_state>& child) {
    asio::dispatch(ex_, [net = net_, id = child->id, name = child->name, ranks = child->ranks,
                         alive = std::weak_ptr<const void>(child)]() mutable {
      net->add_group(id, id, std::move(name), std::move(ranks), std::move(alive));
    });
  }

  // communicator::revoke: the group's pending and later operations, and
  // those of the groups made from it, fail on every member with
  // errc::revoked. Thread-safe: runs on the backend's executor.
  void revoke(const std::shared_ptr<group_state>& group, std::string why) {
    asio::dispatch(ex_, [net = net_, id = group->id, why = std::move(why)]() mutable {
      net->revoke(id, std::move(why));
    });
  }

  // communicator::agree (cpu/transport/agreements.hpp says how).
  DCOMM_EMIT_ON_USE detail::task<agreement> agree(op_context ctx, bool flag);

  // --- point to point ---
  DCOMM_EMIT_ON_USE detail::task<void> send(op_context ctx, const_tensor_view in, int peer);
  DCOMM_EMIT_ON_USE detail::task<void> recv(op_context ctx, tensor_view out, int peer);

  // --- collectives ---
  // Each runs a CUDA tensor slice by slice where it can (send, recv,
  // broadcast, reduce, all_reduce), else staged whole around the host form
  // of itself (cpu/staging.hpp); the host form meets in its group's arena or
  // runs a message algorithm, as the dispatch (cpu/algorithms/dispatch.hpp)
  // chooses.
  DCOMM_EMIT_ON_USE detail::task<void> barrier(op_context ctx);

  // `staged`: the host copy of a CUDA tensor (never in the arena: its call
  // starts late, out of the order the arena's calls keep).
  DCOMM_EMIT_ON_USE detail::task<void> broadcast(op_context ctx, tensor_view buf, int root,
                                                 bool staged = false);

  DCOMM_EMIT_ON_USE detail::task<void> reduce(op_context ctx, const_tensor_view in, tensor_view out,
                                              reducer op, int root, bool staged = false);

  DCOMM_EMIT_ON_USE detail::task<void> all_reduce(op_context ctx, const_tensor_view in,
                                                  tensor_view out, reducer op, bool staged = false);

  // in: n blocks (root only); out: one block.
  DCOMM_EMIT_ON_USE detail::task<void> scatter(op_context ctx, const_tensor_view in,
                                               tensor_view out, int root);

  // in: one block; out: n blocks (root only).
  DCOMM_EMIT_ON_USE detail::task<void> gather(op_context ctx, const_tensor_view in, tensor_view out,
                                              int root);

  DCOMM_EMIT_ON_USE detail::task<void> all_gather(op_context ctx, const_tensor_view in,
                                                  tensor_view out, bool staged = false);

  // in: n blocks; out: one block (may be in's block r).
  DCOMM_EMIT_ON_USE detail::task<void> reduce_scatter(op_context ctx, const_tensor_view in,
                                                      tensor_view out, reducer op);

  // in, out: n blocks each; they do not overlap (the in-place form, in ==
  // out, stages them apart; the communicator copies host tensors apart).
  DCOMM_EMIT_ON_USE detail::task<void> all_to_all(op_context ctx, const_tensor_view in,
                                                  tensor_view out);

  DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> all_gather_v(op_context ctx,
                                                                        const_tensor_view in,
                                                                        output_allocator alloc);

  DCOMM_EMIT_ON_USE detail::task<std::vector<std::size_t>> all_to_all_v(
      op_context ctx, const_tensor_view in, std::vector<std::size_t> send_counts,
      output_allocator alloc);

  const options& settings() const { return o_; }

 private:
  cpu_backend(asio::any_io_executor ex, std::shared_ptr<cpu::transport> net, options o,
              cpu::dispatcher dispatch)
      : ex_(std::move(ex)),
        net_(std::move(net)),
        o_(std::move(o)),
        dispatch_(std::move(dispatch)),
        staging_(ex_, o_.staging_slice, net_->rank()) {}

  static cpu::call_signature p2p_sig(dtype t, std::size_t count) {
    return {.op = operation::send, .type = t, .count = count};
  }
  // `arena`: the call runs in its group's arena; `slices`: of a CUDA tensor
  // staged slice by slice (0: not sliced).
  cpu::call_signature sig(const op_context& ctx, operation op, bool arena, dtype t = dtype::uint8,
                          std::size_t count = 0, int root = -1, const reducer* r = nullptr,
                          std::size_t slices = 0) const {
    return {.op = op,
            .type = t,
            .reduce = r ? r->kind : reduce_kind::sum,
            .has_reduce = static_cast<std::uint8_t>(r ? 1 : 0),
            .root = root,
            .count = count,
            .slices = static_cast<std::uint32_t>(slices),
            .algo = dispatch_.requested(op, ctx.algorithm),
            .confirmed =
                static_cast<std::uint8_t>(o_.confirm_rooted && cpu::needs_confirmation(op) ? 1 : 0),
            .arena = static_cast<std::uint8_t>(arena ? 1 : 0)};
  }

  // Whether the call meets in its group's arena (cpu::dispatcher::in_arena).
  bool in_arena(const op_context& ctx, operation op, std::size_t bytes) const {
    return dispatch_.in_arena(
        op, ctx.algorithm, bytes, [&] { return net_->arena_serves(*ctx.group); },
        dcomm::name(ctx.operation), rank());
  }

  asio::any_io_executor ex_;
  std::shared_ptr<cpu::transport> net_;
  options o_;
  cpu::dispatcher dispatch_;  // the algorithms, and which runs
  cpu::staging staging_;      // of CUDA tensors
  std::string address_;       // the one its peers were given
};

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::create(std::shared_ptr<store> s, int rank, int world,
                                                      std::string job_token, std::string store_host,
                                                      options o, detail::clock::time_point deadline)
    -> asio::awaitable<std::shared_ptr<cpu_backend>> {
  auto ex = co_await asio::this_coro::executor;
  cpu::dispatcher dispatch(o);  // DCOMM_ALGO refused before any connection
  const std::string bind = o.bind_host.str();
  cpu::mesh_options mesh{
      .purpose = "tcp_backend",  // the handshake's name for this mesh
      .job_token = std::move(job_token),
      .bind_host = bind,
      .advertise_host = cpu::advertised_address(ex, o.advertise_host.str(), bind, store_host)};
  std::string address = mesh.advertise_host;
  const cpu::shm_options shm{
      .links = cpu::parse_link_choice(o.transport),
      .sizes = cpu::checked({.ring_bytes = o.shm_ring_bytes, .slot_bytes = o.shm_slot_bytes}),
      .host_id = o.host_id.str()};
  auto net = co_await cpu::connect_transport(
      std::move(s), rank, world, std::move(mesh),
      {.eager_limit = o.eager_limit,
       .shm_spin = o.shm_spin,
       .shm_single_copy = o.shm_single_copy,
       .revoke_on_failure = o.revoke_on_failure},
      deadline, shm);
  auto b =
      std::shared_ptr<cpu_backend>(new cpu_backend(ex, std::move(net), o, std::move(dispatch)));
  b->address_ = std::move(address);
  co_return b;
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::agree(op_context ctx, bool flag)
    -> detail::task<agreement> {
  const group_state& g = *ctx.group;
  cpu::agreed_value v = co_await net_->agree(g.id, g.name, ctx.seq, g.ranks, g.rank, flag,
                                             dcomm::name(ctx.operation), ctx.deadline);
  co_return agreement{v.flag, std::move(v.failed)};
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::send(op_context ctx, const_tensor_view in, int peer)
    -> detail::task<void> {
  if (staging_.sliced(in)) {
    // One message; its data goes as the slices reach the host. It is
    // announced before anything is awaited: a later send with the same
    // tag must not overtake it.
    cpu::call c(*net_, ctx, false, p2p_sig(in.type, in.count));
    cpu::io_item* message = nullptr;
    co_await staging_.sliced_call(
        c, ctx.deadline, staging_.plan(in), in.data, nullptr, in.device.index,
        dcomm::name(ctx.operation),
        [&](char* host, std::size_t) { message = &c.send_staged(peer, 0, host, in.bytes()); },
        [&](const cpu::slice& s) -> detail::task<void> {
          c.ready(*message, s.end);
          co_return;
        });
    co_return;
  }
  if (cpu::staging::needed(in)) {
    co_await staging_.whole(in, {}, {}, [&](auto i, auto) { return send(ctx, i, peer); });
    co_return;
  }
  cpu::call c(*net_, ctx, false, p2p_sig(in.type, in.count));
  co_await c.run([&] { c.send(peer, 0, in.data, in.bytes()); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::recv(op_context ctx, tensor_view out, int peer)
    -> detail::task<void> {
  if (staging_.sliced(out)) {
    // Each slice goes to the device as soon as it has arrived.
    cpu::call c(*net_, ctx, false, p2p_sig(out.type, out.count));
    cpu::io_item* message = nullptr;
    co_await staging_.sliced_call(
        c, ctx.deadline, staging_.plan(out), nullptr, out.data, out.device.index,
        dcomm::name(ctx.operation),
        [&](char* host, std::size_t slice_bytes) {
          message = &c.recv_progress(peer, 0, host, out.bytes(), slice_bytes);
        },
        [&](const cpu::slice& s) -> detail::task<void> {
          co_await c.wait_until([&] { return message->arrived >= s.end || c.done(*message); });
        });
    co_return;
  }
  if (cpu::staging::needed(out)) {
    co_await staging_.whole({}, out, {}, [&](auto, auto o) { return recv(ctx, o, peer); });
    co_return;
  }
  cpu::call c(*net_, ctx, false, p2p_sig(out.type, out.count));
  co_await c.run([&] { c.recv(peer, 0, out.data, out.bytes()); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::barrier(op_context ctx) -> detail::task<void> {
  const bool arena = in_arena(ctx, operation::barrier, 0);
  cpu::call c(*net_, ctx, true, sig(ctx, operation::barrier, arena));
  if (arena && !c.state().failure) {  // (a failed call's run() never runs its body)
    // Three coroutine frames fewer where every rank arrives within one spin.
    cpu::arena_call a(c);
    if (!c.at_once([&] { return cpu::dispatcher::arena_barrier_at_once(a); }))
      co_await c.run([&] { return cpu::dispatcher::arena_barrier(a); });
    co_return;
  }
  co_await c.run([&] { return dispatch_.barrier(c); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::broadcast(op_context ctx, tensor_view buf, int root,
                                                         bool staged) -> detail::task<void> {
  const bool is_root = ctx.group->rank == root;
  if (staging_.sliced(buf) && ctx.group->size() > 1) {
    const cpu::slice_plan plan = staging_.plan(buf);
    cpu::call c(
        *net_, ctx, true,
        sig(ctx, operation::broadcast, false, buf.type, buf.count, root, nullptr, plan.slices));
    co_await staging_.sliced_call(
        c, ctx.deadline, plan, is_root ? buf.data : nullptr, is_root ? nullptr : buf.data,
        buf.device.index, dcomm::name(ctx.operation), cpu::staging::no_start,
        [&](const cpu::slice& s) { return dispatch_.broadcast(c, s.host, s.bytes(), root); });
    co_return;
  }
  if (cpu::staging::needed(buf)) {
    co_await staging_.whole({}, buf, {.initial = is_root},
                            [&](auto, auto b) { return broadcast(ctx, b, root, true); });
    co_return;
  }
  const bool arena = !staged && in_arena(ctx, operation::broadcast, buf.bytes());
  cpu::call c(*net_, ctx, true, sig(ctx, operation::broadcast, arena, buf.type, buf.count, root));
  co_await c.run([&]() -> detail::task<void> {
    if (arena)
      co_await cpu::dispatcher::arena_broadcast(c, buf.data, buf.bytes(), root);
    else if (c.size() > 1)
      co_await dispatch_.broadcast(c, buf.data, buf.bytes(), root);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::reduce(op_context ctx, const_tensor_view in,
                                                      tensor_view out, reducer op, int root,
                                                      bool staged) -> detail::task<void> {
  const bool in_place = in.data == out.data;
  if (staging_.sliced(in) && (in_place || staging_.sliced(out))) {
    const cpu::slice_plan plan = staging_.plan(in);
    cpu::call c(*net_, ctx, true,
                sig(ctx, operation::reduce, false, in.type, in.count, root, &op, plan.slices));
    // In place on a slice of the block: the result goes back to the
    // root's output, and to a non-root's buffer only if it is also its
    // input (which the host algorithm may have used).
    const bool back = ctx.group->rank == root || in_place;
    co_await staging_.sliced_call(
        c, ctx.deadline, plan, in.data, back ? out.data : nullptr, in.device.index,
        dcomm::name(ctx.operation), cpu::staging::no_start, [&](const cpu::slice& s) {
          return dispatch_.reduce(c, s.host, s.host, s.count, in.type, op, root);
        });
    co_return;
  }
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {.initial = ctx.group->rank != root, .in_place = in_place},
                            [&](auto i, auto o) { return reduce(ctx, i, o, op, root, true); });
    co_return;
  }
  const bool arena = !staged && in_arena(ctx, operation::reduce, in.bytes());
  cpu::call c(*net_, ctx, true, sig(ctx, operation::reduce, arena, in.type, in.count, root, &op));
  co_await c.run([&] {
    if (arena)
      return cpu::dispatcher::arena_reduce(c, in.data, out.data, in.count, in.type, op, root);
    return dispatch_.reduce(c, in.data, out.data, in.count, in.type, op, root);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::all_reduce(op_context ctx, const_tensor_view in,
                                                          tensor_view out, reducer op, bool staged)
    -> detail::task<void> {
  const bool in_place = in.data == out.data;
  if (staging_.sliced(out) && (in_place || staging_.sliced(in))) {
    const cpu::slice_plan plan = staging_.plan(out);
    cpu::call c(*net_, ctx, true,
                sig(ctx, operation::all_reduce, false, out.type, out.count, -1, &op, plan.slices));
    co_await staging_.sliced_call(
        c, ctx.deadline, plan, in.data, out.data, out.device.index, dcomm::name(ctx.operation),
        cpu::staging::no_start, [&](const cpu::slice& s) {
          return dispatch_.all_reduce(c, s.host, s.host, s.count, out.type, op);
        });
    co_return;
  }
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {.in_place = in_place},
                            [&](auto i, auto o) { return all_reduce(ctx, i, o, op, true); });
    co_return;
  }
  const bool arena = !staged && in_arena(ctx, operation::all_reduce, out.bytes());
  cpu::call c(*net_, ctx, true,
              sig(ctx, operation::all_reduce, arena, out.type, out.count, -1, &op));
  if (arena && !c.state().failure) {  // as barrier's
    using cpu::dispatcher;
    cpu::arena_call a(c);
    const std::size_t n = out.count;
    const dtype t = out.type;
    if (!c.at_once(
            [&] { return dispatcher::arena_all_reduce_at_once(a, in.data, out.data, n, t, op); }))
      co_await c.run(
          [&] { return dispatcher::arena_all_reduce(c, a, in.data, out.data, n, t, op); });
    co_return;
  }
  co_await c.run(
      [&] { return dispatch_.all_reduce(c, in.data, out.data, out.count, out.type, op); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::scatter(op_context ctx, const_tensor_view in,
                                                       tensor_view out, int root)
    -> detail::task<void> {
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {}, [&](auto i, auto o) { return scatter(ctx, i, o, root); });
    co_return;
  }
  cpu::call c(*net_, ctx, true, sig(ctx, operation::scatter, false, out.type, out.count, root));
  co_await c.run([&] { return dispatch_.scatter(c, in.data, out.data, out.bytes(), root); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::gather(op_context ctx, const_tensor_view in,
                                                      tensor_view out, int root)
    -> detail::task<void> {
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {.initial = ctx.group->rank != root},
                            [&](auto i, auto o) { return gather(ctx, i, o, root); });
    co_return;
  }
  cpu::call c(*net_, ctx, true, sig(ctx, operation::gather, false, in.type, in.count, root));
  co_await c.run([&] { return dispatch_.gather(c, in.data, out.data, in.bytes(), root); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::all_gather(op_context ctx, const_tensor_view in,
                                                          tensor_view out, bool staged)
    -> detail::task<void> {
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {},
                            [&](auto i, auto o) { return all_gather(ctx, i, o, true); });
    co_return;
  }
  const bool arena = !staged && in_arena(ctx, operation::all_gather, out.bytes());
  cpu::call c(*net_, ctx, true, sig(ctx, operation::all_gather, arena, in.type, in.count));
  co_await c.run([&] {
    if (arena) return cpu::dispatcher::arena_all_gather(c, in.data, out.data, in.bytes());
    return dispatch_.all_gather(c, in.data, out.data, in.count, in.type);
  });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::reduce_scatter(op_context ctx, const_tensor_view in,
                                                              tensor_view out, reducer op)
    -> detail::task<void> {
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {},
                            [&](auto i, auto o) { return reduce_scatter(ctx, i, o, op); });
    co_return;
  }
  cpu::call c(*net_, ctx, true,
              sig(ctx, operation::reduce_scatter, false, out.type, out.count, -1, &op));
  co_await c.run(
      [&] { return dispatch_.reduce_scatter(c, in.data, out.data, out.count, out.type, op); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::all_to_all(op_context ctx, const_tensor_view in,
                                                          tensor_view out) -> detail::task<void> {
  if (cpu::staging::needed(in, out)) {
    co_await staging_.whole(in, out, {}, [&](auto i, auto o) { return all_to_all(ctx, i, o); });
    co_return;
  }
  const std::size_t n = static_cast<std::size_t>(ctx.group->size());
  cpu::call c(*net_, ctx, true, sig(ctx, operation::all_to_all, false, in.type, in.count / n));
  co_await c.run([&] { return dispatch_.all_to_all(c, in.data, out.data, in.bytes() / n); });
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::all_gather_v(op_context ctx, const_tensor_view in,
                                                            output_allocator alloc)
    -> detail::task<std::vector<std::size_t>> {
  if (cpu::staging::needed(in))
    co_return co_await staging_.whole(
        in, {}, {}, [&](auto i, auto) { return all_gather_v(ctx, i, std::move(alloc)); });
  cpu::call c(*net_, ctx, true, sig(ctx, operation::all_gather_v, false, in.type, 0));
  std::vector<std::size_t> counts;
  co_await c.run(
      [&]() -> detail::task<void> { counts = co_await dispatch_.all_gather_v(c, in, alloc); });
  co_return counts;
}

DCOMM_EMIT_ON_USE_DEFINITION auto cpu_backend::all_to_all_v(op_context ctx, const_tensor_view in,
                                                            std::vector<std::size_t> send_counts,
                                                            output_allocator alloc)
    -> detail::task<std::vector<std::size_t>> {
  if (cpu::staging::needed(in))
    co_return co_await staging_.whole(in, {}, {}, [&](auto i, auto) {
      return all_to_all_v(ctx, i, std::move(send_counts), std::move(alloc));
    });
  cpu::call c(*net_, ctx, true, sig(ctx, operation::all_to_all_v, false, in.type, 0));
  std::vector<std::size_t> counts;
  co_await c.run([&]() -> detail::task<void> {
    counts = co_await dispatch_.all_to_all_v(c, in, send_counts, alloc);
  });
  co_return counts;
}

static_assert(backend<cpu_backend>);

}  // namespace dcomm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::create<void>(std::shared_ptr<store> s, int rank, int world, std::string job_token, std::string store_host, options o, detail::clock::time_point deadline) -> asio::awaitable<std::shared_ptr<cpu_backend>>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::agree<void>(op_context ctx, bool flag) -> detail::task<agreement>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::send<void>(op_context ctx, const_tensor_view in, int peer) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::recv<void>(op_context ctx, tensor_view out, int peer) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::barrier<void>(op_context ctx) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::broadcast<void>(op_context ctx, tensor_view buf, int root, bool staged) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::reduce<void>(op_context ctx, const_tensor_view in, tensor_view out, reducer op, int root, bool staged) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::all_reduce<void>(op_context ctx, const_tensor_view in, tensor_view out, reducer op, bool staged) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::scatter<void>(op_context ctx, const_tensor_view in, tensor_view out, int root) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::gather<void>(op_context ctx, const_tensor_view in, tensor_view out, int root) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::all_gather<void>(op_context ctx, const_tensor_view in, tensor_view out, bool staged) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::reduce_scatter<void>(op_context ctx, const_tensor_view in, tensor_view out, reducer op) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::all_to_all<void>(op_context ctx, const_tensor_view in, tensor_view out) -> detail::task<void>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::all_gather_v<void>(op_context ctx, const_tensor_view in, output_allocator alloc) -> detail::task<std::vector<std::size_t>>)
DCOMM_INSTANTIATE(auto dcomm::cpu_backend::all_to_all_v<void>(op_context ctx, const_tensor_view in, std::vector<std::size_t> send_counts, output_allocator alloc) -> detail::task<std::vector<std::size_t>>)
// clang-format on
// End of the separate-compilation block.
