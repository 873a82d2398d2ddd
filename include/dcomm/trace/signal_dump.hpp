// SIGUSR1 dumps the flight recorder (trace/flight_recorder.hpp) of every
// communicator in the process to DCOMM_TRACE_DIR: what an operator does to
// a job that hangs without failing (no timeout has passed yet, or the
// timeouts are long). Installed only where DCOMM_TRACE_DIR is set, so a
// program's own use of SIGUSR1 is left alone otherwise (Asio's signal_set
// replaces the signal's disposition while it exists).
#pragma once

#include "dcomm/detail/asio_config.hpp"  // first: before any Asio header

#include <asio/post.hpp>
#include <asio/signal_set.hpp>
#include <csignal>
#include <functional>
#include <memory>
#include <utility>

#include "dcomm/detail/asio.hpp"

namespace dcomm::trace {

class signal_dump : public std::enable_shared_from_this<signal_dump> {
 public:
  // Calls `dump` on ex each time the process gets SIGUSR1, until stop().
  static std::shared_ptr<signal_dump> start(asio::any_io_executor ex, std::function<void()> dump) {
    auto s = std::shared_ptr<signal_dump>(new signal_dump(std::move(ex), std::move(dump)));
    // The handler is installed before this returns (a signal raised right
    // after must not find the default action, which ends the process); the
    // wait starts on the executor.
    asio::error_code added;
    s->signals_.add(SIGUSR1, added);
    if (added) return nullptr;  // no handler could be installed: nothing to wait for
    asio::post(s->signals_.get_executor(), [s] { s->wait(); });
    return s;
  }
  signal_dump(const signal_dump&) = delete;
  signal_dump& operator=(const signal_dump&) = delete;

  // Stops waiting (on the executor: the signal set is not thread-safe).
  void stop() {
    asio::post(signals_.get_executor(), [self = shared_from_this()] {
      self->stopped_ = true;
      asio::error_code ignored;
      self->signals_.cancel(ignored);
    });
  }

 private:
  signal_dump(asio::any_io_executor ex, std::function<void()> dump)
      : signals_(std::move(ex)), dump_(std::move(dump)) {}

  void wait() {
    if (stopped_) return;
    signals_.async_wait([self = shared_from_this()](const asio::error_code& ec, int) {
      if (ec || self->stopped_) return;
      self->dump_();
      self->wait();
    });
  }

  asio::signal_set signals_;
  std::function<void()> dump_;
  bool stopped_ = false;
};

}  // namespace dcomm::trace
