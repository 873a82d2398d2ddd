// The tcp_store wire protocol, both ends of it on one screen: the server
// (tcp_store_server.hpp) and the client (tcp_store.hpp) follow this.
//
// A connection opens with the dcomm handshake (purpose "store", the job
// token if one is set; detail/handshake.hpp), then carries frames both
// ways: u32 length + body (frame_stream.hpp). Fields are little-endian, as
// detail/wire.hpp writes them (str: u32 length + bytes; strs: u32 count +
// that many str).
//
//   request: u64 id (1, 2, ...) | u8 store_op | arguments
//   reply:   u64 id (the request's) | u8 store_status | results
//
//   store_op      arguments                          results (status ok)
//   set           str key, str value                 -
//   get           strs {key}, u64 timeout (ms)       str value
//   add           str key, i64 delta                 i64 new value
//   compare_set   str key, str expected, str desired str value now
//   wait          strs keys, u64 timeout (ms)        -
//   check         strs keys                          u8 1 if all exist
//   delete_key    str key                            u8 1 if it existed
//   num_keys      -                                  i64 number of keys
//
// Other statuses: timeout (get and wait; the server enforces their
// deadlines): strs keys still missing. error (a request the store refused,
// such as add on a value that is not an integer): u8 errc | str expected |
// str seen | str detail, the fields of the server's dcomm::error; the
// connection stays. A request that does not decode closes the connection.
//
// Replies may come out of order (a waiting get never holds up a set): the id
// pairs them with their requests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dcomm::store_detail {

enum class store_op : std::uint8_t {
  set = 1,
  get,
  add,
  compare_set,
  wait,
  check,
  delete_key,
  num_keys,
};

// A request's body before its arguments: u64 id, u8 store_op.
inline constexpr std::size_t request_prefix_bytes = 8 + 1;

enum class store_status : std::uint8_t { ok = 0, timeout = 1, error = 2, notice = 3 };

// Request ids start at 1: a frame from the server with id 0 answers no
// request. It is a notice (status notice, then str peers, str detail): the
// process hosting the server is leaving because it failed, and says why, so
// that its clients blame the first cause rather than the lost connection.
inline constexpr std::uint64_t notice_id = 0;

// The handshake's purpose on a store connection.
inline constexpr std::string_view store_purpose = "store";

}  // namespace dcomm::store_detail
