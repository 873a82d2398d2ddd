// Logging for what a user or operator must see (refused connections,
// rendezvous progress, stragglers) and, asked for, what a job does: at
// `info` each rank's start-up (how it joined, its links, the thresholds),
// at `debug` one line per operation. DCOMM_LOG_LEVEL = error | warning (the
// default) | info | debug, or set_log_level() (dcomm/log.hpp, which also
// lets a program take the lines itself: set_log_sink).
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>

namespace dcomm::detail {

enum class log_level { error = 0, warning = 1, info = 2, debug = 3 };

using log_sink = std::function<void(log_level, std::string_view message)>;

inline log_level log_level_from_environment() {
  const char* v = std::getenv("DCOMM_LOG_LEVEL");
  if (!v) return log_level::warning;
  if (!std::strcmp(v, "error")) return log_level::error;
  if (!std::strcmp(v, "info")) return log_level::info;
  if (!std::strcmp(v, "debug")) return log_level::debug;
  return log_level::warning;
}

struct log_config {
  std::atomic<int> level{static_cast<int>(log_level_from_environment())};
  std::mutex mutex;                      // guards sink
  std::shared_ptr<const log_sink> sink;  // null: stderr
};

inline log_config& logging() {
  static log_config config;
  return config;
}

inline log_level configured_log_level() {
  return static_cast<log_level>(logging().level.load(std::memory_order_relaxed));
}

// Whether lines of `level` are written (check before building a costly one).
inline bool log_enabled(log_level level) {
  return level <= configured_log_level();
}

inline const char* name(log_level level) {
  static constexpr const char* names[] = {"error", "warning", "info", "debug"};
  return names[static_cast<int>(level)];
}

inline void log(log_level level, std::string_view message) {
  if (!log_enabled(level)) return;
  std::shared_ptr<const log_sink> sink;
  {
    std::lock_guard lock(logging().mutex);
    sink = logging().sink;
  }
  if (sink) {
    (*sink)(level, message);
    return;
  }
  std::fprintf(stderr, "dcomm %s: %.*s\n", name(level), static_cast<int>(message.size()),
               message.data());
}

}  // namespace dcomm::detail
