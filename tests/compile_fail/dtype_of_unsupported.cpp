// expect: dcomm: no dtype for this element type
#include <dcomm/dtype.hpp>

constexpr dcomm::dtype t = dcomm::dtype_of_v<unsigned short>;
