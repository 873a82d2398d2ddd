// A hard time limit for one test: if the scope is still alive after `limit`,
// the whole test binary exits with a message naming the test, so a bug fails
// CI instead of hanging it.
//
// A SIGALRM timer, not a watchdog thread: tests fork, and a thread that
// happens to hold an allocator lock (AddressSanitizer's is not fork-safe)
// at the moment of fork leaves the child deadlocked. Timers are not
// inherited by fork children either.
#pragma once

#include <signal.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

namespace dcomm::test {

class deadline {
 public:
  deadline(std::chrono::milliseconds limit, const std::string& name) {
    std::snprintf(message(), message_capacity,
                  "dcomm test '%s' ran past its %lld ms limit; aborting\n", name.c_str(),
                  static_cast<long long>(limit.count()));
    struct sigaction action {};
    action.sa_handler = &on_alarm;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGALRM, &action, nullptr);
    itimerval timer{};
    timer.it_value.tv_sec = static_cast<time_t>(limit.count() / 1000);
    timer.it_value.tv_usec = static_cast<suseconds_t>((limit.count() % 1000) * 1000);
    ::setitimer(ITIMER_REAL, &timer, nullptr);
  }
  deadline(const deadline&) = delete;
  deadline& operator=(const deadline&) = delete;
  ~deadline() {
    itimerval off{};
    ::setitimer(ITIMER_REAL, &off, nullptr);
  }

 private:
  static constexpr std::size_t message_capacity = 512;
  static char* message() {
    static char buffer[message_capacity];
    return buffer;
  }
  // Async-signal-safe: write and _exit only.
  static void on_alarm(int) {
    const char* m = message();
    [[maybe_unused]] auto ignored = ::write(2, m, std::strlen(m));
    ::_exit(124);
  }
};

}  // namespace dcomm::test

#define DCOMM_TEST_CONCAT_(a, b) a##b
#define DCOMM_TEST_CONCAT(a, b) DCOMM_TEST_CONCAT_(a, b)
// DCOMM_TEST_DEADLINE(30s) at the top of a test case.
#define DCOMM_TEST_DEADLINE(limit)                                            \
  ::dcomm::test::deadline DCOMM_TEST_CONCAT(dcomm_test_deadline_, __LINE__) { \
    std::chrono::duration_cast<std::chrono::milliseconds>(limit),             \
        std::string(__FILE__ ":") + std::to_string(__LINE__)                  \
  }
