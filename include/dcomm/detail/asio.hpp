// The whole of Asio, configured as every dcomm header sees it
// (detail/asio_config.hpp), and the macros dcomm's coroutines are declared
// with (DCOMM_EMIT_ON_USE, below).
#pragma once

#include "dcomm/detail/asio_config.hpp"  // first

#include <asio.hpp>

#if !defined(ASIO_HAS_CO_AWAIT)
#error \
    "dcomm needs Asio's C++20 coroutine support: with clang, include dcomm before Asio or define ASIO_HAS_CO_AWAIT=1"
#endif

// g++ 12 emits the body of a coroutine it instantiates (its actor and
// destroy functions, and all they call) into the translation unit, used or
// not, and it instantiates every inline coroutine that is not a template.
// A function template is instantiated only where it is used, so dcomm's
// coroutines that are not templates are declared as templates of an unused
// parameter, not inline (an inline one is instantiated despite the
// declarations below):
//   DCOMM_EMIT_ON_USE asio::awaitable<void> f(...) { ... }
// Calls are unchanged (`f(...)`); a pointer to one is `&f<>`. A member
// declared so is defined out of its class (inside, it would be inline)
// with DCOMM_EMIT_ON_USE_DEFINITION (docs/design.md).
#define DCOMM_EMIT_ON_USE template <class = void>
#define DCOMM_EMIT_ON_USE_DEFINITION template <class>

// Separate compilation: a program defines DCOMM_SEPARATE_COMPILATION in
// every translation unit and compiles dcomm/impl/src.hpp in one of them
// (or links Meson's dcomm_separate_dep). Each
// header then ends with an explicit instantiation declaration of every
// coroutine declared DCOMM_EMIT_ON_USE (its f<void>), so that a user's
// translation unit instantiates none of them, nor what they call; src.hpp
// instantiates them all, once. Without the macro the lines are nothing:
// header-only, as by default. tools/separate_compilation.py writes them.
// A function that is not a template, defined in a file or block that the
// separate-compilation mode keeps out of a user's translation units
// (`#if !defined(DCOMM_SEPARATE_COMPILATION) || defined(DCOMM_SOURCE)`:
// the CPU transport's impl/, the links' bodies): inline header-only, a
// plain definition in the library, which then holds its one copy. With
// ASIO_SEPARATE_COMPILATION defined as well (Meson's dcomm_separate_dep
// does), Asio's own machinery is compiled once too (src/asio.cpp).
#if defined(DCOMM_SEPARATE_COMPILATION)
#define DCOMM_DECL
#else
#define DCOMM_DECL inline
#endif

#if defined(DCOMM_SEPARATE_COMPILATION) && defined(DCOMM_SOURCE)
#define DCOMM_INSTANTIATE(...) template __VA_ARGS__;
#elif defined(DCOMM_SEPARATE_COMPILATION)
#define DCOMM_INSTANTIATE(...) extern template __VA_ARGS__;
#else
#define DCOMM_INSTANTIATE(...)
#endif
