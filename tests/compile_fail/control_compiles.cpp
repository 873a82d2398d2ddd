// expect: compiles
// Positive control: the correct counterparts of every misuse next to it.
// If the include path or the script were broken, this would fail too.
#include <dcomm/dtype.hpp>
#include <dcomm/reduce_op.hpp>
#include <dcomm/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

struct blob {
  void* p;
  std::size_t n;
};

template <>
struct dcomm::tensor_traits<blob> {
  static void* data(blob& b) { return b.p; }
  static std::size_t size(const blob& b) { return b.n; }
  static dcomm::dtype dtype(const blob&) { return dcomm::dtype::float32; }
};

void use(std::vector<float>& out, const std::vector<float>& in, std::span<double> s, blob& b,
         std::int32_t* ii, const std::int32_t* ij, float* fi, const float* fj) {
  (void)dcomm::mutable_view(out);
  (void)dcomm::view(in);
  (void)dcomm::mutable_view(s);
  (void)dcomm::view(std::vector<std::int32_t>{});
  (void)dcomm::view(b);
  dcomm::check_reduce_op<std::int32_t, dcomm::band_t>();
  dcomm::check_reduce_op<float, dcomm::avg_t>();
  dcomm::reduce_into(dcomm::sum, ii, ij, 4);
  dcomm::reduce_into(dcomm::avg, fi, fj, 4);
  static_assert(dcomm::dtype_of_v<std::uint8_t> == dcomm::dtype::uint8);
}
