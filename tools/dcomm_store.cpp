// dcomm-store: serves a job's store from a process of its own, so that the
// store outlives every rank (rank 0 may die like any other, and a
// replacement joins through it: docs/elastic.md).
//
//   dcomm-store --port 29400 &
//   # on every host, each rank: MASTER_ADDR=<this host> MASTER_PORT=29400 DCOMM_STORE_SERVED=1
//
// It serves dcomm's store protocol (tcp_store_server), authenticated by
// DCOMM_JOB_TOKEN where that is set (the ranks must have the same). With
// --port 0 the system picks a port; the first line on stdout, "dcomm-store:
// serving on HOST:PORT", says which (--port-file writes the port alone, for
// scripts). SIGINT and SIGTERM stop it (exit 0). --listen-fd N adopts a
// socket already bound and listening (dcomm-run --elastic hands it the one
// it picked, so the port is never free for another to take meanwhile).
#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>

#include "dcomm/command_line.hpp"
#include "dcomm/detail/asio.hpp"
#include "dcomm/store/tcp_store_server.hpp"

int main(int argc, char** argv) {
  int port = 29400;
  int listen_fd = -1;
  std::string bind_host, port_file;
  dcomm::command_line cl("dcomm-store",
                         "Serves a job's store (dcomm's tcp store protocol) until SIGINT or "
                         "SIGTERM; the ranks reach it at MASTER_ADDR:MASTER_PORT with "
                         "DCOMM_STORE_SERVED=1.");
  cl.option("port", port, "P", "the port to listen on; 0: one the system picks; 29400")
      .at_least(0)
      .at_most(65535);
  cl.option("bind-host", bind_host, "H", "the address to listen on; every interface");
  cl.option("port-file", port_file, "F", "write the port there once listening");
  cl.option("listen-fd", listen_fd, "N",
            "serve on this inherited listening socket instead of binding --port")
      .at_least(0);
  cl.parse(argc, argv);
  try {
    asio::io_context context{1};
    asio::signal_set stop(context, SIGINT, SIGTERM);
    auto server = dcomm::tcp_store_server::start(
        context.get_executor(),
        {.bind_host = bind_host, .port = static_cast<std::uint16_t>(port), .listen_fd = listen_fd});
    std::printf("dcomm-store: serving on %s\n", server->address().c_str());
    std::fflush(stdout);
    if (!port_file.empty()) {
      // Written whole, then renamed: a reader never sees half a number.
      const std::string partial = port_file + ".partial";
      std::ofstream(partial) << server->port() << "\n";
      std::rename(partial.c_str(), port_file.c_str());
    }
    stop.async_wait([&](const asio::error_code&, int) { context.stop(); });
    context.run();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcomm-store: %s\n", e.what());
    return 1;
  }
}
