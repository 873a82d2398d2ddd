// The library of dcomm's separate-compilation mode (meson's dcomm_library):
// every coroutine of dcomm/dcomm.hpp's headers, compiled once. Built with
// DCOMM_SEPARATE_COMPILATION defined, as the programs that link it are.
#include "dcomm/impl/src.hpp"
