// What the benchmarks share: reading sizes from the command line.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace dcomm::bench {

// "8", "4K", "64M", "1G" (binary units) as bytes.
inline std::size_t parse_bytes(const std::string& s) {
  std::size_t pos = 0;
  auto v = std::stoull(s, &pos);
  std::string unit = s.substr(pos);
  if (unit == "K" || unit == "k") return v << 10;
  if (unit == "M" || unit == "m") return v << 20;
  if (unit == "G" || unit == "g") return v << 30;
  if (!unit.empty()) throw std::invalid_argument("bad size: " + s + " (use 8, 4K, 64M, 1G)");
  return v;
}

}  // namespace dcomm::bench
