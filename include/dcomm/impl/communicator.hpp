// The body of every communicator operation (communicator.hpp is its
// surface): the argument checks (impl/checks.hpp), the call's identity
// (impl/call_identity.hpp), then the backend's coroutine through
// impl/initiate.hpp. Each operation here takes views: the surface has turned
// the user's tensors into them and checked element types at compile time.
// Included at the end of communicator.hpp; not meant to be included alone.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/impl/call_identity.hpp"
#include "dcomm/impl/checks.hpp"
#include "dcomm/impl/initiate.hpp"

namespace dcomm::detail {

// A view of one communicator handle, made per call (three pointers' worth).
template <backend Backend>
class comm_ops {
 public:
  using comm = communicator<Backend>;
  explicit comm_ops(const comm& c) : c_(c) {}

  // ---------------------------------------------------------------- p2p

  template <class Token>
  auto send(operation id, const_tensor_view in, int dst, int tag, op_options o,
            Token&& token) const {
    o = options(o);
    auto bad = check([&] {
      checks().peer(dst, id, in);
      check_options<Backend>(id, o);
    });
    return launch<void>(
        c_.rt_, std::forward<Token>(token), bad, p2p_context(c_.group_, id, tag, o),
        [in, dst](Backend& b, op_context c) { return b.send(std::move(c), in, dst); },
        trace::op_brief{.collective = false, .type = in.type, .count = in.count, .peer = dst});
  }
  template <class Token>
  auto recv(operation id, tensor_view out, int src, int tag, op_options o, Token&& token) const {
    o = options(o);
    auto bad = check([&] {
      checks().peer(src, id, out);
      check_options<Backend>(id, o);
    });
    return launch<void>(
        c_.rt_, std::forward<Token>(token), bad, p2p_context(c_.group_, id, tag, o),
        [out, src](Backend& b, op_context c) { return b.recv(std::move(c), out, src); },
        trace::op_brief{.collective = false, .type = out.type, .count = out.count, .peer = src});
  }

  // -------------------------------------------------------- collectives

  template <class Token>
  auto barrier(op_options o, Token&& token) const {
    std::exception_ptr bad;
    return collective<void>(operation::barrier, o, bad, std::forward<Token>(token),
                            [](Backend& b, op_context c) { return b.barrier(std::move(c)); });
  }

