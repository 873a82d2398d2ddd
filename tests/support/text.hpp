// Text helpers the tests share (one definition: the test programs are
// built as unity translation units, several test files in one).
#pragma once

#include <string_view>

namespace dcomm::test {

inline bool contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}

}  // namespace dcomm::test
