// What dcomm logs, and where it goes. Lines of a level at or above the
// threshold go to stderr as "dcomm LEVEL: message", or to a sink of the
// program's own:
//
//   dcomm::set_log_level(dcomm::log_level::info);       // or DCOMM_LOG_LEVEL=info
//   dcomm::set_log_sink([](dcomm::log_level l, std::string_view line) {
//     my_logger.write(l == dcomm::log_level::error ? "E" : "I", line);
//   });
//
// error: what failed without an exception to carry it; warning (the
// default): refused connections, rendezvous progress, stragglers; info:
// each rank's start-up (rank, world, launcher, addresses, links,
// thresholds), as NCCL_DEBUG=INFO; debug: one line per operation, and
// the mesh's connections. The sink is called from dcomm's threads, one
// line at a time per thread; it must not call dcomm.
#pragma once

#include <memory>
#include <mutex>
#include <utility>

#include "dcomm/detail/log.hpp"

namespace dcomm {

using log_level = detail::log_level;
using log_sink = detail::log_sink;

// Replaces DCOMM_LOG_LEVEL's threshold (for the whole process).
inline void set_log_level(log_level level) {
  detail::logging().level.store(static_cast<int>(level), std::memory_order_relaxed);
}
inline log_level get_log_level() {
  return detail::configured_log_level();
}

// Lines go to `sink` from now on; an empty one puts stderr back.
inline void set_log_sink(log_sink sink) {
  auto next = sink ? std::make_shared<const log_sink>(std::move(sink)) : nullptr;
  std::lock_guard lock(detail::logging().mutex);
  detail::logging().sink = std::move(next);
}

}  // namespace dcomm
