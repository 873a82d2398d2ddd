// A hard time limit for one test: if the scope is still alive after `limit`,
// the whole test binary exits with a message naming the test, so a bug fails
// CI instead of hanging it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace dcomm::test {

class deadline {
 public:
  deadline(std::chrono::milliseconds limit, std::string name)
      : name_(std::move(name)), watchdog_([this, limit] {
          std::unique_lock lock(mutex_);
          if (!done_cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "dcomm test '%s' ran past its %lld ms limit; aborting\n",
                         name_.c_str(), static_cast<long long>(limit.count()));
            std::fflush(stderr);
            std::_Exit(124);
          }
        }) {}
  deadline(const deadline&) = delete;
  deadline& operator=(const deadline&) = delete;
  ~deadline() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
    watchdog_.join();
  }

 private:
  std::string name_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread watchdog_;
};

}  // namespace dcomm::test

#define DCOMM_TEST_CONCAT_(a, b) a##b
#define DCOMM_TEST_CONCAT(a, b) DCOMM_TEST_CONCAT_(a, b)
// DCOMM_TEST_DEADLINE(30s) at the top of a test case.
#define DCOMM_TEST_DEADLINE(limit)                                            \
  ::dcomm::test::deadline DCOMM_TEST_CONCAT(dcomm_test_deadline_, __LINE__) { \
    std::chrono::duration_cast<std::chrono::milliseconds>(limit),             \
        __FILE__ ":" + std::to_string(__LINE__)                               \
  }
