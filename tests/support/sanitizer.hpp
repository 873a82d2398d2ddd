// DCOMM_TEST_SANITIZED: 1 in a build with AddressSanitizer or
// ThreadSanitizer (g++ or clang++), for tests whose memory or time would be
// out of proportion there, or that need malloc, which the sanitizers own
// (TSan calls malloc while it starts, before an interposed one could run).
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DCOMM_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DCOMM_TEST_SANITIZED 1
#endif
#endif
#ifndef DCOMM_TEST_SANITIZED
#define DCOMM_TEST_SANITIZED 0
#endif
