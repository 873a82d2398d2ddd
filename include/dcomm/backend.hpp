// What the communicator front end hands a backend: the group an operation
// runs on, its deadline and algorithm choice, and the reduction as a
// type-erased kernel. The Backend concept says which operations a backend
// model provides; a capability it lacks is a compile error in communicator,
// never a run-time "unsupported". Everything a backend's author needs is
// named here in namespace dcomm (task, use_task, op_context, ...): a backend
// can be written from this header without reaching into dcomm::detail.
#pragma once

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/completion.hpp"
#include "dcomm/detail/arrivals.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/operation.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/tensor.hpp"

// CUDA's stream type (cudaStream_t is CUstream_st*), declared here so that
// op_options can name a stream without including CUDA.
struct CUstream_st;

namespace dcomm {

// The coroutine type a backend's operations return: task<void>, or
// task<std::vector<std::size_t>> for the _v collectives. Its frames come
// from per-thread pools, so an operation allocates nothing once warm (an
// asio::awaitable frame per call would). It starts when awaited, passes
// results and exceptions through co_await, and can await other tasks:
//
//   dcomm::task<void> my_backend::send(dcomm::op_context c, dcomm::const_tensor_view in,
//                                      int peer) {
//     auto [ec, n] = co_await asio::async_write(
//         socket_of(peer), asio::buffer(in.data, in.bytes()), dcomm::use_task);
//     if (ec) dcomm::throw_error(dcomm::errc::peer_lost, {.operation = "send"});
//     co_await wait_for_ack(c, peer);  // another dcomm::task, bounded by c.deadline
//   }
//
// Arguments and locals of a task live in its frame until it ends. A
// failure is an exception (a dcomm::error naming the operation and peers);
// past c.deadline an operation fails with errc::timeout.
template <class T = void>
using task = detail::task<T>;

// The completion token that awaits an Asio operation inside a task. It
// completes with the operation's arguments as a tuple, error codes
// included: nothing is thrown for them. The task resumes on the I/O
// object's executor.
using use_task_t = detail::use_task_t;
using detail::use_task;

// Which algorithm a collective uses; automatic picks by size and world.
// Not every algorithm exists for every operation (docs/communicator.md).
enum class algorithm : std::uint8_t {
  automatic,
  direct,              // every rank exchanges with every other at once
  recursive_doubling,  // log2(world) rounds of pairwise exchange
  ring,                // chunked, pipelined ring (reduce-scatter + all-gather)
  binomial_tree,       // log2(world) levels below the root
  chain,               // pipelined chain through every rank from the root
  shared_memory,       // ranks of one host meet in its shared arena (tcp)
  hierarchical,        // inside each host, then between hosts, then inside again (tcp)
};

constexpr std::string_view name(algorithm a) noexcept {
  switch (a) {
    case algorithm::automatic:
      return "automatic";
    case algorithm::direct:
      return "direct";
    case algorithm::recursive_doubling:
      return "recursive_doubling";
    case algorithm::ring:
      return "ring";
    case algorithm::binomial_tree:
      return "binomial_tree";
    case algorithm::chain:
      return "chain";
    case algorithm::shared_memory:
      return "shared_memory";
    case algorithm::hierarchical:
      return "hierarchical";
  }
  return "unknown";
}

inline std::optional<algorithm> parse_algorithm(std::string_view s) {
  for (auto a : {algorithm::automatic, algorithm::direct, algorithm::recursive_doubling,
                 algorithm::ring, algorithm::binomial_tree, algorithm::chain,
                 algorithm::shared_memory, algorithm::hierarchical})
    if (name(a) == s) return a;
  return std::nullopt;
}

// Per-operation overrides (c10d's AllreduceOptions and friends, one
// aggregate for all): the group's default timeout unless set here.
struct op_options {
  std::optional<std::chrono::milliseconds> timeout{};
  dcomm::algorithm algorithm = dcomm::algorithm::automatic;
  // A cudaStream_t: run the operation stream-ordered on it (torch's async
  // op waited on a stream). It then completes once its GPU work is enqueued
  // there, after the stream's earlier work and before its later work.
  // Backends without streams (Backend::supports_streams false: tcp) refuse it.
  CUstream_st* stream = nullptr;
};

// The reduction a collective applies, type-erased for the backend:
// combine(inout, in, n) does inout[i] = op(inout[i], in[i]);
// combine_to(out, a, b, n) does out[i] = op(a[i], b[i]) (out overlapping
// neither), a pass over memory fewer than copying a to out and combining.
struct reducer {
  using combine_to_t = void (*)(const reducer& self, void* out, const void* a, const void* b,
                                std::size_t n);
  reduce_kind kind = reduce_kind::sum;
  dtype type = dtype::float32;
  void (*combine_fn)(const reducer& self, void* inout, const void* in, std::size_t n) = nullptr;
  const void* state = nullptr;           // the user's functor (custom ops)
  combine_to_t combine_to_fn = nullptr;  // optional: copy, then combine, without it

