// dcomm needs C++20 (coroutines, concepts, designated initializers). Every
// header that includes Asio includes this one first, so that a build
// without -std=c++20 stops on this line instead of on Asio's coroutine
// support missing deep inside its headers.
#pragma once

#if defined(_MSVC_LANG) ? _MSVC_LANG < 202002L : __cplusplus < 202002L
#error "dcomm needs C++20: compile with -std=c++20 (or /std:c++20)"
#endif
