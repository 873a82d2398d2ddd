// The CPU backend over TCP: a full mesh of authenticated sockets (one per
// pair of ranks, shared by every group), framed messages matched by group,
// tag or sequence number, and the collective algorithms in tcp/algorithms/.
// Use it through communicator<tcp_backend> (communicator.hpp).
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/detail/device_memory.hpp"
#include "dcomm/tcp/algorithms/all_gather.hpp"
#include "dcomm/tcp/algorithms/all_reduce.hpp"
#include "dcomm/tcp/algorithms/all_to_all.hpp"
#include "dcomm/tcp/algorithms/barrier.hpp"
#include "dcomm/tcp/algorithms/broadcast.hpp"
#include "dcomm/tcp/call.hpp"
#include "dcomm/tcp/algorithms/gather.hpp"
#include "dcomm/tcp/algorithms/scatter.hpp"
#include "dcomm/tcp/algorithms/reduce.hpp"
#include "dcomm/tcp/algorithms/reduce_scatter.hpp"
#include "dcomm/tcp/transport.hpp"
#include "dcomm/tcp/tuning.hpp"
#include "dcomm/tcp/mesh.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm {

class tcp_backend {
 public:
  static constexpr std::string_view name = "tcp";
  static constexpr bool supports_custom_reduce = true;
  static constexpr bool supports_bitwise_reduce = true;
  static constexpr bool supports_streams = false;

  struct options {
    // Where this rank listens for its peers; empty: every interface.
    std::string bind_host = "";
    // The address peers use to reach this rank. Empty: $DCOMM_SOCKET_ADDR,
    // else the local address that routes to the store's host.
    std::string advertise_host = "";
    // Messages up to this size are sent at once; larger ones wait until
    // the receiver has posted its buffer, and land in it directly.
    std::size_t eager_limit = 64 * 1024;
    std::size_t chunk_bytes = 512 * 1024;
    std::size_t small_all_reduce = 64 * 1024;
    std::size_t small_broadcast = 256 * 1024;
    std::size_t small_all_gather = 64 * 1024;
    std::size_t small_reduce_scatter = 64 * 1024;
    // CUDA tensors larger than this go slice by slice in send, recv,
    // broadcast, reduce and all_reduce, their copies to and from the device
    // overlapped with the network; the other operations stage them whole.
    // A collective's ranks must agree: the same kind of tensor (host or
    // CUDA) and the same staging_slice, else the call fails with
    // errc::mismatch. Send and recv need not: slices are not seen on the wire.
    std::size_t staging_slice = 4 * 1024 * 1024;
    // Rooted operations (broadcast, reduce, scatter, gather) confirm that
    // every rank made the same call before any rank returns (a
    // dissemination of empty messages, log2(n) rounds beside the algorithm;
    // docs/communicator.md). Off: a root that only sends returns at once, as
    // in MPI, and a rank whose call differs is caught only where messages
    // arrive. Every rank must agree (else errc::mismatch).
    bool confirm_rooted = true;
    // Per-operation algorithm overrides, "all_reduce=ring,broadcast=chain".
    std::string algorithms = [] {
      const char* v = std::getenv("DCOMM_ALGO");
      return std::string(v ? v : "");
    }();
  };

  // Connects to every peer through the store. Runs on (and stays on) the
  // executor it is awaited from, which must be a strand or a one-thread
  // context: the backend's state is not locked.
  static asio::awaitable<std::shared_ptr<tcp_backend>> create(std::shared_ptr<store> s, int rank,
                                                              int world, std::string job_token,
                                                              std::string store_host, options o,
                                                              detail::clock::time_point deadline) {
    auto ex = co_await asio::this_coro::executor;
    auto overrides = tcp::parse_algorithm_overrides(o.algorithms);
    std::string advertise = o.advertise_host;
    if (advertise.empty())
      if (const char* v = std::getenv("DCOMM_SOCKET_ADDR"); v && *v) advertise = v;
    if (advertise.empty() && !o.bind_host.empty() && o.bind_host != "0.0.0.0" &&
        o.bind_host != "::")
      advertise = o.bind_host;
    if (advertise.empty()) advertise = detail::local_address_towards(ex, store_host);
    if (advertise.empty()) advertise = "127.0.0.1";
    tcp::mesh_options mesh{.purpose = "tcp_backend",
                              .job_token = std::move(job_token),
                              .bind_host = o.bind_host,
                              .advertise_host = advertise};
    auto sockets = co_await tcp::connect_mesh(s, rank, world, mesh, deadline);
    for (auto& socket : sockets)
      if (socket.is_open()) tune(socket);
    auto net = std::make_shared<tcp::transport>(
        ex, rank, world, std::move(sockets),
        tcp::transport_options{.eager_limit = o.eager_limit});
    net->start();
    co_return std::shared_ptr<tcp_backend>(new tcp_backend(ex, std::move(net), o, overrides));
  }

