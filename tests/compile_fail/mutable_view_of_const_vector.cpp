// expect: dcomm: cannot receive into a const tensor (its data is read-only)
// A const vector can be sent but not received into.
#include <dcomm/tensor.hpp>

#include <vector>

void receive(const std::vector<float>& buffer) {
  (void)dcomm::mutable_view(buffer);
}
