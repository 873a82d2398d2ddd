// A failure inside a rank's coroutine, with the rank and what was compared:
// thrown by the tests' checks, reported as that rank's error.
#pragma once

#include <stdexcept>

namespace dcomm::test {

struct check_failed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace dcomm::test
