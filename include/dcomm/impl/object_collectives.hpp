// The object collectives' machinery (object_collectives.hpp is their
// surface): a value's codec bytes, and the backend calls that carry them.
//
// broadcast_object, broadcast_object_list, gather_object and scatter_object
// first all_gather each rank's head, (size, fingerprint): the fingerprint
// hashes what the ranks must agree on (the codec's name, the root, a list's
// length), so every rank sees who differs and fails with errc::mismatch
// before any value moves; the size is what the second call needs (the
// root's for a broadcast; the largest, which pads every block, for gather
// and scatter, whose blocks must be equal). all_gather_object is one
// all_gather_v, each rank's bytes led by its fingerprint.
// Included at the end of communicator.hpp; not meant to be included alone.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/codec.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/error.hpp"
#include "dcomm/impl/communicator.hpp"
#include "dcomm/object_collectives.hpp"

namespace dcomm::detail {

// What the ranks of one object collective must agree on, hashed (FNV-1a,
// 62 bits: a head's fields are int64).
inline std::int64_t object_fingerprint(const std::string& type, int root, std::uint64_t extra) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto add = [&h](const void* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      h = (h ^ static_cast<const std::uint8_t*>(p)[i]) * 0x100000001b3ull;
  };
  add(type.data(), type.size());
  add(&root, sizeof root);
  add(&extra, sizeof extra);
  return static_cast<std::int64_t>(h >> 2);
}

// What a mismatch of fingerprints says: the ranks that differ from the
// root, and what this rank passed.
[[noreturn]] inline void objects_differ(operation op, const std::vector<int>& differ,
                                        const std::string& mine) {
  throw_error(errc::mismatch,
              {.operation = name(op),
               .peers = "ranks " + format_ranks(differ),
               .detail = "they passed another type, root or list length than this rank's " + mine});
}

// Each rank's (size, fingerprint), gathered: the size the second call needs
// (the largest), or errc::mismatch naming the ranks whose fingerprint is
// not the reference rank's.
template <backend Backend>
task<std::size_t> exchange_object_heads(Backend& b, op_context c, std::int64_t size,
                                        std::int64_t fingerprint, int reference, std::string mine) {
  const std::int64_t head[2] = {size, fingerprint};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(c.group->size()));
  const_tensor_view in = view(std::span<const std::int64_t>(head, 2));
  tensor_view out = mutable_view(all);
  co_await b.all_gather(c, in, out);
  std::vector<int> differ;
  std::int64_t largest = 0;
  const std::int64_t expected = all[2 * static_cast<std::size_t>(reference) + 1];
  for (std::size_t r = 0; r < all.size() / 2; ++r) {
    largest = std::max(largest, all[2 * r]);
    if (all[2 * r + 1] != expected) differ.push_back(static_cast<int>(r));
  }
  if (!differ.empty()) {
    if (all[2 * static_cast<std::size_t>(c.group->rank) + 1] != expected)
      differ = {reference};  // this rank is the odd one: name whom it differs from
    objects_differ(c.operation, differ, mine);
  }
  co_return static_cast<std::size_t>(largest);
}

template <class T>
std::vector<std::uint8_t> encode_object(const T& v) {
  std::vector<std::uint8_t> out;
  writer w(out);  // no tensor list: every array inline
  w(v);
  return out;
}

// Bytes that do not parse as T (a codec that writes what it does not
// read, or a value from a peer of another build): errc::mismatch.
template <class T>
T decode_object(const std::uint8_t* p, std::size_t n, operation op, int from) {
  T v{};
  try {
    reader r(p, n);
    r(v);
    if (r.left())
      throw payload_error(std::to_string(r.left()) + " bytes are left over after the value");
  } catch (const payload_error& e) {
    throw_error(errc::mismatch, {.operation = name(op),
                                 .peers = "rank " + std::to_string(from),
                                 .expected = "the bytes of a " + codec<T>::name(),
                                 .seen = std::to_string(n) + " bytes",
                                 .detail = e.what()});
  }
  return v;
}

