// Counts heap allocations, for the CPU backend's promise that an operation
// in steady state allocates nothing. Two counts:
//   heap allocations: glibc's malloc family, interposed. Everything ends up
//     there, Asio's coroutine frames and handler memory included (Asio takes
//     those from std::aligned_alloc when its small per-thread cache misses).
//   operator new calls: dcomm's own allocations, the standard containers'
//     and Asio's type-erased executors', without Asio's recycled memory.
// Both per thread (a rank of a thread world runs on one) and per process.
//
// One translation unit of a program defines DCOMM_HEAP_COUNTER_IMPLEMENT
// before including this. Counting works with glibc and without
// AddressSanitizer (which owns malloc): heap_counting is false otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sanitizer.hpp"  // beside it: found without -I tests (bench/ includes this file by path)

#if defined(__GLIBC__) && !DCOMM_TEST_SANITIZED
#define DCOMM_HEAP_COUNTING 1
#else
#define DCOMM_HEAP_COUNTING 0
#endif

namespace dcomm::test {

inline constexpr bool heap_counting = DCOMM_HEAP_COUNTING;

// Allocations made so far by the calling thread, and by the whole process.
std::uint64_t heap_allocations_on_this_thread() noexcept;
std::uint64_t heap_allocations_in_process() noexcept;
std::uint64_t new_calls_on_this_thread() noexcept;
std::uint64_t new_calls_in_process() noexcept;

}  // namespace dcomm::test

#ifdef DCOMM_HEAP_COUNTER_IMPLEMENT
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <new>

#if DCOMM_HEAP_COUNTING
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);
}

namespace dcomm::test::heap_counter_detail {
// Plain zero-initialised data: static TLS of the executable, which malloc
// may touch at any time without allocating itself.
inline thread_local std::uint64_t thread_allocations = 0;
inline thread_local std::uint64_t thread_new_calls = 0;
inline std::atomic<std::uint64_t> process_allocations{0};
inline std::atomic<std::uint64_t> process_new_calls{0};
inline void count_allocation() noexcept {
  ++thread_allocations;
  process_allocations.fetch_add(1, std::memory_order_relaxed);
}
inline void* counted_new(std::size_t n) {
  ++thread_new_calls;
  process_new_calls.fetch_add(1, std::memory_order_relaxed);
  for (;;) {
    if (void* p = std::malloc(n ? n : 1)) return p;
    std::new_handler h = std::get_new_handler();
    if (!h) throw std::bad_alloc();
    h();
  }
}
}  // namespace dcomm::test::heap_counter_detail

// Out of line, so that no call site pairs an inlined malloc with delete.
[[gnu::noinline]] void* operator new(std::size_t n) {
  return dcomm::test::heap_counter_detail::counted_new(n);
}
[[gnu::noinline]] void* operator new[](std::size_t n) {
  return dcomm::test::heap_counter_detail::counted_new(n);
}
[[gnu::noinline]] void operator delete(void* p) noexcept {
  std::free(p);
}
[[gnu::noinline]] void operator delete[](void* p) noexcept {
  std::free(p);
}
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}

extern "C" {
void* malloc(std::size_t n) {
  dcomm::test::heap_counter_detail::count_allocation();
  return __libc_malloc(n);
}
void* calloc(std::size_t n, std::size_t size) {
  dcomm::test::heap_counter_detail::count_allocation();
  return __libc_calloc(n, size);
}
void* realloc(void* p, std::size_t n) {
  dcomm::test::heap_counter_detail::count_allocation();
  return __libc_realloc(p, n);
}
void* aligned_alloc(std::size_t align, std::size_t n) {
  dcomm::test::heap_counter_detail::count_allocation();
  return __libc_memalign(align, n);
}
void* memalign(std::size_t align, std::size_t n) {
  dcomm::test::heap_counter_detail::count_allocation();
  return __libc_memalign(align, n);
}
int posix_memalign(void** out, std::size_t align, std::size_t n) {
  if (align % sizeof(void*) != 0 || (align & (align - 1)) != 0) return EINVAL;
  dcomm::test::heap_counter_detail::count_allocation();
  void* p = __libc_memalign(align, n);
  if (!p && n) return ENOMEM;
  *out = p;
  return 0;
}
void free(void* p) {
  __libc_free(p);
}
}

std::uint64_t dcomm::test::heap_allocations_on_this_thread() noexcept {
  return heap_counter_detail::thread_allocations;
}
std::uint64_t dcomm::test::heap_allocations_in_process() noexcept {
  return heap_counter_detail::process_allocations.load(std::memory_order_relaxed);
}
std::uint64_t dcomm::test::new_calls_on_this_thread() noexcept {
  return heap_counter_detail::thread_new_calls;
}
std::uint64_t dcomm::test::new_calls_in_process() noexcept {
  return heap_counter_detail::process_new_calls.load(std::memory_order_relaxed);
}
#else
std::uint64_t dcomm::test::heap_allocations_on_this_thread() noexcept {
  return 0;
}
std::uint64_t dcomm::test::heap_allocations_in_process() noexcept {
  return 0;
}
std::uint64_t dcomm::test::new_calls_on_this_thread() noexcept {
  return 0;
}
std::uint64_t dcomm::test::new_calls_in_process() noexcept {
  return 0;
}
#endif
#endif  // DCOMM_HEAP_COUNTER_IMPLEMENT
