// The wire protocol of c10d's TCPStore (torch.distributed.TCPStore), as
// c10d_store.hpp speaks it to a server that torch runs: torchrun's agent
// store (TORCHELASTIC_USE_AGENT_STORE=True), Kubeflow's PyTorchJob, or a
// TCPStore a Python program started.
//
// Requests are a query byte and arguments; replies carry no status and no
// id, so a connection carries one request at a time. Native byte order
// (little-endian on every host torch supports); sizes are 8 bytes:
//   string / value:  u64 size | bytes
//   key list:        u64 count | that many strings
//
//   query         arguments                         reply
//   set           key, value                        - (none)
//   compare_set   key, expected, desired            value now (see below)
//   get           key (must exist)                  value
//   add           key, i64 delta                    i64 new value
//   check         key list                          u8 0 ready, 1 not ready
//   wait          key list                          u8 0 once every key exists
//   num_keys      -                                 i64 keys in the store
//   delete_key    key                               i64 keys deleted (0 or 1)
//
// Two dialects, with different query codes:
//   torch 1.x:  set 0, compare_set 1, get 2, add 3, check 4, wait 5,
//               num_keys 6, (watch_key 7), delete_key 8
//   torch 2.x:  validate 0, then set 1 ... num_keys 7, delete_key 8. A
//               connection's first query must be validate with
//               validation_magic (no reply); otherwise the server closes
//               it (TCPStore's classic daemon) or ignores it (its libuv
//               daemon, torch >= 2.4's default).
// The server answers a query it cannot carry out (add on text that is no
// integer, get of a missing key) by closing the connection.
//
// Which dialect a server speaks is found once, with one message that each
// reads as something harmless (dialect_probe).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dcomm::store_detail::c10d {

enum class dialect { torch1, torch2 };

enum class query { set, compare_set, get, add, check, wait, num_keys, delete_key };

inline std::uint8_t code(dialect d, query q) {
  if (q == query::delete_key) return 8;  // both: torch 2 dropped watch_key (7 in torch 1)
  return static_cast<std::uint8_t>(static_cast<int>(q) + (d == dialect::torch2 ? 1 : 0));
}

inline constexpr std::uint8_t validate_query = 0;  // torch 2
inline constexpr std::uint32_t validation_magic = 0x3C85F7CE;
inline constexpr std::uint8_t ready = 0;  // check's reply
inline constexpr std::uint8_t stop_waiting = 0;

// The probe, sent as a connection's first bytes:
//   torch 2 reads: validate (the magic), then num_keys four times, and
//   answers 4 x 8 bytes; the connection is then validated and in use.
//   torch 1 reads: set, with a key of 0x07070707'3C85F7CE bytes: it cannot
//   allocate that, drops the connection and serves everyone else as before.
// So 32 bytes back mean torch 2, the end of the connection with nothing
// back means torch 1; anything else is no TCPStore dcomm knows.
inline constexpr std::uint8_t probe_num_keys = 7;  // torch 2's num_keys
inline constexpr std::size_t probe_queries = 4;
inline constexpr std::size_t probe_reply_bytes = probe_queries * 8;

class encoder {
 public:
  explicit encoder(std::uint8_t query_code) { out_.push_back(static_cast<char>(query_code)); }
  encoder& u32(std::uint32_t v) { return uint(v, 4); }
  encoder& i64(std::int64_t v) { return uint(static_cast<std::uint64_t>(v), 8); }
  encoder& str(std::string_view s) {
    uint(s.size(), 8);
    out_.append(s);
    return *this;
  }
  encoder& strs(const std::vector<std::string>& keys) {
    uint(keys.size(), 8);
    for (const auto& k : keys) str(k);
    return *this;
  }
  std::string& bytes() noexcept { return out_; }

 private:
  encoder& uint(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  std::string out_;
};

inline std::string probe_bytes() {
  encoder e(validate_query);
  e.u32(validation_magic);
  for (std::size_t i = 0; i < probe_queries; ++i)
    e.bytes().push_back(static_cast<char>(probe_num_keys));
  return std::move(e.bytes());
}

inline std::string validate_bytes() {
  encoder e(validate_query);
  e.u32(validation_magic);
  return std::move(e.bytes());
}

// Little-endian u64 from 8 bytes.
inline std::uint64_t read_u64(std::string_view b) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i)
    v = (v << 8) | static_cast<unsigned char>(b[static_cast<std::size_t>(i)]);
  return v;
}

}  // namespace dcomm::store_detail::c10d