  void combine(void* inout, const void* in, std::size_t n) const {
    if (n) combine_fn(*this, inout, in, n);
  }
  void combine_to(void* out, const void* a, const void* b, std::size_t n) const {
    if (!n) return;
    if (combine_to_fn) return combine_to_fn(*this, out, a, b, n);
    std::memcpy(out, a, n * size_of(type));
    combine_fn(*this, out, b, n);
  }
  // avg is a sum divided once, at the end, by the number of ranks;
  // premul_sum a sum scaled once, at the end, by its factor.
  void finish(void* inout, std::size_t n, int ranks) const {
    if (kind == reduce_kind::avg && n) divide_by(type, inout, n, ranks);
    if (kind == reduce_kind::premul_sum && n) scale_by(type, inout, n, factor());
  }
  // premul_sum's factor (the op lives where the reducer was made).
  double factor() const {
    return kind == reduce_kind::premul_sum && state
               ? static_cast<const premul_sum_t*>(state)->factor
               : 1.0;
  }
};

namespace detail {
template <class T, class Op>
void typed_combine(const reducer& self, void* inout, const void* in, std::size_t n) {
  if constexpr (reduce_kind_of_v<Op> == reduce_kind::custom)
    reduce_into(*static_cast<const Op*>(self.state), static_cast<T*>(inout),
                static_cast<const T*>(in), n);
  else
    reduce_into(Op{}, static_cast<T*>(inout), static_cast<const T*>(in), n);
}

template <class T, class Op>
void typed_combine_to(const reducer& self, void* out, const void* a, const void* b, std::size_t n) {
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  if constexpr (reduce_kind_of_v<Op> == reduce_kind::custom)
    reduce_to(*static_cast<const Op*>(self.state), static_cast<T*>(out), x, y, n);
  else
    reduce_to(Op{}, static_cast<T*>(out), x, y, n);
}

inline void runtime_combine(const reducer& self, void* inout, const void* in, std::size_t n) {
  reduce_into(self.kind, self.type, inout, in, n);
}

inline void runtime_combine_to(const reducer& self, void* out, const void* a, const void* b,
                               std::size_t n) {
  reduce_to(self.kind, self.type, out, a, b, n);
}
}  // namespace detail

// A reducer for elements of type T; op must outlive it (custom functors are
// referenced, not copied).
template <class T, class Op>
reducer make_reducer(const Op& op) {
  check_reduce_op<T, Op>();
  using op_t = std::remove_cvref_t<Op>;
  return {reduce_kind_of_v<Op>, dtype_of_v<T>, &detail::typed_combine<T, op_t>, &op,
          &detail::typed_combine_to<T, op_t>};
}

// A reducer for a dtype known at run time (builtin ops only); op must
// outlive it (premul_sum's factor is referenced).
template <class Op>
reducer make_reducer(const Op& op, dtype type) {
  constexpr reduce_kind kind = reduce_kind_of_v<Op>;
  check_reduce_op(kind, type);
  return {kind, type, &detail::runtime_combine, &op, &detail::runtime_combine_to};
}

// A group of ranks as every backend sees it: its members as global ranks,
// this process's place in it, and the counter that numbers its collectives
// (every member calls them in the same order, so the numbers agree).
struct group_state {
  static constexpr std::uint64_t world_id = 0;  // the world group's id (impl/call_identity.hpp)
  std::uint64_t id = world_id;
  std::string name = "the world group";
  std::vector<int> ranks{};  // group rank -> global rank
  int rank = 0;              // this process's group rank
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  std::atomic<std::uint64_t> next_seq{0};
  std::atomic<std::uint64_t> children{0};  // groups made from this one
  std::atomic<std::uint64_t> agreements{0};  // agree calls: numbered apart from collectives

