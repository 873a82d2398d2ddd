// expect: dcomm: avg needs a floating-point element type (use sum and divide for integers)
// Through the kernel a backend would call, not only the check itself.
#include <dcomm/reduce_op.hpp>

#include <cstdint>

void combine(std::int32_t* inout, const std::int32_t* in) {
  dcomm::reduce_into(dcomm::avg, inout, in, 4);
}
