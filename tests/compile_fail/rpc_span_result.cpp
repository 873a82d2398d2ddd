// expect: a handler returns a std::vector, not a std::span
#include <dcomm/cpu_backend.hpp>
#include <dcomm/rpc.hpp>

#include <span>
#include <vector>

void serve(dcomm::rpc::registry& functions, const std::vector<float>& weights) {
  functions.add("weights", [&weights] { return std::span<const float>(weights); });
}
