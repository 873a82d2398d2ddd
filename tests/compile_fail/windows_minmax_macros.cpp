// expect: compiles
// windows.h defines function-like min and max macros; dcomm's headers must
// survive them (numeric_limits<half>::min/max, the dcomm::min/max tags). The
// standard headers go first because they do not all survive such macros.
#include <algorithm>
#include <bit>
#include <compare>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <ranges>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

#define min(a, b) (((a) < (b)) ? (a) : (b))
#define max(a, b) (((a) > (b)) ? (a) : (b))

#include <dcomm/dtype.hpp>
#include <dcomm/half.hpp>
#include <dcomm/reduce_op.hpp>
#include <dcomm/tensor.hpp>

void use(float* a, const float* b, dcomm::float16* h, const dcomm::float16* k) {
  dcomm::reduce_into(dcomm::min, a, b, 2);
  dcomm::reduce_into(dcomm::max, h, k, 2);
  dcomm::reduce_into(dcomm::reduce_kind::max, dcomm::dtype::float16, h, k, 2);
  (void)(std::numeric_limits<dcomm::float16>::max)();
  (void)(std::numeric_limits<dcomm::bfloat16>::min)();
}
