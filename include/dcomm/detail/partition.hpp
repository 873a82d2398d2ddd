// How the message algorithms cut a buffer among ranks, the same for every
// backend that runs them (the CPU backend's rings, the MPI backend's ring):
// part i of `count` elements split into `parts` as evenly as possible, the
// first count % parts parts one element longer.
#pragma once

#include <algorithm>
#include <cstddef>

namespace dcomm::detail {

struct extent {
  std::size_t offset = 0;
  std::size_t count = 0;
};

inline extent split(std::size_t count, std::size_t parts, std::size_t i) {
  const std::size_t base = count / parts, extra = count % parts;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

}  // namespace dcomm::detail
