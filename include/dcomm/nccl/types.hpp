// dcomm's vocabulary in NCCL's terms, for the NCCL backend (dcomm/nccl.hpp):
// element types and reduce ops as NCCL's, NCCL's results as dcomm errors,
// and the GPU a rank picks when it is not told.
#pragma once

#include <nccl.h>

#include <cstdlib>
#include <string>

#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/reduce_op.hpp"

namespace dcomm::nccl {

inline ncclDataType_t data_type(dtype t) {
  switch (t) {
    case dtype::int8:
      return ncclInt8;
    case dtype::uint8:
      return ncclUint8;
    case dtype::int32:
      return ncclInt32;
    case dtype::int64:
      return ncclInt64;
    case dtype::float16:
      return ncclFloat16;
    case dtype::bfloat16:
      return ncclBfloat16;
    case dtype::float32:
      return ncclFloat32;
    case dtype::float64:
      return ncclFloat64;
  }
  throw_error(errc::invalid_argument,
              {.operation = "nccl_backend",
               .seen = "dtype value " + std::to_string(static_cast<unsigned>(t)),
               .detail = "not a dcomm::dtype"});
}

// The bitwise ops and custom functors never get here: the front end
// rejects them at compile time (supports_bitwise_reduce and
// supports_custom_reduce are false), and make_reducer(op, dtype) checks
// the rest.
inline ncclRedOp_t reduce_op(reduce_kind k) {
  switch (k) {
    case reduce_kind::sum:
      return ncclSum;
    case reduce_kind::prod:
      return ncclProd;
    case reduce_kind::min:
      return ncclMin;
    case reduce_kind::max:
      return ncclMax;
    case reduce_kind::avg:
      return ncclAvg;
    default:
      break;
  }
  throw_error(errc::invalid_argument,
              {.operation = "nccl_backend",
               .seen = std::string(name(k)),
               .detail = k == reduce_kind::premul_sum
                             ? "premul_sum is made per call, with its factor (staging::reduce_op)"
                             : "NCCL reduces with sum, prod, min, max, avg and premul_sum only"});
}

// NCCL's result as the dcomm error a user can act on.
inline errc error_for(ncclResult_t r) {
  switch (r) {
    case ncclRemoteError:
      return errc::peer_lost;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return errc::invalid_argument;
    default:
      return errc::device_error;
  }
}

inline std::string describe(ncclResult_t r, ncclComm_t comm) {
  std::string d = ncclGetErrorString(r);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) d += " (" + std::string(last) + ")";
  }
  return d;
}

// The GPU a rank uses when options::device is not set: $LOCAL_RANK (what
// torchrun, dcomm-run and mpirun's OMPI_COMM_WORLD_LOCAL_RANK say), else its
// rank modulo the GPUs it sees.
inline int default_device(int rank, int gpus) {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
    if (const char* v = std::getenv(name); v && *v) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end && *end == '\0' && n >= 0) return static_cast<int>(n % gpus);
    }
  return rank % gpus;
}

}  // namespace dcomm::nccl
