// The communicator's argument checks: everything a call is refused for
// before it takes a sequence number or sends anything. Each throws
// errc::invalid_argument naming the operation; check() turns that into the
// exception_ptr the call then completes with (through its token, never
// thrown from the initiating function).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "dcomm/backend.hpp"
#include "dcomm/error.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm::detail {

// Does [a, a+an) overlap [b, b+bn) other than being identical?
inline bool partly_overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  if (an == 0 || bn == 0) return false;
  return pa < pb + bn && pb < pa + an;
}

[[noreturn]] inline void invalid(operation op, std::string detail) {
  throw_error(errc::invalid_argument, {.operation = name(op), .detail = std::move(detail)});
}

// Runs the checks in f; their failure, or null.
template <class F>
std::exception_ptr check(F&& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// An out-of-place operation's input and output hold the same elements.
template <class In, class Out>
constexpr void same_element() {
  static_assert(std::is_same_v<element_t<In>, element_t<Out>>,
                "dcomm: input and output must have the same element type");
}

// What the backend cannot do with these options.
template <backend Backend>
void check_options(operation op, const op_options& o) {
  if (o.stream && !Backend::supports_streams)
    invalid(op, "op_options::stream is set, but the " + std::string(Backend::name) +
                    " backend has no streams; leave it null");
  Backend::check_algorithm(op, o.algorithm);
}

// The checks that need the group (its size, this rank) and the backend
// (which tensors it takes).
template <backend Backend>
class call_checks {
 public:
  call_checks(const group_state& group, Backend& backend) : g_(group), b_(backend) {}

  int rank() const { return g_.rank; }
  int size() const { return g_.size(); }

  void rank_in_range(int r, operation op, const char* what) const {
    if (r < 0 || r >= size())
      invalid(op, std::string(what) + " " + std::to_string(r) + " is out of range: the " +
                      (g_.id == 0 ? std::string("world") : g_.name) + " has " +
                      std::to_string(size()) + " ranks");
  }
  // Where the tensor lives and its dtype: the backend's call (host memory
  // for tcp, its own GPU for nccl).
  void tensor(const const_tensor_view& v, operation op) const { b_.check_tensor(v, name(op)); }
  void peer(int p, operation op, const const_tensor_view& v) const {
    tensor(v, op);
    rank_in_range(p, op, "peer");
    if (p == rank())
      invalid(op, "rank " + std::to_string(p) + " cannot send to or receive from itself");
  }
  void types(const const_tensor_view& in, const const_tensor_view& out, operation op) const {
    tensor(in, op);
    tensor(out, op);
    if (in.type != out.type)
      invalid(op, "input is " + std::string(name(in.type)) + ", output is " +
                      std::string(name(out.type)));
  }
  void blocks(const const_tensor_view& big, std::size_t block, operation op, const char* big_name,
              const char* block_name) const {
    if (big.count != block * static_cast<std::size_t>(size()))
      invalid(op, std::string(big_name) + " has " + std::to_string(big.count) +
                      " elements; it must hold " + std::to_string(size()) + " blocks of " +
                      block_name + "'s " + std::to_string(block));
  }
  void multiple_of_size(const const_tensor_view& v, operation op) const {
    if (v.count % static_cast<std::size_t>(size()) != 0)
      invalid(op, "the buffer's " + std::to_string(v.count) +
                      " elements are not a multiple of the group size " + std::to_string(size()));
  }
  // Where this rank's block lies in a buffer of size() blocks.
  const void* own_block_start(const const_tensor_view& big, std::size_t block) const {
    return static_cast<const char*>(big.data) +
           block * size_of(big.type) * static_cast<std::size_t>(rank());
  }
  // This rank's block of a buffer of size() blocks.
  tensor_view own_block(const tensor_view& v) const {
    auto block = v.count / static_cast<std::size_t>(size());
    return {const_cast<void*>(own_block_start(v, block)), block, v.type, v.device};
  }
  // In and out may coincide where the in-place form allows (exact_ok),
  // never partly overlap.
  static void no_partial_overlap(const const_tensor_view& a, const const_tensor_view& b,
                                 operation op, bool exact_ok) {
    if (exact_ok) return;
    if (partly_overlaps(a.data, a.bytes(), b.data, b.bytes()))
      invalid(op,
              "input and output overlap; only this rank's own block may be shared "
              "(the in-place form)");
  }

 private:
  const group_state& g_;
  Backend& b_;
};

}  // namespace dcomm::detail
