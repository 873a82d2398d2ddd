// Remote calls' bytes (dcomm/rpc.hpp): the codec every value goes through
// is dcomm's own (dcomm/codec.hpp, shared with the object collectives),
// named here too, so that `dcomm::rpc::codec<T>` and `dcomm::codec<T>` are
// the same template (either qualified spelling specialises it; an
// unqualified specialisation must be in namespace dcomm). What is the RPC
// layer's alone: the byte buffer of a call or a reply, what an argument
// travels as, and the name of a result.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dcomm/codec.hpp"

namespace dcomm::rpc {

using dcomm::attach_bytes;
using dcomm::codec;
using dcomm::payload_error;
using dcomm::reader;
using dcomm::signature;
using dcomm::tensor_in;
using dcomm::tensor_out;
using dcomm::writer;

// A call's or a reply's bytes.
using bytes = std::vector<std::uint8_t>;

// What an argument travels as: character strings as std::string, spans
// of a dtype as spans of const elements, the rest as themselves.
namespace wire_detail {
template <class T>
struct wire_type {
  using type = T;
};
template <>
struct wire_type<const char*> {
  using type = std::string;
};
template <>
struct wire_type<char*> {
  using type = std::string;
};
template <class T, std::size_t E>
struct wire_type<std::span<T, E>> {
  using type = std::span<const T>;
};
}  // namespace wire_detail
template <class T>
using wire_type = typename wire_detail::wire_type<std::decay_t<T>>::type;

// The name a call's result travels under ("void" for none).
template <class T>
std::string result_name() {
  if constexpr (std::is_void_v<T>)
    return "void";
  else
    return codec<std::remove_cvref_t<T>>::name();
}

}  // namespace dcomm::rpc
