// Little-endian encoding of the fields in dcomm's framed messages, with a
// bounds-checked reader: a peer that sends a malformed frame gets a
// protocol_error, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "dcomm/error.hpp"

namespace dcomm::detail {

class wire_writer {
 public:
  wire_writer& u8(std::uint8_t v) {
    out_.push_back(static_cast<char>(v));
    return *this;
  }
  wire_writer& u16(std::uint16_t v) { return uint(v, 2); }
  wire_writer& u32(std::uint32_t v) { return uint(v, 4); }
  wire_writer& u64(std::uint64_t v) { return uint(v, 8); }
  wire_writer& i64(std::int64_t v) { return uint(static_cast<std::uint64_t>(v), 8); }
  wire_writer& raw(std::string_view bytes) {
    out_.append(bytes);
    return *this;
  }
  wire_writer& str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return raw(s);
  }
  wire_writer& strs(const std::vector<std::string>& v) {
    u32(static_cast<std::uint32_t>(v.size()));
    for (const auto& s : v) str(s);
    return *this;
  }
  std::string& bytes() noexcept { return out_; }

 private:
  wire_writer& uint(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  std::string out_;
};

class wire_reader {
 public:
  explicit wire_reader(std::string_view in) : in_(in) {}

  std::uint8_t u8() { return static_cast<std::uint8_t>(uint(1)); }
  std::uint16_t u16() { return static_cast<std::uint16_t>(uint(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(uint(4)); }
  std::uint64_t u64() { return uint(8); }
  std::int64_t i64() { return static_cast<std::int64_t>(uint(8)); }
  std::string_view raw(std::size_t n) {
    need(n);
    auto s = in_.substr(0, n);
    in_.remove_prefix(n);
    return s;
  }
  std::string str() { return std::string(raw(u32())); }
  std::vector<std::string> strs() {
    std::uint32_t n = u32();
    // Each string needs at least its 4-byte length: refuse counts the frame
    // cannot hold before reserving memory for them.
    if (n > in_.size() / 4) fail("list longer than the frame");
    std::vector<std::string> v;
    v.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) v.push_back(str());
    return v;
  }
  bool empty() const noexcept { return in_.empty(); }
  void expect_end() {
    if (!in_.empty()) fail("trailing bytes in frame");
  }

 private:
  std::uint64_t uint(int n) {
    need(static_cast<std::size_t>(n));
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(in_[static_cast<std::size_t>(i)]))
           << (8 * i);
    in_.remove_prefix(static_cast<std::size_t>(n));
    return v;
  }
  void need(std::size_t n) {
    if (in_.size() < n) fail("truncated frame");
  }
  [[noreturn]] static void fail(const char* what) {
    throw_error(errc::protocol_error, {.operation = "decode", .detail = what});
  }
  std::string_view in_;
};

}  // namespace dcomm::detail
