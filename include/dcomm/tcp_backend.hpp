// The CPU backend's name before it had shared memory: code written
// against communicator<tcp_backend> builds unchanged. New code names
// cpu_backend (dcomm/cpu_backend.hpp).
#pragma once

#include "dcomm/cpu_backend.hpp"

namespace dcomm {

using tcp_backend = cpu_backend;

}  // namespace dcomm
