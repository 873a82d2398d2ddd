// expect: dcomm: not a tensor: a range must be contiguous and sized
#include <dcomm/tensor.hpp>

#include <list>

void send(const std::list<float>& buffer) {
  (void)dcomm::view(buffer);
}