// A block of gather_object and scatter_object: a value's length, its bytes,
// then padding to the largest.
inline void put_block(std::uint8_t* block, const std::vector<std::uint8_t>& bytes) {
  const std::uint64_t n = bytes.size();
  std::memcpy(block, &n, sizeof n);
  if (n) std::memcpy(block + sizeof n, bytes.data(), bytes.size());
}
template <class T>
T take_block(const std::uint8_t* block, std::size_t block_bytes, operation op, int from) {
  std::uint64_t n = 0;
  std::memcpy(&n, block, sizeof n);
  if (n > block_bytes - sizeof n)
    throw_error(errc::mismatch,
                {.operation = name(op),
                 .peers = "rank " + std::to_string(from),
                 .detail = "a block says it holds " + std::to_string(n) + " bytes of the " +
                           std::to_string(block_bytes) + " it has"});
  return decode_object<T>(block + sizeof n, static_cast<std::size_t>(n), op, from);
}

// The object collectives, over the operations' common machinery.
template <backend Backend>
class object_ops : comm_ops<Backend> {
  using base = comm_ops<Backend>;
  using base::c_;
  using base::checks;
  using base::context;
  using base::rank;
  using base::size;

 public:
  using comm = communicator<Backend>;
  explicit object_ops(const comm& c) : base(c) {}

  template <class T, class Token>
  auto broadcast_object(T& obj, int root, op_options o, Token&& token) const {
    return broadcast(obj, root, 0, operation::broadcast_object, o, std::forward<Token>(token));
  }

  template <class T, class Token>
  auto broadcast_object_list(std::vector<T>& list, int root, op_options o, Token&& token) const {
    return broadcast(list, root, list.size(), operation::broadcast_object_list, o,
                     std::forward<Token>(token));
  }

  template <class T, class Token>
  auto all_gather_object(const T& obj, op_options o, Token&& token) const {
    const std::string type = codec<T>::name();
    const std::int64_t fp = object_fingerprint(type, -1, 0);
    std::vector<std::uint8_t> bytes(sizeof fp);
    std::memcpy(bytes.data(), &fp, sizeof fp);
    auto bad = check([&] {
      const auto value = encode_object(obj);
      bytes.insert(bytes.end(), value.begin(), value.end());
    });
    auto ctx = context(operation::all_gather_object, o, bad);
    const trace::op_brief brief{.collective = true, .type = dtype::uint8, .count = bytes.size()};
    return launch<std::vector<T>>(
        c_.rt_, std::forward<Token>(token), bad, std::move(ctx),
        [bytes = std::move(bytes), fp, type](Backend& b,
                                             const op_context& c) -> task<std::vector<T>> {
          std::vector<std::uint8_t> all;
          const_tensor_view mine = view(bytes);
          output_allocator alloc = base::resizing(all);
          const auto counts = co_await b.all_gather_v(c, mine, alloc);
          std::vector<int> differ;
          std::size_t at = 0;
          for (std::size_t r = 0; r < counts.size(); at += counts[r], ++r) {
            std::int64_t theirs = 0;
            if (counts[r] >= sizeof theirs) std::memcpy(&theirs, all.data() + at, sizeof theirs);
            if (counts[r] < sizeof theirs || theirs != fp) differ.push_back(static_cast<int>(r));
          }
          if (!differ.empty()) objects_differ(c.operation, differ, type);
          std::vector<T> out;
          out.reserve(counts.size());
          at = 0;
          for (std::size_t r = 0; r < counts.size(); at += counts[r], ++r)
            out.push_back(decode_object<T>(all.data() + at + sizeof fp, counts[r] - sizeof fp,
                                           c.operation, static_cast<int>(r)));
          co_return out;
        },
        brief);
  }