  int size() const { return static_cast<int>(ranks.size()); }
};

// Which transports carried an operation's data: a set, since a
// collective across hosts of several ranks each uses shared memory inside
// the hosts and TCP between them.
struct transports {
  static constexpr std::uint8_t tcp = 1, shm = 2, nccl = 4, mpi = 8;
  std::uint8_t bits = 0;

  // "tcp", "shm", "shm+tcp", "nccl", ...; "none" where no data moved (a
  // group of one).
  std::string names() const {
    std::string s;
    for (auto [bit, name] : {std::pair{shm, "shm"}, std::pair{tcp, "tcp"}, std::pair{nccl, "nccl"},
                             std::pair{mpi, "mpi"}})
      if (bits & bit) s += (s.empty() ? "" : "+") + std::string(name);
    return s.empty() ? "none" : s;
  }
};

// When the members of a collective called it, as far as this rank heard
// from the call's own messages: the first and last call's times (this
// rank's steady clock) and the world rank that called last
// (detail/arrivals.hpp says how it travels).
using call_arrivals = detail::arrivals;

// What a backend says of an operation it ran, through op_context::report
// (null: nobody asks): the front end's flight recorder, timeline and
// stats() read it once the operation ends. Each field may stay as it is.
struct op_report {
  transports carried{};
  dcomm::algorithm ran = dcomm::algorithm::automatic;  // automatic: not said
  call_arrivals arrivals{};                            // collectives
};

// One operation as the front end hands it over.
struct op_context {
  // The clock deadlines are measured on (std::chrono::steady_clock).
  using clock = detail::clock;

