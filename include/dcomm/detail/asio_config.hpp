// How dcomm configures Asio: every dcomm header that includes an Asio
// header includes this first (detail/asio.hpp for the whole of Asio, or
// this and the Asio headers it needs, where a header of the ground floor
// keeps its users' compile time down), so that every translation unit sees
// Asio configured the same way.
#pragma once

#include "dcomm/detail/cxx20.hpp"  // first: a clear error without C++20

#ifndef ASIO_STANDALONE
#define ASIO_STANDALONE
#endif

// Asio 1.22 enables co_await on clang only for the coroutines TS; clang 14
// with libstdc++ has C++20 coroutines, so say so before Asio's config runs.
#if defined(__clang__) && !defined(ASIO_HAS_CO_AWAIT) && defined(__cpp_impl_coroutine)
#if __cpp_impl_coroutine >= 201902 && __has_include(<coroutine>)
#define ASIO_HAS_CO_AWAIT 1
#endif
#endif
