// expect: dcomm: tensor_traits<T>::data returns void*, so it also needs
#include <dcomm/tensor.hpp>

#include <cstddef>

struct blob {
  void* p;
  std::size_t n;
};

template <>
struct dcomm::tensor_traits<blob> {
  static void* data(blob& b) { return b.p; }
  static std::size_t size(const blob& b) { return b.n; }
};

void send(blob& b) {
  (void)dcomm::view(b);
}
