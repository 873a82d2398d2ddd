// The format of a file_store's file: an append-only log (see file_store.hpp
// for how the store uses it).
//
//   header: magic "dcommFS1" | u64 file id (random; new whenever the file
//           is created anew)
//   record: u8 type ('S' set, 'D' delete) | u32 key length |
//           u32 value length | key | value | u32 CRC-32 of everything
//           before it in the record
//
// Integers are little-endian. The log ends at the first record that is
// incomplete or fails its checksum (a writer killed mid-append leaves such a
// torn tail).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dcomm::store_detail::file_log {

inline constexpr std::string_view magic = "dcommFS1";
inline constexpr std::size_t header_size = 16;  // magic + u64 file id
// type + key length + value length, before the key.
inline constexpr std::size_t record_prefix = 1 + 4 + 4;
inline constexpr std::size_t record_overhead = record_prefix + 4;  // + CRC-32
inline constexpr std::uint64_t max_field = 0xffffffffu;

enum class record_type : unsigned char { set = 'S', erase = 'D' };

inline constexpr std::array<std::uint32_t, 256> crc32_table = [] {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}();

// CRC-32 (IEEE 802.3, as zlib's crc32).
inline std::uint32_t crc32(std::string_view data) noexcept {
  std::uint32_t c = 0xffffffffu;
  for (char ch : data) c = crc32_table[(c ^ static_cast<unsigned char>(ch)) & 0xffu] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

inline void put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xffu);
}
inline void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xffu);
}
inline std::uint32_t get_u32(const char* p) noexcept {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
inline std::uint64_t get_u64(const char* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

inline std::string encode_header(std::uint64_t id) {
  std::string out(magic);
  put_u64(out, id);
  return out;
}

// One record; key and value must each be shorter than 4 GiB.
inline std::string encode(record_type type, std::string_view key, std::string_view value) {
  std::string out;
  out.reserve(record_overhead + key.size() + value.size());
  out += static_cast<char>(type);
  put_u32(out, static_cast<std::uint32_t>(key.size()));
  put_u32(out, static_cast<std::uint32_t>(value.size()));
  out += key;
  out += value;
  put_u32(out, crc32(out));
  return out;
}
inline std::string encode_set(std::string_view key, std::string_view value) {
  return encode(record_type::set, key, value);
}
inline std::string encode_erase(std::string_view key) {
  return encode(record_type::erase, key, {});
}

struct record {
  record_type type = record_type::set;
  std::string_view key;
  std::string_view value;
};

// Decodes the record at the start of `data`. Returns its size, or 0 when it
// is incomplete or corrupt: the log ends there.
inline std::size_t decode(std::string_view data, record& out) noexcept {
  if (data.size() < record_overhead) return 0;
  const auto type = static_cast<unsigned char>(data[0]);
  if (type != static_cast<unsigned char>(record_type::set) &&
      type != static_cast<unsigned char>(record_type::erase))
    return 0;
  const std::uint64_t key_size = get_u32(data.data() + 1);
  const std::uint64_t value_size = get_u32(data.data() + 5);
  const std::uint64_t body = record_prefix + key_size + value_size;
  if (data.size() - 4 < body) return 0;
  if (crc32(data.substr(0, body)) != get_u32(data.data() + body)) return 0;
  if (type == static_cast<unsigned char>(record_type::erase) && value_size != 0) return 0;
  out.type = static_cast<record_type>(type);
  out.key = data.substr(record_prefix, key_size);
  out.value = data.substr(record_prefix + key_size, value_size);
  return body + 4;
}

}  // namespace dcomm::store_detail::file_log
