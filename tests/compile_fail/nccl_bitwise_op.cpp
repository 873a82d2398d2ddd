// expect: dcomm: this backend does not support bitwise reduce ops
// NCCL has no bitwise reductions: the nccl backend refuses them at compile time.
#include <dcomm/communicator.hpp>
#include <dcomm/cuda.hpp>
#include <dcomm/nccl.hpp>

void misuse(dcomm::communicator<dcomm::nccl_backend>& comm,
            dcomm::cuda::device_buffer<int>& flags) {
  (void)comm.all_reduce(flags, dcomm::band, dcomm::blocking);
}
