// A job's store in a forked process of its own (tcp_store_server on a
// socket bound before the fork), so that any rank may die, rank 0
// included, as under dcomm-run --elastic or dcomm-store. Killed with the
// object. Shared by the elastic tests and elastic_bench.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <system_error>

#include "dcomm/store/tcp_store.hpp"
#include "dcomm/store/tcp_store_server.hpp"
#include "listening_socket.hpp"

namespace dcomm::test {

struct store_process {
  listening_socket socket;
  pid_t pid = -1;

  store_process() {
    std::fflush(nullptr);
    pid = ::fork();
    if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
    if (pid == 0) {
      asio::io_context context{1};
      auto server =
          dcomm::tcp_store_server::start(context.get_executor(), {.listen_fd = ::dup(socket.fd())});
      context.run();
      std::_Exit(0);
    }
  }
  store_process(const store_process&) = delete;
  store_process& operator=(const store_process&) = delete;
  ~store_process() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }

  std::shared_ptr<dcomm::store> client(asio::any_io_executor ex) const {
    return dcomm::tcp_store::create(ex, {.port = socket.port, .timeout = std::chrono::seconds(20)});
  }
};

}  // namespace dcomm::test
