// The MPI test program's communicator: MPI_COMM_WORLD's ranks, made once
// (dcomm initialises MPI), every operation bounded by 30 s; and a runner
// for the collective suite's coroutines on the backend's executor.
#pragma once

#include <chrono>
#include <dcomm/communicator.hpp>
#include <dcomm/init_process_group.hpp>
#include <dcomm/mpi.hpp>
#include <exception>
#include <future>
#include <string>
#include <utility>

namespace dcomm::test {

using mpi_comm = communicator<mpi_backend>;

inline mpi_comm& mpi_world() {
  static auto c = init_process_group<mpi_backend>({.timeout = std::chrono::seconds(30)});
  return c;
}

// Runs body(c) on c's executor to its end; "" when it succeeded, else
// this rank's error, with the rank.
template <class Body>
std::string run_on(mpi_comm& c, Body body) {
  auto done = asio::co_spawn(
      c.get_executor(), [&]() -> asio::awaitable<void> { co_await body(c); }, asio::use_future);
  try {
    done.get();
  } catch (const std::exception& e) {
    return "rank " + std::to_string(c.rank()) + ": " + e.what();
  }
  return {};
}

}  // namespace dcomm::test