  std::shared_ptr<group_state> group{};
  // What the user called (a form such as broadcast_object reaches the
  // backend's broadcast under its own name): what the backend's errors name.
  dcomm::operation operation = dcomm::operation::send;
  std::uint64_t seq = 0;  // collectives: the group's sequence number; p2p: the tag
  clock::time_point deadline{};
  dcomm::algorithm algorithm = dcomm::algorithm::automatic;
  CUstream_st* stream = nullptr;  // op_options::stream
  clock::time_point issued{};     // when the call was made
  // Filled as the operation runs; valid until it completes (may be null).
  op_report* report = nullptr;
};

// Makes the output of the _v collectives once the counts are known:
// receives the element count from every rank, returns where to write.
using output_allocator = std::function<tensor_view(std::span<const std::size_t>)>;

// What communicator<Backend> needs from a backend. Every operation is a
// coroutine on the backend's executor (a dcomm::task: pooled frames, no
// allocation per operation); views are already validated. The concept
// names only public types.
//
// init_process_group also calls, to make one (not part of the concept, so
// that a backend made some other way can still be driven by communicator):
//   static asio::awaitable<std::shared_ptr<B>> create(
//       std::shared_ptr<dcomm::store> s, int rank, int world_size,
//       std::string job_token, std::string store_host, B::options o,
//       op_context::clock::time_point deadline);
// awaited on the strand the backend must then stay on; and, if B has it,
// std::vector<int> lost_peers() (ranks whose links were lost during
// start-up), to name a rank that died before the job began.
template <class B>
concept backend = requires {
  typename B::options;
  { B::name } -> std::convertible_to<std::string_view>;
  // Capabilities checked at compile time by the front end.
  { B::supports_custom_reduce } -> std::convertible_to<bool>;
  // Throws errc::invalid_argument if the operation has no such algorithm;
  // called before the call takes a sequence number.
  {B::check_algorithm(operation::all_reduce, algorithm::automatic)};
  { B::supports_bitwise_reduce } -> std::convertible_to<bool>;
  { B::supports_streams } -> std::convertible_to<bool>;
}
&&requires(B& b, const op_context& c, const_tensor_view in, tensor_view out, reducer r, int peer,
           output_allocator alloc, std::vector<std::size_t> counts,
           const std::shared_ptr<group_state>& group) {
  { b.get_executor() } -> std::convertible_to<asio::any_io_executor>;
  { b.rank() } -> std::convertible_to<int>;
  { b.world_size() } -> std::convertible_to<int>;
  {b.abort()};
  // The last communicator handle went away: release everything; call the
  // function (on the backend's executor) once nothing is in use any more.
  {b.close(std::function<void()>{})};
  // Throws errc::invalid_argument for a tensor the backend cannot take (host
  // memory for NCCL, device memory for tcp, a dtype it cannot carry); the
  // front end calls it before anything is sent.
  {b.check_tensor(in, "operation")};
  // A group was made from `parent` by new_group or split, in the same order
  // on every member of `parent`: `child` is null on ranks outside it. color
  // and key are split's (new_group: 0 and the group rank). Called on any
  // thread; backends that need a collective to make the group (NCCL's
  // ncclCommSplit) start it here, ordered before the group's first operation.
  {b.group_created(group, group, peer, peer)};
  { b.send(c, in, peer) } -> std::same_as<task<void>>;
  { b.recv(c, out, peer) } -> std::same_as<task<void>>;
  { b.barrier(c) } -> std::same_as<task<void>>;
  { b.broadcast(c, out, peer) } -> std::same_as<task<void>>;
  { b.reduce(c, in, out, r, peer) } -> std::same_as<task<void>>;
  { b.all_reduce(c, in, out, r) } -> std::same_as<task<void>>;
  { b.scatter(c, in, out, peer) } -> std::same_as<task<void>>;
  { b.gather(c, in, out, peer) } -> std::same_as<task<void>>;
  { b.all_gather(c, in, out) } -> std::same_as<task<void>>;
  { b.reduce_scatter(c, in, out, r) } -> std::same_as<task<void>>;
  { b.all_to_all(c, in, out) } -> std::same_as<task<void>>;
  { b.all_gather_v(c, in, alloc) } -> std::same_as<task<std::vector<std::size_t>>>;
  { b.all_to_all_v(c, in, counts, alloc) } -> std::same_as<task<std::vector<std::size_t>>>;
};

// What a backend offers for recovering from failures in place, apart from
// the concept (a communicator call a backend lacks is a compile error):
// revoke(group, why) fails the group's pending and later operations, and
// its descendants', on every member with errc::revoked (not collective,
// thread-safe, returns at once).
template <class B>
concept revocable_backend = requires(B& b, const std::shared_ptr<group_state>& g, std::string why) {
  {b.revoke(g, why)};
};

// What agree returns, the same on every member that returns: the AND of
// the flags it counted, and the members known failed when it was decided
// (group ranks, ascending).
struct agreement {
  bool flag = true;
  std::vector<int> failed{};
};

// agree(ctx, flag): fault-tolerant agreement among the group's live
// members (ctx.seq: the group's agreement number, group_state::agreements),
// also on a revoked group.
template <class B>
concept agreeing_backend = requires(B& b, const op_context& c, bool flag) {
  { b.agree(c, flag) } -> std::same_as<task<agreement>>;
};

// shrink: after an agreement, group_shrunk(parent, child) tells the
// backend of the survivors' group (on every survivor, in the same order):
// made from `parent`'s links, and not revoked with it.
template <class B>
concept shrinkable_backend = agreeing_backend<B> &&
    requires(B& b, const std::shared_ptr<group_state>& g) {
  {b.group_shrunk(g, g)};
};

}  // namespace dcomm