  template <class T, class Token>
  auto gather_object(const T& obj, int root, op_options o, Token&& token) const {
    std::vector<std::uint8_t> bytes;
    auto bad = check([&] {
      checks().rank_in_range(root, operation::gather_object, "root");
      bytes = encode_object(obj);
    });
    auto ctx = context(operation::gather_object, o, bad);
    const std::uint64_t data_seq = bad ? 0 : take_sequence_number(*c_.group_);
    const trace::op_brief brief{
        .collective = true, .type = dtype::uint8, .count = bytes.size(), .peer = root};
    return launch<std::vector<T>>(
        c_.rt_, std::forward<Token>(token), bad, std::move(ctx),
        [bytes = std::move(bytes), root, data_seq](Backend& b,
                                                   const op_context& c) -> task<std::vector<T>> {
          const std::string type = codec<T>::name();
          const auto size = static_cast<std::int64_t>(bytes.size());
          const std::size_t largest = co_await exchange_object_heads(
              b, c, size, object_fingerprint(type, root, 0), root, type);
          const std::size_t block = sizeof(std::uint64_t) + largest;
          const bool is_root = c.group->rank == root;
          const auto n = static_cast<std::size_t>(c.group->size());
          std::vector<std::uint8_t> mine(block), all(is_root ? n * block : 0);
          put_block(mine.data(), bytes);
          op_context data = c;
          data.seq = data_seq;
          const_tensor_view in = view(mine);
          tensor_view out = mutable_view(all);
          co_await b.gather(data, in, out, root);
          std::vector<T> values;
          if (is_root)
            for (std::size_t r = 0; r < n; ++r)
              values.push_back(
                  take_block<T>(all.data() + r * block, block, c.operation, static_cast<int>(r)));
          co_return values;
        },
        brief);
  }

  template <class T, class Token>
  auto scatter_object(const std::vector<T>& in, int root, op_options o, Token&& token) const {
    std::vector<std::vector<std::uint8_t>> bytes;
    auto bad = check([&] {
      checks().rank_in_range(root, operation::scatter_object, "root");
      if (rank() != root) return;
      if (in.size() != static_cast<std::size_t>(size()))
        invalid(operation::scatter_object,
                "the root passes one value per rank: " + std::to_string(in.size()) +
                    " for a group of " + std::to_string(size()));
      for (const auto& v : in) bytes.push_back(encode_object(v));
    });
    auto ctx = context(operation::scatter_object, o, bad);
    const std::uint64_t data_seq = bad ? 0 : take_sequence_number(*c_.group_);
    return launch<T>(
        c_.rt_, std::forward<Token>(token), bad, std::move(ctx),
        [bytes = std::move(bytes), root, data_seq](Backend& b, const op_context& c) -> task<T> {
          const std::string type = codec<T>::name();
          std::size_t size = 0;
          for (const auto& v : bytes) size = std::max(size, v.size());
          const std::size_t largest = co_await exchange_object_heads(
              b, c, static_cast<std::int64_t>(size), object_fingerprint(type, root, 0), root, type);
          const std::size_t block = sizeof(std::uint64_t) + largest;
          std::vector<std::uint8_t> all(bytes.size() * block), mine(block);
          for (std::size_t r = 0; r < bytes.size(); ++r)
            put_block(all.data() + r * block, bytes[r]);
          op_context data = c;
          data.seq = data_seq;
          const_tensor_view from = view(all);
          tensor_view to = mutable_view(mine);
          co_await b.scatter(data, from, to, root);
          co_return take_block<T>(mine.data(), block, c.operation, root);
        },
        trace::op_brief{.collective = true, .type = dtype::uint8, .count = 0, .peer = root});
  }

 private:
  // broadcast_object and broadcast_object_list: `extra` is what the ranks
  // must also agree on (a list's length).
  template <class T, class Token>
  auto broadcast(T& obj, int root, std::uint64_t extra, operation id, op_options o,
                 Token&& token) const {
    std::vector<std::uint8_t> bytes;
    auto bad = check([&] {
      checks().rank_in_range(root, id, "root");
      if (rank() == root) bytes = encode_object(obj);
    });
    auto ctx = context(id, o, bad);
    const std::uint64_t data_seq = bad ? 0 : take_sequence_number(*c_.group_);
    const trace::op_brief brief{
        .collective = true, .type = dtype::uint8, .count = bytes.size(), .peer = root};
    return launch<void>(
        c_.rt_, std::forward<Token>(token), bad, std::move(ctx),
        [&obj, bytes = std::move(bytes), root, extra, data_seq](
            Backend& b, const op_context& c) mutable -> task<void> {
          const std::string type = codec<T>::name();
          const std::size_t n =
              co_await exchange_object_heads(b, c, static_cast<std::int64_t>(bytes.size()),
                                             object_fingerprint(type, root, extra), root, type);
          bytes.resize(n);
          op_context data = c;
          data.seq = data_seq;
          tensor_view payload = mutable_view(bytes);
          co_await b.broadcast(data, payload, root);
          if (c.group->rank != root) obj = decode_object<T>(bytes.data(), n, c.operation, root);
        },
        brief);
  }
};

}  // namespace dcomm::detail
