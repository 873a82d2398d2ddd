// expect: dcomm: cannot receive into a const tensor (its data is read-only)
// A span of const elements is read-only however the span itself is passed.
#include <dcomm/tensor.hpp>

#include <span>

void receive(std::span<const double> buffer) {
  (void)dcomm::mutable_view(buffer);
}
