// A frame's payload and the tensors that travel beside it (rpc/codec.hpp).
//
// The payload ends with the tensors' table, so that its receiver can post
// their receives, straight into std::vectors of their dtypes, before it
// parses anything else:
//   payload = body, then per tensor {u8 dtype, 7 zero bytes, u64 count},
//             then the number of tensors (u32)
// and each tensor follows the payload as a message of its own, sent from
// where its elements are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcomm/dtype.hpp"
#include "dcomm/rpc/codec.hpp"

namespace dcomm::rpc::detail {

// What a rank sends: the sealed payload, its tensors, and what holds
// their elements until the frame is sent.
struct frame_out {
  bytes payload;
  std::vector<tensor_out> tensors;
  std::shared_ptr<const void> keep;

  std::uint64_t tensor_bytes() const {
    std::uint64_t n = 0;
    for (const auto& t : tensors) n += t.count * size_of(t.type);
    return n;
  }
  std::uint64_t total_bytes() const { return payload.size() + tensor_bytes(); }
};

// What a rank received: the payload's body and its tensors.
struct frame_in {
  bytes body;
  std::vector<tensor_in> tensors;
};

struct table_entry {
  std::uint8_t type;
  std::uint8_t zero[7];
  std::uint64_t count;
};
static_assert(sizeof(table_entry) == 16 && std::is_trivially_copyable_v<table_entry>);

// Appends the tensors' table to the payload.
inline void seal(frame_out& f) {
  for (const auto& t : f.tensors) {
    table_entry e{};
    e.type = static_cast<std::uint8_t>(t.type);
    e.count = t.count;
    const auto* p = reinterpret_cast<const std::uint8_t*>(&e);
    f.payload.insert(f.payload.end(), p, p + sizeof e);
  }
  const auto n = static_cast<std::uint32_t>(f.tensors.size());
  const auto* p = reinterpret_cast<const std::uint8_t*>(&n);
  f.payload.insert(f.payload.end(), p, p + sizeof n);
}

// A sealed frame of what write(writer&) writes; `keep` holds what its
// tensors point into.
template <class Write>
frame_out make_frame(Write&& write, std::shared_ptr<const void> keep = nullptr) {
  frame_out f;
  writer w(f.payload, &f.tensors);
  std::forward<Write>(write)(w);
  seal(f);
  f.keep = std::move(keep);
  return f;
}

// count elements of type t, zeroed, in a std::vector of that type.
inline tensor_in allocate_tensor(dtype t, std::uint64_t count) {
  return visit_dtype(t, [&]<class T>(std::type_identity<T>) {
    auto v = std::make_shared<std::vector<T>>(static_cast<std::size_t>(count));
    void* data = v->data();
    return tensor_in{t, count, std::move(v), data};
  });
}

// Splits a received payload into its body and its tensors, allocated for
// their receives. A table that does not parse, or tensors of more than
// max_bytes in all, throw payload_error before anything is allocated.
inline frame_in unseal(bytes payload, std::uint64_t max_bytes) {
  std::uint32_t n = 0;
  if (payload.size() < sizeof n) throw payload_error("a payload without its tensors' table");
  std::memcpy(&n, payload.data() + payload.size() - sizeof n, sizeof n);
  const std::size_t room = payload.size() - sizeof n;
  if (n > room / sizeof(table_entry))
    throw payload_error("a table of " + std::to_string(n) + " tensors in " + std::to_string(room) +
                        " bytes");
  const std::size_t table_at = room - n * sizeof(table_entry);
  std::vector<table_entry> table(n);
  if (n) std::memcpy(table.data(), payload.data() + table_at, n * sizeof(table_entry));
  std::uint64_t total = 0;
  for (const auto& e : table) {
    const std::size_t size = size_of(static_cast<dtype>(e.type));
    if (size == 0) throw payload_error("a tensor of dtype " + std::to_string(e.type));
    if (e.count > (max_bytes - total) / size)
      throw payload_error("tensors of more than " + std::to_string(max_bytes) + " bytes");
    total += e.count * size;
  }
  frame_in f;
  f.tensors.reserve(n);
  for (const auto& e : table)
    f.tensors.push_back(allocate_tensor(static_cast<dtype>(e.type), e.count));
  payload.resize(table_at);
  f.body = std::move(payload);
  return f;
}

// What a call to oneself hands its handler: the tensors copied (the
// caller's elements stay the caller's).
inline frame_in loopback(const frame_out& out) {
  frame_in in = unseal(out.payload, std::numeric_limits<std::uint64_t>::max());
  for (std::size_t i = 0; i < in.tensors.size(); ++i)
    if (const auto n = in.tensors[i].count * size_of(in.tensors[i].type))
      std::memcpy(in.tensors[i].data, out.tensors[i].data, static_cast<std::size_t>(n));
  return in;
}

}  // namespace dcomm::rpc::detail
