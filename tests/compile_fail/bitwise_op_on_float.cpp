// expect: dcomm: bitwise reduce ops (band, bor, bxor) need an integral element type
#include <dcomm/reduce_op.hpp>

void check() {
  dcomm::check_reduce_op<float, dcomm::band_t>();
}
