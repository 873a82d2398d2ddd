// expect: ignoring return
// A call given no completion token and not co_awaited never runs: in plain code
// `comm.all_reduce(x, dcomm::sum);` would silently not reduce. dcomm makes discarding the
// call an error, even where the program's own flags leave it a warning (the pragma below).
#pragma GCC diagnostic warning "-Wunused-result"
#include <dcomm/dcomm.hpp>

#include <vector>

void plain_code(dcomm::communicator<dcomm::cpu_backend>& comm) {
  std::vector<float> x(4, 1.0f);
  comm.all_reduce(x, dcomm::sum);
}