  template <class Token>
  auto broadcast(tensor_view v, int root, op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().tensor(v, operation::broadcast);
      checks().rank_in_range(root, operation::broadcast, "root");
    });
    return collective<void>(
        operation::broadcast, o, bad, std::forward<Token>(token),
        [v, root](Backend& b, op_context c) { return b.broadcast(std::move(c), v, root); },
        brief(v, root));
  }

  template <class E, class Op, class Token>
  auto reduce(const_tensor_view in, tensor_view out, int root, const Op& op, op_options o,
              Token&& token) const {
    auto bad = check([&] {
      checks().rank_in_range(root, operation::reduce, "root");
      checks().tensor(in, operation::reduce);
      if (rank() == root) {
        checks().types(in, out, operation::reduce);
        if (in.count != out.count)
          invalid(operation::reduce, "the root's output has " + std::to_string(out.count) +
                                         " elements, its input " + std::to_string(in.count));
        checks().no_partial_overlap(in, out, operation::reduce, in.data == out.data);
      }
    });
    return with_reducer<E>(
        operation::reduce, op, in.type, bad, o, std::forward<Token>(token),
        [in, out, root](Backend& b, op_context c, reducer r) {
          return b.reduce(std::move(c), in, out, r, root);
        },
        brief(in, root));
  }

  template <class E, class Op, class Token>
  auto all_reduce(const_tensor_view in, tensor_view out, const Op& op, op_options o,
                  Token&& token) const {
    auto bad = check([&] {
      checks().types(in, out, operation::all_reduce);
      if (in.count != out.count)
        invalid(operation::all_reduce, "the output has " + std::to_string(out.count) +
                                           " elements, the input " + std::to_string(in.count));
      checks().no_partial_overlap(in, out, operation::all_reduce, in.data == out.data);
    });
    return with_reducer<E>(
        operation::all_reduce, op, out.type, bad, o, std::forward<Token>(token),
        [in, out](Backend& b, op_context c, reducer r) {
          return b.all_reduce(std::move(c), in, out, r);
        },
        brief(in));
  }

  template <class Token>
  auto scatter(const_tensor_view i, tensor_view w, int root, op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().rank_in_range(root, operation::scatter, "root");
      checks().types(i, w, operation::scatter);
      if (rank() == root) {
        checks().blocks(i, w.count, operation::scatter, "the root's input", "the output");
        checks().no_partial_overlap(i, w, operation::scatter,
                                    w.data == checks().own_block_start(i, w.count));
      }
    });
    return collective<void>(
        operation::scatter, o, bad, std::forward<Token>(token),
        [i, w, root](Backend& b, op_context c) { return b.scatter(std::move(c), i, w, root); },
        brief(w, root));
  }
  // Every rank passes size() blocks; rank r's block r is written.
  template <class Token>
  auto scatter_in_place(tensor_view v, int root, op_options o, Token&& token) const {
    return scatter(v, checks().own_block(v), root, o, std::forward<Token>(token));
  }

  template <class Token>
  auto gather(const_tensor_view i, tensor_view w, int root, op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().rank_in_range(root, operation::gather, "root");
      checks().types(i, w, operation::gather);
      if (rank() == root) {
        checks().blocks(w, i.count, operation::gather, "the root's output", "the input");
        checks().no_partial_overlap(i, w, operation::gather,
                                    i.data == checks().own_block_start(w, i.count));
      }
    });
    return collective<void>(
        operation::gather, o, bad, std::forward<Token>(token),
        [i, w, root](Backend& b, op_context c) { return b.gather(std::move(c), i, w, root); },
        brief(i, root));
  }
  // Rank r's contribution is block r of its buffer.
  template <class Token>
  auto gather_in_place(tensor_view v, int root, op_options o, Token&& token) const {
    return gather(checks().own_block(v), v, root, o, std::forward<Token>(token));
  }

  template <class Token>
  auto all_gather(const_tensor_view i, tensor_view w, op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().types(i, w, operation::all_gather);
      checks().blocks(w, i.count, operation::all_gather, "the output", "the input");
      checks().no_partial_overlap(i, w, operation::all_gather,
                                  i.data == checks().own_block_start(w, i.count));
    });
    return collective<void>(
        operation::all_gather, o, bad, std::forward<Token>(token),
        [i, w](Backend& b, op_context c) { return b.all_gather(std::move(c), i, w); }, brief(i));
  }
  template <class Token>
  auto all_gather_in_place(tensor_view v, op_options o, Token&& token) const {
    return all_gather(checks().own_block(v), v, o, std::forward<Token>(token));
  }

  template <class E, class Op, class Token>
  auto reduce_scatter(const_tensor_view i, tensor_view w, const Op& op, op_options o,
                      Token&& token) const {
    auto bad = check([&] {
      checks().types(i, w, operation::reduce_scatter);
      checks().blocks(i, w.count, operation::reduce_scatter, "the input", "the output");
      checks().no_partial_overlap(i, w, operation::reduce_scatter,
                                  w.data == checks().own_block_start(i, w.count));
    });
    return with_reducer<E>(
        operation::reduce_scatter, op, w.type, bad, o, std::forward<Token>(token),
        [i, w](Backend& b, op_context c, reducer r) {
          return b.reduce_scatter(std::move(c), i, w, r);
        },
        brief(i));
  }
  // The result is written to block r of the buffer.
  template <class E, class Op, class Token>
  auto reduce_scatter_in_place(tensor_view all, const Op& op, op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().tensor(all, operation::reduce_scatter);
      checks().multiple_of_size(all, operation::reduce_scatter);
    });
    const_tensor_view in = all;
    return with_reducer<E>(
        operation::reduce_scatter, op, all.type, bad, o, std::forward<Token>(token),
        [in, mine = checks().own_block(all)](Backend& b, op_context c, reducer r) {
          return b.reduce_scatter(std::move(c), in, mine, r);
        },
        brief(in));
  }

  template <class Token>
  auto all_to_all(const_tensor_view i, tensor_view w, op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().types(i, w, operation::all_to_all);
      if (i.count != w.count || i.count % static_cast<std::size_t>(size()) != 0)
        invalid(operation::all_to_all,
                "input and output must have the same size, a multiple of the group "
                "size " +
                    std::to_string(size()) + "; got " + std::to_string(i.count) + " and " +
                    std::to_string(w.count) + " elements");
      if (partly_overlaps(i.data, i.bytes(), w.data, w.bytes()) || (i.data == w.data && i.count))
        invalid(operation::all_to_all,
                "input and output overlap; use the one-buffer (in-place) form");
    });
    return collective<void>(
        operation::all_to_all, o, bad, std::forward<Token>(token),
        [i, w](Backend& b, op_context c) { return b.all_to_all(std::move(c), i, w); }, brief(i));
  }
  // Through a copy of the buffer: host memory is copied aside here; a
  // device backend gets in == out and keeps its own copy on the device.
  template <class Token>
  auto all_to_all_in_place(tensor_view v, op_options o, Token&& token) const {
    auto bad = check([&] { checks().tensor(v, operation::all_to_all); });
    std::shared_ptr<std::vector<std::byte>> copy;
    const_tensor_view i = v;
    if (!bad && v.device.type == device::kind::cpu) {
      copy = std::make_shared<std::vector<std::byte>>(
          static_cast<const std::byte*>(v.data), static_cast<const std::byte*>(v.data) + v.bytes());
      i.data = copy->data();
    }
    if (!bad) bad = check([&] { checks().multiple_of_size(v, operation::all_to_all); });
    return collective<void>(
        operation::all_to_all, o, bad, std::forward<Token>(token),
        [i, v, copy](Backend& b, op_context c) { return b.all_to_all(std::move(c), i, v); },
        brief(i));
  }

  template <class E, class Token>
  auto all_gather_v(const_tensor_view i, std::vector<E>& out, op_options o, Token&& token) const {
    auto bad = check([&] { checks().tensor(i, operation::all_gather_v); });
    output_allocator alloc = resizing(out);
    return collective<std::vector<std::size_t>>(
        operation::all_gather_v, o, bad, std::forward<Token>(token),
        [i, alloc](Backend& b, op_context c) { return b.all_gather_v(std::move(c), i, alloc); },
        brief(i));
  }

  template <class E, class Token>
  auto all_to_all_v(const_tensor_view i, std::vector<std::size_t> send_counts, std::vector<E>& out,
                    op_options o, Token&& token) const {
    auto bad = check([&] {
      checks().tensor(i, operation::all_to_all_v);
      if (send_counts.size() != static_cast<std::size_t>(size()))
        invalid(operation::all_to_all_v, "send_counts has " + std::to_string(send_counts.size()) +
                                             " entries; the group has " + std::to_string(size()) +
                                             " ranks");
      auto total = std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0});
      if (total != i.count)
        invalid(operation::all_to_all_v, "send_counts add up to " + std::to_string(total) +
                                             " elements; the input has " + std::to_string(i.count));
    });
    output_allocator alloc = resizing(out);
    return collective<std::vector<std::size_t>>(
        operation::all_to_all_v, o, bad, std::forward<Token>(token),
        [i, counts = std::move(send_counts), alloc](Backend& b, const op_context& c) {
          return b.all_to_all_v(c, i, counts, alloc);
        });
  }

  // ----------------------------------------------------------- recovery

  template <class Token>
  auto agree(bool flag, op_options o, Token&& token) const {
    o = options(o);
    auto bad = check([&] {
      check_options<Backend>(operation::agree, o);
      if (o.algorithm != algorithm::automatic)
        invalid(operation::agree, "agree has no algorithm to choose");
    });
    op_context ctx =
        bad ? p2p_context(c_.group_, operation::agree, 0, o) : agreement_context(c_.group_, o);
    // Not among the collectives in the flight recorder: its number is the
    // group's agreement count, not a collective's sequence number.
    return launch<agreement>(
        c_.rt_, std::forward<Token>(token), bad, std::move(ctx),
        [flag](Backend& b, const op_context& c) { return b.agree(c, flag); },
        trace::op_brief{.collective = false, .type = dtype::uint8, .count = 1});
  }

  template <class Token>
  auto shrink(op_options o, Token&& token) const {
    o = options(o);
    auto bad = check([&] {
      check_options<Backend>(operation::shrink, o);
      if (o.algorithm != algorithm::automatic)
        invalid(operation::shrink, "shrink has no algorithm to choose");
    });
    op_context ctx = bad ? p2p_context(c_.group_, operation::shrink, 0, o)
                         : agreement_context(c_.group_, o, operation::shrink);
    return launch<comm>(
        c_.rt_, std::forward<Token>(token), bad, std::move(ctx),
        [self = c_](Backend& b, const op_context& c) -> task<comm> {
          const agreement a = co_await b.agree(c, true);
          co_return comm_ops(self).join_shrunk(a, c.seq);
        },
        trace::op_brief{.collective = false, .type = dtype::uint8, .count = 1});
  }

  // ------------------------------------------------------------- groups

  std::optional<comm> new_group(std::vector<int> members) const {
    std::sort(members.begin(), members.end());
    for (std::size_t i = 0; i < members.size(); ++i) {
      checks().rank_in_range(members[i], operation::new_group, "member");
      if (i > 0 && members[i] == members[i - 1])
        invalid(operation::new_group, "rank " + std::to_string(members[i]) + " is listed twice");
    }
    if (members.empty()) invalid(operation::new_group, "a group needs at least one rank");
    const auto id = new_group_id(c_.group_->id, next_child_index(*c_.group_), members);
    std::vector<int> global;
    for (int m : members) global.push_back(c_.global_rank(m));
    auto me = std::find(members.begin(), members.end(), rank());
    std::shared_ptr<group_state> child;
    if (me != members.end())
      child = make_group_state(id, std::move(global), static_cast<int>(me - members.begin()));
    c_.rt_->backend->group_created(c_.group_, child, 0, child ? child->rank : 0);
    // What the backend queued for the group runs before the group's first
    // call, though blocking calls had the io thread parked (io_drive).
    if (c_.rt_->thread) c_.rt_->thread->drive().hand_back();
    if (!child) return std::nullopt;
    return comm(c_.rt_, c_.owner_, std::move(child));
  }

  template <class Token>
  auto split(int color, int key, op_options o, Token&& token) const {
    std::exception_ptr bad;
    auto ctx = context(operation::split, o, bad);
    const std::uint64_t index = bad ? 0 : next_child_index(*c_.group_);
    std::array<std::int64_t, 2> mine{color, key};
    return launch<std::optional<comm>>(
        c_.rt_, std::forward<Token>(token), bad, ctx,
        [self = c_, mine, index](Backend& b, const op_context& c) -> task<std::optional<comm>> {
          std::vector<std::int64_t> all(2 * static_cast<std::size_t>(self.size()));
          // Named, not temporaries in the co_await: g++ 12 destroys those twice.
          const_tensor_view in = view(mine);
          tensor_view out = mutable_view(all);
          co_await b.all_gather(c, in, out);
          co_return comm_ops(self).join_split(mine, all, index);
        });
  }

 protected:  // for object_ops and composed_ops (impl/object_collectives.hpp, composed_ops.hpp)
  // What every member learnt from split's all_gather: each rank's (color,
  // key); this rank's group, made in the same order everywhere.
  std::optional<comm> join_split(std::array<std::int64_t, 2> mine,
                                 const std::vector<std::int64_t>& all, std::uint64_t index) const {
    if (mine[0] < 0) {
      c_.rt_->backend->group_created(c_.group_, nullptr, -1, 0);
      return std::nullopt;
    }
    std::vector<std::pair<std::int64_t, int>> members;  // (key, group rank)
    for (int r = 0; r < size(); ++r)
      if (all[2 * static_cast<std::size_t>(r)] == mine[0])
        members.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
    std::sort(members.begin(), members.end());
    const auto id = split_group_id(c_.group_->id, index, mine[0]);
    std::vector<int> global;
    int my_rank = 0;
    for (auto& [k, r] : members) {
      if (r == rank()) my_rank = static_cast<int>(global.size());
      global.push_back(c_.global_rank(r));
    }
    auto child = make_group_state(id, std::move(global), my_rank);
    c_.rt_->backend->group_created(c_.group_, child, static_cast<int>(mine[0]), my_rank);
    return comm(c_.rt_, c_.owner_, std::move(child));
  }

  // The survivors' group, from agreement `number`'s decision: the members
  // not failed, renumbered in their old order.
  comm join_shrunk(const agreement& a, std::uint64_t number) const {
    std::vector<int> survivors;
    int my_rank = -1;
    for (int r = 0; r < size(); ++r) {
      if (std::binary_search(a.failed.begin(), a.failed.end(), r)) continue;
      if (r == rank()) my_rank = static_cast<int>(survivors.size());
      survivors.push_back(c_.global_rank(r));
    }
    if (my_rank < 0)
      throw_error(errc::peer_lost,
                  {.operation = "shrink",
                   .rank = c_.rt_->backend->rank(),
                   .peers = "ranks " + format_ranks(survivors),
                   .detail = "the survivors counted this rank failed (its links to them, or to "
                             "their coordinator, were lost): it is not in their group"});
    auto child =
        make_group_state(shrink_group_id(c_.group_->id, number, survivors), survivors, my_rank);
    c_.rt_->backend->group_shrunk(c_.group_, child);
    return comm(c_.rt_, c_.owner_, std::move(child));
  }

  int rank() const { return c_.group_->rank; }
  int size() const { return c_.group_->size(); }
  call_checks<Backend> checks() const { return {*c_.group_, *c_.rt_->backend}; }
  op_options options(const op_options& o) const { return effective_options(o, c_.defaults_); }

  // A collective's context: its options checked (unless its input already
  // was refused: `bad`), then numbered if accepted (impl/call_identity.hpp).
  op_context context(operation id, op_options o, std::exception_ptr& bad) const {
    o = options(o);
    if (!bad) bad = check([&] { check_options<Backend>(id, o); });
    return collective_context(c_.group_, id, o, bad != nullptr);
  }
  template <class R, class Token, class F>
  auto collective(operation id, const op_options& o, std::exception_ptr bad, Token&& token, F f,
                  const trace::op_brief& brief = {}) const {
    auto ctx = context(id, o, bad);
    return launch<R>(c_.rt_, std::forward<Token>(token), bad, std::move(ctx), std::move(f), brief);
  }
  static trace::op_brief brief(const const_tensor_view& v, int root = -1) {
    return {.collective = true, .type = v.type, .count = v.count, .peer = root};
  }

  // A reduction: its operator checked (at compile time where the element
  // type is known), then like any collective, with the reducer built in the
  // operation's own frame.
  template <class E, class Op, class Token, class F>
  auto with_reducer(operation id, const Op& op, dtype type, std::exception_ptr bad,
                    const op_options& o, Token&& token, F f,
                    const trace::op_brief& shape = {}) const {
    check_reduction_statically<E, Backend, Op>();
    if (!bad)
      bad = check([&] {
        if constexpr (std::is_void_v<E>) check_reduce_op(reduce_kind_of_v<Op>, type);
      });
    return collective<void>(
        id, o, bad, std::forward<Token>(token),
        [op, type, f](Backend& b, op_context c) {
          return run_reduction<E>(b, std::move(c), op, type, f);
        },
        shape);
  }

  // The _v forms' output: resized to the total once the counts are known.
  template <class E>
  static output_allocator resizing(std::vector<E>& out) {
    return [&out](std::span<const std::size_t> counts) {
      out.resize(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
      return mutable_view(out);
    };
  }

  std::shared_ptr<group_state> make_group_state(std::uint64_t id, std::vector<int> global,
                                                int my_rank) const {
    auto g = std::make_shared<group_state>();
    g->id = id;
    g->ranks = std::move(global);
    g->rank = my_rank;
    g->timeout = c_.group_->timeout;
    g->name = "group " + format_ranks(g->ranks);
    c_.rt_->recorder->name_group(g->id, g->name, g->ranks);
    if (c_.rt_->timeline) c_.rt_->timeline->name_group(g->id, g->name);
    return g;
  }

  const comm& c_;
};

}  // namespace dcomm::detail
