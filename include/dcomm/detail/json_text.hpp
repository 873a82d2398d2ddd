// A string as a JSON string literal, for the files dcomm writes by hand (the
// flight recorder's dumps, TorchElastic's error file): quotes and
// backslashes escaped, control characters as \u00XX, the rest (UTF-8
// included) as it is.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace dcomm::detail {

inline std::string json_quoted(std::string_view s) {
  std::string j;
  j.reserve(s.size() + 2);
  j += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') {
      j += '\\';
      j += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      j += b;
    } else {
      j += c;
    }
  }
  j += '"';
  return j;
}

}  // namespace dcomm::detail
