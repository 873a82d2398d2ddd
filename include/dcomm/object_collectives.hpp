// The object collectives: values of any type that has a codec
// (dcomm/codec.hpp: strings, the standard containers, optional, variant,
// pairs and tuples of those, trivially copyable structs, your own types),
// torch.distributed's *_object calls. A communicator has them
// (communicator.hpp); this header is their surface, impl/object_collectives.hpp
// their machinery.
//
//   std::map<std::string, int> vocab = rank == 0 ? load() : decltype(vocab){};
//   co_await comm.broadcast_object(vocab, 0);
//   auto all = co_await comm.all_gather_object(my_stats);    // std::vector<stats>
//
// What they check: every rank passes a value of the same type (the codec's
// name) and the same root (and, for broadcast_object_list, lists of the same
// length); where ranks differ, every rank fails with errc::mismatch before
// any value's bytes move. Sizes are exchanged first, so nothing is
// truncated. Bytes that do not parse as the type (a codec that writes what
// it does not read) fail with errc::mismatch on the ranks that read them.
// Nothing from the wire is run: a codec reads values, never code.
//
// Each takes two of the group's sequence numbers (the sizes and types, then
// the bytes; all_gather_object one) and has no algorithm to choose
// (op_options::algorithm must stay automatic).
#pragma once

#include <concepts>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/codec.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/request.hpp"

namespace dcomm {

// A value the object collectives carry: one with a codec, made empty
// before it is read.
template <class T>
concept object_value = std::default_initializable<T> &&
    requires(writer& w, reader& r, const T& in, T& out) {
  { codec<T>::name() } -> std::convertible_to<std::string>;
  codec<T>::write(w, in);
  codec<T>::read(r, out);
};

namespace detail {
template <backend Backend>
class object_ops;
}  // namespace detail

// A base of communicator<Backend> (Comm): its object collectives.
template <class Comm>
class object_collectives {
 public:
  // obj becomes the root's value on every rank (containers may change size).
  template <object_value T, op_token Token = default_token_t>
  auto broadcast_object(T& obj, int root, Token&& token = {}) const {
    return broadcast_object(obj, root, op_options{}, std::forward<Token>(token));
  }
  template <object_value T, op_token Token = default_token_t>
  auto broadcast_object(T& obj, int root, op_options o, Token&& token = {}) const {
    return ops().broadcast_object(obj, root, o, std::forward<Token>(token));
  }

  // torch's broadcast_object_list: every rank passes a list of the same
  // length (errc::mismatch otherwise), whose elements become the root's.
  template <object_value T, op_token Token = default_token_t>
  auto broadcast_object_list(std::vector<T>& list, int root, Token&& token = {}) const {
    return broadcast_object_list(list, root, op_options{}, std::forward<Token>(token));
  }
  template <object_value T, op_token Token = default_token_t>
  auto broadcast_object_list(std::vector<T>& list, int root, op_options o,
                             Token&& token = {}) const {
    return ops().broadcast_object_list(list, root, o, std::forward<Token>(token));
  }

  // Every rank's obj, in rank order, on every rank.
  template <object_value T, completion_token_for<std::vector<T>> Token = default_token_t>
  auto all_gather_object(const T& obj, Token&& token = {}) const {
    return all_gather_object(obj, op_options{}, std::forward<Token>(token));
  }
  template <object_value T, completion_token_for<std::vector<T>> Token = default_token_t>
  auto all_gather_object(const T& obj, op_options o, Token&& token = {}) const {
    return ops().all_gather_object(obj, o, std::forward<Token>(token));
  }

  // Every rank's obj, in rank order, on the root; an empty vector elsewhere.
  template <object_value T, completion_token_for<std::vector<T>> Token = default_token_t>
  auto gather_object(const T& obj, int root, Token&& token = {}) const {
    return gather_object(obj, root, op_options{}, std::forward<Token>(token));
  }
  template <object_value T, completion_token_for<std::vector<T>> Token = default_token_t>
  auto gather_object(const T& obj, int root, op_options o, Token&& token = {}) const {
    return ops().gather_object(obj, root, o, std::forward<Token>(token));
  }

  // torch's scatter_object_list: the root's in[i] is rank i's result. The
  // root passes size() values (errc::invalid_argument otherwise); the
  // others' `in` is not read (pass {}).
  template <object_value T, completion_token_for<T> Token = default_token_t>
  auto scatter_object(const std::vector<T>& in, int root, Token&& token = {}) const {
    return scatter_object(in, root, op_options{}, std::forward<Token>(token));
  }
  template <object_value T, completion_token_for<T> Token = default_token_t>
  auto scatter_object(const std::vector<T>& in, int root, op_options o, Token&& token = {}) const {
    return ops().scatter_object(in, root, o, std::forward<Token>(token));
  }

 private:
  template <class C = Comm>
  auto ops() const {
    return detail::object_ops<typename C::backend_type>(static_cast<const C&>(*this));
  }
};

}  // namespace dcomm