  tcp_backend(const tcp_backend&) = delete;
  tcp_backend& operator=(const tcp_backend&) = delete;
  // Closing is the communicator's job (its last handle calls close()); the
  // destructor may run while the executor itself is being destroyed.
  ~tcp_backend() = default;

  asio::any_io_executor get_executor() const { return ex_; }
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

  // Fails every pending and future operation at once; closes every link.
  // Thread-safe: runs on the backend's executor.
  void abort() {
    asio::dispatch(ex_, [net = net_] { net->abort(); });
  }
  // Called by the last communicator handle going away; `closed` runs on
  // the executor once every link is closed (its queued frames flushed).
  void close(std::function<void()> closed = {}) {
    asio::dispatch(
        ex_, [net = net_, closed = std::move(closed)]() mutable { net->close(std::move(closed)); });
  }

  // Refuses, before the call takes a sequence number, an algorithm the
  // operation does not have.
  static void check_algorithm(std::string_view operation, algorithm a) {
    if (auto why = tcp::refuse_algorithm(operation, a); !why.empty())
      throw_error(errc::invalid_argument, {.operation = std::string(operation), .detail = why});
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
                   .detail = "the tcp backend takes CUDA tensors only where the program includes "
                             "dcomm/cuda.hpp (Meson's dcomm_cuda); or use the nccl backend"});
  }
  // Groups share the mesh: nothing to set up.
  void group_created(const std::shared_ptr<group_state>&, const std::shared_ptr<group_state>&, int,
                     int) {}

  // --- point to point ---
  detail::task<void> send(op_context ctx, const_tensor_view in, int peer) {
    if (sliced(in)) {
      // One message; its data goes as the slices reach the host. It is
      // announced before anything is awaited: a later send with the same
      // tag must not overtake it.
      tcp::call c(*net_, ctx, false, p2p_sig(in.type, in.count), "send");
      tcp::io_item* message = nullptr;
      co_await sliced_call(
          c, ctx, slice_plan(in, o_.staging_slice), in.data, nullptr, in.device.index, "send",
          [&](char* host, std::size_t) { message = &c.send_staged(peer, 0, host, in.bytes()); },
          [&](const slice& s) -> detail::task<void> {
            c.ready(*message, s.end);
            co_return;
          });
      co_return;
    }
    if (detail::on_device(in)) {
      detail::host_staging st(pinned_);
      co_await send(ctx, st.in(in), peer);
      co_return;
    }
    tcp::call c(*net_, ctx, false, p2p_sig(in.type, in.count), "send");
    co_await c.run([&]() -> detail::task<void> {
      c.send(peer, 0, in.data, in.bytes());
      co_return;
    });
  }
  detail::task<void> recv(op_context ctx, tensor_view out, int peer) {
    if (sliced(out)) {
      // Each slice goes to the device as soon as it has arrived.
      tcp::call c(*net_, ctx, false, p2p_sig(out.type, out.count), "recv");
      tcp::io_item* message = nullptr;
      co_await sliced_call(
          c, ctx, slice_plan(out, o_.staging_slice), nullptr, out.data, out.device.index, "recv",
          [&](char* host, std::size_t slice_bytes) {
            message = &c.recv_progress(peer, 0, host, out.bytes(), slice_bytes);
          },
          [&](const slice& s) -> detail::task<void> {
            co_await c.wait_until([&] { return message->arrived >= s.end || c.done(*message); });
          });
      co_return;
    }
    if (detail::on_device(out)) {
      detail::host_staging st(pinned_);
      co_await recv(ctx, st.out(out, false), peer);
      st.copy_back();
      co_return;
    }
    tcp::call c(*net_, ctx, false, p2p_sig(out.type, out.count), "recv");
    co_await c.run([&]() -> detail::task<void> {
      c.recv(peer, 0, out.data, out.bytes());
      co_return;
    });
  }

  // --- collectives ---
  detail::task<void> barrier(op_context ctx) {
    tcp::call c(*net_, ctx, true, sig(ctx, tcp::coll_op::barrier),
                            "barrier");
    co_await c.run(
        [&]() -> detail::task<void> { co_await tcp::dissemination_barrier(c); });
  }

  detail::task<void> broadcast(op_context ctx, tensor_view buf, int root) {
    if (sliced(buf) && ctx.group->size() > 1) {
      using tcp::coll_op;
      const slice_plan plan(buf, o_.staging_slice);
      tcp::call c(
          *net_, ctx, true,
          sig(ctx, coll_op::broadcast, buf.type, buf.count, root, nullptr, plan.slices),
          "broadcast");
      const bool is_root = ctx.group->rank == root;
      co_await sliced_call(c, ctx, plan, is_root ? buf.data : nullptr, is_root ? nullptr : buf.data,
                           buf.device.index, "broadcast", no_start,
                           [&](const slice& s) -> detail::task<void> {
                             co_await broadcast_on(c, s.host, s.bytes(), root);
                           });
      co_return;
    }
    if (detail::on_device(buf)) {
      detail::host_staging st(pinned_);
      co_await broadcast(ctx, st.out(buf, ctx.group->rank == root), root);
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true,
                            sig(ctx, coll_op::broadcast, buf.type, buf.count, root), "broadcast");
    co_await c.run([&]() -> detail::task<void> {
      if (c.size() == 1) co_return;
      co_await broadcast_on(c, buf.data, buf.bytes(), root);
    });
  }

  detail::task<void> reduce(op_context ctx, const_tensor_view in, tensor_view out, reducer op,
                            int root) {
    const bool in_place = in.data == out.data;
    if (sliced(in) && (in_place || sliced(out))) {
      using tcp::coll_op;
      const slice_plan plan(in, o_.staging_slice);
      tcp::call c(*net_, ctx, true,
                              sig(ctx, coll_op::reduce, in.type, in.count, root, &op, plan.slices),
                              "reduce");
      // In place on a slice of the block: the result goes back to the
      // root's output, and to a non-root's buffer only if it is also its
      // input (which the host algorithm may have used).
      const bool back = ctx.group->rank == root || in_place;
      co_await sliced_call(c, ctx, plan, in.data, back ? out.data : nullptr, in.device.index,
                           "reduce", no_start, [&](const slice& s) -> detail::task<void> {
                             co_await reduce_on(c, s.host, s.host, s.count, in.type, op, root);
                           });
      co_return;
    }
    if (detail::on_device(in) || detail::on_device(out)) {
      detail::host_staging st(pinned_);
      auto host_out = st.out(out, in_place || ctx.group->rank != root);
      co_await reduce(ctx, in_place ? host_out : st.in(in), host_out, op, root);
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true,
                            sig(ctx, coll_op::reduce, in.type, in.count, root, &op), "reduce");
    co_await c.run([&]() -> detail::task<void> {
      co_await reduce_on(c, in.data, out.data, in.count, in.type, op, root);
    });
  }

  detail::task<void> all_reduce(op_context ctx, const_tensor_view in, tensor_view out, reducer op) {
    const bool in_place = in.data == out.data;
    if (sliced(out) && (in_place || sliced(in))) {
      using tcp::coll_op;
      const slice_plan plan(out, o_.staging_slice);
      tcp::call c(
          *net_, ctx, true,
          sig(ctx, coll_op::all_reduce, out.type, out.count, -1, &op, plan.slices), "all_reduce");
      co_await sliced_call(c, ctx, plan, in.data, out.data, out.device.index, "all_reduce",
                           no_start, [&](const slice& s) -> detail::task<void> {
                             co_await all_reduce_on(c, s.host, s.host, s.count, out.type, op);
                           });
      co_return;
    }
    if (detail::on_device(in) || detail::on_device(out)) {
      detail::host_staging st(pinned_);
      auto host_out = st.out(out, in_place);
      co_await all_reduce(ctx, in_place ? host_out : st.in(in), host_out, op);
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true,
                            sig(ctx, coll_op::all_reduce, out.type, out.count, -1, &op),
                            "all_reduce");
    co_await c.run([&]() -> detail::task<void> {
      co_await all_reduce_on(c, in.data, out.data, out.count, out.type, op);
    });
  }

  // in: n blocks (root only); out: one block.
  detail::task<void> scatter(op_context ctx, const_tensor_view in, tensor_view out, int root) {
    if (detail::on_device(in) || detail::on_device(out)) {
      detail::host_staging st(pinned_);
      auto host_in = st.in(in);
      co_await scatter(ctx, host_in, st.out(out, false), root);
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true, sig(ctx, coll_op::scatter, out.type, out.count, root),
                            "scatter");
    co_await c.run([&]() -> detail::task<void> {
      choose(c, coll_op::scatter, true);
      co_await tcp::direct_scatter(c, in.data, out.data, out.bytes(), root);
    });
  }

  // in: one block; out: n blocks (root only).
  detail::task<void> gather(op_context ctx, const_tensor_view in, tensor_view out, int root) {
    if (detail::on_device(in) || detail::on_device(out)) {
      detail::host_staging st(pinned_);
      auto host_in = st.in(in);
      co_await gather(ctx, host_in, st.out(out, ctx.group->rank != root), root);
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true, sig(ctx, coll_op::gather, in.type, in.count, root),
                            "gather");
    co_await c.run([&]() -> detail::task<void> {
      choose(c, coll_op::gather, true);
      co_await tcp::direct_gather(c, in.data, out.data, in.bytes(), root);
    });
  }

  detail::task<void> all_gather(op_context ctx, const_tensor_view in, tensor_view out) {
    if (detail::on_device(in) || detail::on_device(out)) {
      detail::host_staging st(pinned_);
      auto host_in = st.in(in);
      co_await all_gather(ctx, host_in, st.out(out, false));
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true, sig(ctx, coll_op::all_gather, in.type, in.count),
                            "all_gather");
    co_await c.run([&]() -> detail::task<void> {
      auto a = choose(c, coll_op::all_gather, out.bytes() <= o_.small_all_gather);
      if (a == algorithm::direct)
        co_await tcp::direct_all_gather(c, in.data, out.data, in.count,
                                                    size_of(in.type));
      else
        co_await tcp::ring_all_gather(c, in.data, out.data, in.count, size_of(in.type),
                                                  o_.chunk_bytes);
    });
  }

  // in: n blocks; out: one block (may be in's block r).
  detail::task<void> reduce_scatter(op_context ctx, const_tensor_view in, tensor_view out,
                                    reducer op) {
    if (detail::on_device(in) || detail::on_device(out)) {
      detail::host_staging st(pinned_);
      auto host_in = st.in(in);
      co_await reduce_scatter(ctx, host_in, st.out(out, false), op);
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true,
                            sig(ctx, coll_op::reduce_scatter, out.type, out.count, -1, &op),
                            "reduce_scatter");
    co_await c.run([&]() -> detail::task<void> {
      const std::size_t es = size_of(out.type);
      auto a = choose(c, coll_op::reduce_scatter, in.bytes() <= o_.small_reduce_scatter);
      if (a == algorithm::direct || c.size() == 1)
        co_await tcp::direct_reduce_scatter(c, in.data, out.data, out.count, es, op);
      else
        co_await tcp::ring_reduce_scatter(c, in.data, out.data, out.count, es, op,
                                                      o_.chunk_bytes);
    });
  }

  // in, out: n blocks each; they do not overlap.
  detail::task<void> all_to_all(op_context ctx, const_tensor_view in, tensor_view out) {
    if (detail::on_device(in) || detail::on_device(out)) {  // in == out: the in-place form
      detail::host_staging st(pinned_);
      auto host_in = st.in(in);
      co_await all_to_all(ctx, host_in, st.out(out, false));
      st.copy_back();
      co_return;
    }
    using tcp::coll_op;
    const std::size_t n = static_cast<std::size_t>(ctx.group->size());
    tcp::call c(*net_, ctx, true, sig(ctx, coll_op::all_to_all, in.type, in.count / n),
                            "all_to_all");
    co_await c.run([&]() -> detail::task<void> {
      choose(c, coll_op::all_to_all, true);
      co_await tcp::direct_all_to_all(c, in.data, out.data, in.bytes() / n);
    });
  }

  detail::task<std::vector<std::size_t>> all_gather_v(op_context ctx, const_tensor_view in,
                                                      output_allocator alloc) {
    if (detail::on_device(in)) {
      detail::host_staging st(pinned_);
      co_return co_await all_gather_v(ctx, st.in(in), std::move(alloc));
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true, sig(ctx, coll_op::all_gather_v, in.type, 0),
                            "all_gather_v");
    std::vector<std::size_t> counts;
    co_await c.run([&]() -> detail::task<void> {
      choose(c, coll_op::all_gather_v, true);
      counts = co_await tcp::direct_all_gather_v(c, in, alloc);
    });
    co_return counts;
  }

  detail::task<std::vector<std::size_t>> all_to_all_v(op_context ctx, const_tensor_view in,
                                                      std::vector<std::size_t> send_counts,
                                                      output_allocator alloc) {
    if (detail::on_device(in)) {
      detail::host_staging st(pinned_);
      co_return co_await all_to_all_v(ctx, st.in(in), std::move(send_counts), std::move(alloc));
    }
    using tcp::coll_op;
    tcp::call c(*net_, ctx, true, sig(ctx, coll_op::all_to_all_v, in.type, 0),
                            "all_to_all_v");
    std::vector<std::size_t> counts;
    co_await c.run([&]() -> detail::task<void> {
      choose(c, coll_op::all_to_all_v, true);
      counts = co_await tcp::direct_all_to_all_v(c, in, send_counts, alloc);
    });
    co_return counts;
  }

  const options& settings() const { return o_; }

 private:
  tcp_backend(asio::any_io_executor ex, std::shared_ptr<tcp::transport> net, options o,
              std::map<tcp::coll_op, algorithm> overrides)
      : ex_(std::move(ex)),
        net_(std::move(net)),
        o_(std::move(o)),
        overrides_(std::move(overrides)) {}

  static void tune(detail::ip_tcp::socket& socket) {
    asio::error_code ignored;
    socket.set_option(detail::ip_tcp::no_delay(true), ignored);
    // Generous buffers keep a large message flowing while the receiver is
    // busy reducing the previous chunk.
    socket.set_option(asio::socket_base::send_buffer_size(4 << 20), ignored);
    socket.set_option(asio::socket_base::receive_buffer_size(4 << 20), ignored);
  }

  static tcp::call_signature p2p_sig(dtype t, std::size_t count) {
    return {.op = tcp::coll_op::p2p, .type = t, .count = count};
  }
  // `slices`: of a CUDA tensor staged slice by slice (0: not sliced).
  tcp::call_signature sig(const op_context& ctx, tcp::coll_op op,
                                      dtype t = dtype::uint8, std::size_t count = 0, int root = -1,
                                      const reducer* r = nullptr, std::size_t slices = 0) const {
    return {.op = op,
            .type = t,
            .reduce = r ? r->kind : reduce_kind::sum,
            .has_reduce = static_cast<std::uint8_t>(r ? 1 : 0),
            .root = root,
            .count = count,
            .slices = static_cast<std::uint32_t>(slices),
            .algo = requested(ctx, op),
            .confirmed = static_cast<std::uint8_t>(
                o_.confirm_rooted && tcp::needs_confirmation(op) ? 1 : 0)};
  }
  // The algorithm asked for: by the call, else by DCOMM_ALGO.
  algorithm requested(const op_context& ctx, tcp::coll_op op) const {
    if (ctx.algorithm != algorithm::automatic) return ctx.algorithm;
    auto o = overrides_.find(op);
    return o == overrides_.end() ? algorithm::automatic : o->second;
  }

  // The algorithm asked for, or the table's pick by size. (The front end
  // refused the call before it started if the algorithm is not the op's.)
  static algorithm choose(tcp::call& c, tcp::coll_op op, bool small) {
    const auto& choice = tcp::algorithms_of(op);
    const algorithm a = c.signature().algo;
    if (a == algorithm::automatic) return small ? choice.small : choice.large;
    if (a != choice.small && a != choice.large)
      c.invalid(tcp::refuse_algorithm(tcp::name(op), a));
    return a;
  }
  // The host algorithms of the element-wise collectives, on whole buffers
  // or on one slice of a staged CUDA tensor.
  detail::task<void> broadcast_on(tcp::call& c, void* data, std::size_t bytes,
                                  int root) {
    using tcp::coll_op;
    auto a = choose(c, coll_op::broadcast, bytes <= o_.small_broadcast);
    if (a == algorithm::binomial_tree)
      co_await tcp::binomial_broadcast(c, data, bytes, root);
    else
      co_await tcp::chain_broadcast(c, data, bytes, root, o_.chunk_bytes);
  }
  detail::task<void> reduce_on(tcp::call& c, const void* in, void* out,
                               std::size_t count, dtype type, const reducer& op, int root) {
    using tcp::coll_op;
    const std::size_t es = size_of(type);
    auto a = choose(c, coll_op::reduce, count * es <= o_.small_broadcast);
    if (a == algorithm::binomial_tree || c.size() == 1)
      co_await tcp::binomial_reduce(c, in, out, count, es, op, root);
    else
      co_await tcp::chain_reduce(c, in, out, count, es, op, root, o_.chunk_bytes);
  }
  detail::task<void> all_reduce_on(tcp::call& c, const void* in, void* out,
                                   std::size_t count, dtype type, const reducer& op) {
    using tcp::coll_op;
    const std::size_t es = size_of(type);
    const bool in_place = in == out;
    auto a =
        choose(c, coll_op::all_reduce,
               count * es <= o_.small_all_reduce || count < static_cast<std::size_t>(c.size()));
    if (a == algorithm::recursive_doubling || c.size() == 1) {
      if (!in_place && count) std::memcpy(out, in, count * es);
      co_await tcp::recursive_doubling_all_reduce(c, out, count, es, op);
    } else {
      co_await tcp::ring_all_reduce(c, in_place ? nullptr : in, out, count, es, op,
                                                o_.chunk_bytes);
    }
  }

  // A CUDA tensor that goes slice by slice.
  bool sliced(const const_tensor_view& v) const {
    return detail::on_device(v) && v.bytes() > o_.staging_slice;
  }

  // Slice k, on the host: bytes [begin, end) of the tensor, at `host`.
  struct slice {
    char* host;
    std::size_t count;  // elements
    std::size_t begin, end;
    std::size_t bytes() const { return end - begin; }
  };
  // How a tensor is cut: slices of `slice_bytes` (whole elements), at most
  // 255 of them (a collective's slice k has steps k << 24).
  struct slice_plan {
    slice_plan(const const_tensor_view& v, std::size_t slice_bytes)
        : es(size_of(v.type)),
          count(v.count),
          per(std::max({slice_bytes / es, std::size_t{1}, (count + 254) / 255})),
          slices((count + per - 1) / per) {}
    // Slice k of a tensor whose host copy is at `block`.
    slice at(std::size_t k, char* block) const {
      const std::size_t begin = k * per * es, end = std::min(count, (k + 1) * per) * es;
      return {block + begin, (end - begin) / es, begin, end};
    }
    std::size_t es, count, per, slices;
  };
  static void no_start(char*, std::size_t) {}

  // One operation on a CUDA tensor, slice by slice within the one call `c`
  // (which it runs): all its input slices are queued to the copy thread at
  // once; start(block, slice_bytes) runs before anything is awaited (a
  // send or receive posts its one message there, so that it keeps its
  // order); each slice runs `body(slice)` in its part of a page-locked
  // block as soon as it is on the host, and its result is queued back to
  // the device at once, so copies in both directions overlap the network.
  // `src`: the device data this rank reads (null: none); `dst`: where its
  // result goes (null: nowhere). A collective's slices run its algorithm
  // with steps of their own (call::set_step_base).
  template <class Start, class Body>
  detail::task<void> sliced_call(tcp::call& c, const op_context& ctx,
                                 const slice_plan& plan, const void* src, void* dst, int device,
                                 const char* operation, Start start, Body body) {
    auto copies = std::make_shared<detail::copy_thread::batch>();
    // Back to the pool once no copy touches it; if this frame is destroyed
    // before (its executor went away mid-operation), the batch frees it
    // after the copy that may be running.
    struct lease {
      detail::pinned_blocks& pool;
      detail::pinned_blocks::block block;
      detail::copy_thread::batch& copies;
      bool given = false;
      void give() {
        pool.give(block);
        given = true;
      }
      ~lease() {
        if (!given) copies.adopt(block.data, detail::device_memory()->free_pinned);
      }
    } block{pinned_, pinned_.take(plan.count * plan.es), *copies};
    char* host = static_cast<char*>(block.block.data);
    std::size_t queued = 0;
    if (src)
      for (std::size_t k = 0; k < plan.slices; ++k, ++queued) {
        const slice s = plan.at(k, host);
        copies_.to_host(copies, s.host, static_cast<const char*>(src) + s.begin, s.bytes(), device);
      }
    std::exception_ptr failure;
    try {
      // run() waits for every message, sends from the block included, or
      // takes them all back on a failure, before it returns.
      co_await c.run([&]() -> detail::task<void> {
        start(host, plan.per * plan.es);
        for (std::size_t k = 0; k < plan.slices; ++k) {
          if (src) co_await copies_done(*copies, k + 1, ctx.deadline, operation);
          c.set_step_base(static_cast<std::uint32_t>(k << 24));
          const slice s = plan.at(k, host);
          co_await body(s);
          if (dst) {
            copies_.to_device(copies, static_cast<char*>(dst) + s.begin, s.host, s.bytes(), device);
            ++queued;
          }
        }
      });
      co_await copies_done(*copies, queued, ctx.deadline, operation);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      // Nothing may copy into or out of the block once it is given back:
      // skip what has not started and wait for the copy in progress (a
      // local copy; if even that does not end, the batch frees the block
      // after it).
      copies->cancelled.store(true, std::memory_order_release);
      try {
        co_await copies_done(*copies, queued, detail::clock::now() + std::chrono::seconds(10), operation,
                             false);
      } catch (...) {
        std::rethrow_exception(failure);  // the lease hands the block to the batch
      }
      block.give();
      std::rethrow_exception(failure);
    }
    block.give();
  }

  // Until `n` copies of the batch are done (or skipped); a failed copy is
  // rethrown unless `rethrow` is false.
  detail::task<void> copies_done(detail::copy_thread::batch& b, std::size_t n,
                                 detail::clock::time_point deadline, const char* operation,
                                 bool rethrow = true) {
    asio::steady_timer timer(ex_);
    b.waiter = &timer;
    struct unhook {
      detail::copy_thread::batch& b;
      ~unhook() { b.waiter = nullptr; }
    } guard{b};
    while (b.done < n) {
      if (rethrow && b.failure) std::rethrow_exception(b.failure);
      if (detail::clock::now() >= deadline)
        throw_error(errc::timeout, {.operation = operation,
                                    .rank = rank(),
                                    .detail = "the deadline passed while copying a slice of a "
                                              "CUDA tensor between host and device"});
      timer.expires_at(deadline);
      co_await timer.async_wait(detail::use_task);
    }
    if (rethrow && b.failure) std::rethrow_exception(b.failure);
  }

  asio::any_io_executor ex_;
  std::shared_ptr<tcp::transport> net_;
  options o_;
  std::map<tcp::coll_op, algorithm> overrides_;
  detail::pinned_blocks pinned_;  // staging for CUDA tensors
  // Copies of sliced CUDA tensors (its thread starts with the first one);
  // gone before the blocks it copies into.
  detail::copy_thread copies_{ex_};
};

static_assert(backend<tcp_backend>);

}  // namespace dcomm
