// Every operation a communicator makes, by identity: the enum a backend is
// told (op_context::operation), the CPU backend's wire format and the MPI
// backend's call check carry, DCOMM_ALGO names, and whose name errors, the
// flight recorder and the statistics print. Its name is spelt here only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string_view>

namespace dcomm {

enum class operation : std::uint8_t {
  // Point to point. On the CPU backend's wire a message is a send's, so a
  // receive's signature names send too.
  send,
  recv,
  // The collectives a backend runs (the backend concept's members).
  barrier,
  broadcast,
  reduce,
  all_reduce,
  scatter,
  gather,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_gather_v,
  all_to_all_v,
  // Forms the communicator builds on those: their calls reach the backend
  // under these names, so that what fails is named as it was called.
  isend,                  // send, as a request
  irecv,                  // recv, as a request
  broadcast_object,       // an all_gather of (size, type), then a broadcast of the bytes
  all_gather_object,      // all_gather_v of the bytes
  gather_object,          // an all_gather of (size, type), then a gather of padded bytes
  scatter_object,         // the same, then a scatter of padded bytes
  broadcast_object_list,  // broadcast_object of a list every rank sizes alike
  sendrecv,               // a send and a receive at once (MPI_Sendrecv)
  all_reduce_coalesced,   // one all_reduce of several buffers, packed
  split,                  // all_gather of (color, key)
  // Recovery (docs/elastic.md): numbered apart from the collectives.
  agree,
  shrink,  // an agreement, then a group of the survivors
  // Without messages: their checks' errors name them.
  new_group,
  global_rank,
};

namespace detail {
inline constexpr const char* operation_names[] = {"send",
                                                  "recv",
                                                  "barrier",
                                                  "broadcast",
                                                  "reduce",
                                                  "all_reduce",
                                                  "scatter",
                                                  "gather",
                                                  "all_gather",
                                                  "reduce_scatter",
                                                  "all_to_all",
                                                  "all_gather_v",
                                                  "all_to_all_v",
                                                  "isend",
                                                  "irecv",
                                                  "broadcast_object",
                                                  "all_gather_object",
                                                  "gather_object",
                                                  "scatter_object",
                                                  "broadcast_object_list",
                                                  "sendrecv",
                                                  "all_reduce_coalesced",
                                                  "split",
                                                  "agree",
                                                  "shrink",
                                                  "new_group",
                                                  "global_rank"};
static_assert(std::size(operation_names) == static_cast<std::size_t>(operation::global_rank) + 1);
}  // namespace detail

// "all_reduce". A C string with static storage: records keep the pointer.
constexpr const char* name(operation op) noexcept {
  const auto i = static_cast<std::size_t>(op);
  return i < std::size(detail::operation_names) ? detail::operation_names[i] : "unknown operation";
}

// The operation named `text` ("all_gather_v"), if any.
constexpr std::optional<operation> parse_operation(std::string_view text) noexcept {
  for (std::size_t i = 0; i < std::size(detail::operation_names); ++i)
    if (text == detail::operation_names[i]) return static_cast<operation>(i);
  return std::nullopt;
}

// Every rank of the group takes part (all but send, recv and their request
// and sendrecv forms).
constexpr bool is_collective(operation op) noexcept {
  return op != operation::send && op != operation::recv && op != operation::isend &&
         op != operation::irecv && op != operation::sendrecv;
}

}  // namespace dcomm
