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

// g++ 12 emits an inline coroutine's body (its actor and destroy
// functions, and all they call) into every translation unit that sees its
// definition, used or not: including the CPU backend cost each test ~30 s
// of code generation for operations it never ran. A function template is
// emitted only where it is used, so dcomm's coroutines that are not
// templates are declared as templates of an unused parameter:
//   DCOMM_EMIT_ON_USE inline asio::awaitable<void> f(...) { ... }
// Calls are unchanged (`f(...)`); a pointer to one is `&f<>`. A member
// declared so is defined out of its class with DCOMM_EMIT_ON_USE_DEFINITION.
#define DCOMM_EMIT_ON_USE template <class = void>
#define DCOMM_EMIT_ON_USE_DEFINITION template <class>
