// Asio's own machinery for the separate-compilation mode (meson's
// dcomm_library, beside src/dcomm.cpp): Asio's ASIO_SEPARATE_COMPILATION,
// which dcomm_separate_dep defines for the programs that link it. An
// archive member of its own, so that a program that compiles Asio's
// source itself links without a second copy.
#include "dcomm/detail/asio_config.hpp"  // first: Asio configured as dcomm's headers see it

#include <asio/impl/src.hpp>
