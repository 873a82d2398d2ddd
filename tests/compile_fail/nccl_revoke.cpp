// expect: dcomm: this backend cannot revoke
// ncclCommRevoke is not mapped onto the NCCL backend yet: revoke is refused at
// compile time (docs/elastic.md).
#include <dcomm/communicator.hpp>
#include <dcomm/nccl.hpp>

void stop_everyone(dcomm::communicator<dcomm::nccl_backend>& comm) {
  comm.revoke("rolling back");
}
