// expect: dcomm: no dtype for this element type; supported: int8_t, uint8_t, int32_t, int64_t
// int16_t has no dtype, so a vector of it is not a tensor; the message lists what is supported.
#include <dcomm/tensor.hpp>

#include <cstdint>
#include <vector>

void send(const std::vector<std::int16_t>& buffer) {
  (void)dcomm::view(buffer);
}
