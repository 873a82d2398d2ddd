// DCOMM_TEST_SANITIZED: 1 in a build with AddressSanitizer (g++ or clang++),
// for tests whose memory or time would be out of proportion there, or that
// need malloc, which ASan owns.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define DCOMM_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DCOMM_TEST_SANITIZED 1
#endif
#endif
#ifndef DCOMM_TEST_SANITIZED
#define DCOMM_TEST_SANITIZED 0
#endif
