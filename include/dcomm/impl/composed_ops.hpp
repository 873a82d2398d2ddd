// Operations the front end composes of others (communicator.hpp is their
// surface): sendrecv (a send started as a request, the receive awaited,
// then the send), batch_isend_irecv (every operation checked, then all
// started), all_reduce_coalesced (the buffers packed into one all_reduce).
// Any backend with send, recv and all_reduce has them.
// Included at the end of communicator.hpp; not meant to be included alone.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/impl/communicator.hpp"

namespace dcomm::detail {

template <backend Backend>
class composed_ops : comm_ops<Backend> {
  using base = comm_ops<Backend>;
  using base::c_;
  using base::checks;
  using base::options;
  using base::rank;
  using base::recv;
  using base::send;
  using base::with_reducer;

 public:
  using comm = communicator<Backend>;
  explicit composed_ops(const comm& c) : base(c) {}

  // A send and a receive as one call: the send started (as a request),
  // the receive awaited, then the send; both checked before either starts.
  template <class Token>
  auto sendrecv(const_tensor_view in, int dst, tensor_view out, int src, int tag, op_options o,
                Token&& token, std::shared_ptr<void> keep = nullptr,
                std::exception_ptr refused = nullptr) const {
    o = options(o);
    auto bad = refused ? refused : check([&] {
      check_options<Backend>(operation::sendrecv, o);
      if ((dst == rank()) != (src == rank()))
        invalid(operation::sendrecv, "dst " + std::to_string(dst) + " and src " +
                                         std::to_string(src) +
                                         ": this rank must be both or neither (it would wait "
                                         "for itself)");
      if (dst != rank()) {
        checks().peer(dst, operation::sendrecv, in);
        checks().peer(src, operation::sendrecv, out);
      } else {
        checks().types(in, out, operation::sendrecv);
        if (in.count != out.count)
          throw_error(errc::mismatch,
                      {.operation = "sendrecv",
                       .expected = std::to_string(out.count) + " elements (the receive's)",
                       .seen = std::to_string(in.count) + " sent to this rank itself"});
      }
    });
    const auto limit = o.timeout.value_or(c_.group_->timeout) + blocking_grace;
    return initiate(c_.get_executor(),
                    sendrecv_op(c_, bad, in, dst, out, src, tag, o, std::move(keep)),
                    std::forward<Token>(token), "sendrecv", limit);
  }
  // The same buffer sent and received: what is sent is copied first (in
  // host memory: a device buffer is refused).
  template <class Token>
  auto sendrecv_replace(tensor_view buf, int dst, int src, int tag, op_options o,
                        Token&& token) const {
    auto refused = check([&] {
      if (buf.device.type != device::kind::cpu)
        invalid(operation::sendrecv,
                "sendrecv_replace copies what it sends in host memory: pass "
                "a host buffer (or sendrecv from another buffer)");
    });
    auto sent = std::make_shared<std::vector<std::byte>>(refused ? 0 : buf.bytes());
    if (!refused && buf.bytes()) std::memcpy(sent->data(), buf.data, buf.bytes());
    const_tensor_view copy{sent->data(), refused ? 0 : buf.count, buf.type, {}};
    return sendrecv(copy, dst, buf, src, tag, o, std::forward<Token>(token), std::move(sent),
                    refused);
  }

  std::vector<request> batch_isend_irecv(std::span<const p2p_op> list, op_options o) const {
    o = options(o);
    for (const auto& op : list) {
      const operation id = op.is_send ? operation::isend : operation::irecv;
      if (op.is_send)
        checks().peer(op.peer, id, op.send_buffer);
      else
        checks().peer(op.peer, id, op.recv_buffer);
      check_options<Backend>(id, o);
    }
    std::vector<request> started;
    started.reserve(list.size());
    for (const auto& op : list)
      started.push_back(
          op.is_send ? send(operation::isend, op.send_buffer, op.peer, op.tag, o, as_request)
                     : recv(operation::irecv, op.recv_buffer, op.peer, op.tag, o, as_request));
    return started;
  }

  // Packed into one buffer, reduced, unpacked: one sequence number.
  template <class Op, class Token>
  auto all_reduce_coalesced(std::vector<tensor_view> bufs, const Op& op, op_options o,
                            Token&& token) const {
    const dtype type = bufs.empty() ? dtype::uint8 : bufs.front().type;
    std::size_t total = 0;
    auto bad = check([&] {
      for (const auto& v : bufs) {
        checks().tensor(v, operation::all_reduce_coalesced);
        if (v.type != type)
          invalid(operation::all_reduce_coalesced,
                  "every buffer has one dtype: " + std::string(name(type)) + " and " +
                      std::string(name(v.type)));
        if (v.device.type != device::kind::cpu)
          invalid(operation::all_reduce_coalesced,
                  "the buffers are packed in host memory: "
                  "pass host tensors (or all_reduce each)");
        total += v.count;
      }
    });
    return this->template with_reducer<void>(
        operation::all_reduce_coalesced, op, type, bad, o, std::forward<Token>(token),
        [bufs = std::move(bufs), total, type](Backend& b, op_context c, reducer r) -> task<void> {
          std::vector<std::byte> packed(total * size_of(type));
          std::size_t at = 0;
          for (const auto& v : bufs) {
            if (v.bytes()) std::memcpy(packed.data() + at, v.data, v.bytes());
            at += v.bytes();
          }
          tensor_view all{packed.data(), total, type, {}};
          co_await b.all_reduce(c, all, all, r);
          at = 0;
          for (const auto& v : bufs) {
            if (v.bytes()) std::memcpy(v.data, packed.data() + at, v.bytes());
            at += v.bytes();
          }
        },
        trace::op_brief{.collective = true, .type = type, .count = total});
  }

 private:
  static asio::awaitable<void> sendrecv_op(comm self, std::exception_ptr bad, const_tensor_view in,
                                           int dst, tensor_view out, int src, int tag, op_options o,
                                           std::shared_ptr<void> keep) {
    // `keep`: what `in` points into, alive until the send is done.
    (void)keep;
    if (bad) std::rethrow_exception(bad);
    if (dst == self.rank()) {  // to and from itself: checked equal sizes
      if (in.bytes() && in.data != out.data) std::memmove(out.data, in.data, in.bytes());
      co_return;
    }
    base ops(self);
    request sent = ops.send(operation::sendrecv, in, dst, tag, o, as_request);
    std::exception_ptr failure;
    try {
      co_await ops.recv(operation::sendrecv, out, src, tag, o, asio::use_awaitable);
    } catch (...) {
      failure = std::current_exception();
    }
    try {
      co_await sent.async_wait(asio::use_awaitable);  // the send's buffer is free after it
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    if (failure) std::rethrow_exception(failure);
  }
};

}  // namespace dcomm::detail
