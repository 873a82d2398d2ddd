// The library of the separate-compilation mode: include this header in
// one source file of a program built with DCOMM_SEPARATE_COMPILATION
// defined everywhere (detail/asio.hpp says what the mode does), as Asio's
// asio/impl/src.hpp. It instantiates every coroutine of dcomm/dcomm.hpp's
// headers that the other translation units declare and do not compile.
#pragma once

#if !defined(DCOMM_SEPARATE_COMPILATION)
#error \
    "dcomm/impl/src.hpp is the separate-compilation library: define DCOMM_SEPARATE_COMPILATION (in every translation unit)"
#endif

#define DCOMM_SOURCE 1
#include "dcomm/dcomm.hpp"
