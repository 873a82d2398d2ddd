// expect: dcomm: this backend cannot shrink
// The NCCL backend has no fault-tolerant agreement (yet): shrink is refused at
// compile time, naming what can (docs/elastic.md), as it is for MPI without ULFM.
#include <dcomm/communicator.hpp>
#include <dcomm/nccl.hpp>

void recover(dcomm::communicator<dcomm::nccl_backend>& comm) {
  auto survivors = comm.shrink(dcomm::blocking);
  (void)survivors;
}
