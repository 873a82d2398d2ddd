// Minimal logging to stderr for what a user or operator must see (refused
// connections, rendezvous progress). DCOMM_LOG_LEVEL = error|warning|info|debug.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace dcomm::detail {

enum class log_level { error = 0, warning = 1, info = 2, debug = 3 };

inline log_level configured_log_level() {
  static const log_level level = [] {
    const char* v = std::getenv("DCOMM_LOG_LEVEL");
    if (!v) return log_level::warning;
    if (!std::strcmp(v, "error")) return log_level::error;
    if (!std::strcmp(v, "info")) return log_level::info;
    if (!std::strcmp(v, "debug")) return log_level::debug;
    return log_level::warning;
  }();
  return level;
}

inline void log(log_level level, std::string_view message) {
  if (level > configured_log_level()) return;
  static constexpr const char* names[] = {"error", "warning", "info", "debug"};
  std::fprintf(stderr, "dcomm %s: %.*s\n", names[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
}

}  // namespace dcomm::detail
