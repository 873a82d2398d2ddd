// dcomm's dtypes and reductions in MPI's terms (dcomm/mpi.hpp).
//
// MPI reduces the integer and floating types itself with its predefined
// ops; fp16 and bf16 (which MPI 3 lacks) and custom functors go through
// one user op, MPI_Op_create's function, which gets no context pointer:
// the reducer travels as an attribute of a datatype made for the call
// (reduction_type), which MPI passes to the function with the elements.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <string>
#include <utility>

#include "dcomm/backend.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/operation.hpp"
#include "dcomm/reduce_op.hpp"

namespace dcomm::mpi {

// The MPI datatype that carries a dtype (fp16 and bf16 as 16-bit words:
// moved, never reduced, by MPI).
inline MPI_Datatype datatype_of(dtype t) {
  switch (t) {
    case dtype::int8:
      return MPI_INT8_T;
    case dtype::uint8:
      return MPI_UINT8_T;
    case dtype::int32:
      return MPI_INT32_T;
    case dtype::int64:
      return MPI_INT64_T;
    case dtype::float16:
    case dtype::bfloat16:
      return MPI_UINT16_T;
    case dtype::float32:
      return MPI_FLOAT;
    case dtype::float64:
      return MPI_DOUBLE;
  }
  return MPI_BYTE;
}

// MPI's own op for a reduction of this dtype, or MPI_OP_NULL where dcomm
// reduces (fp16, bf16, custom functors). avg and premul_sum are a sum that
// the backend finishes (reducer::finish).
inline MPI_Op native_op(const reducer& r) {
  if (r.type == dtype::float16 || r.type == dtype::bfloat16) return MPI_OP_NULL;
  switch (r.kind) {
    case reduce_kind::sum:
    case reduce_kind::avg:
    case reduce_kind::premul_sum:
      return MPI_SUM;
    case reduce_kind::prod:
      return MPI_PROD;
    case reduce_kind::min:
      return MPI_MIN;
    case reduce_kind::max:
      return MPI_MAX;
    case reduce_kind::band:
      return MPI_BAND;
    case reduce_kind::bor:
      return MPI_BOR;
    case reduce_kind::bxor:
      return MPI_BXOR;
    case reduce_kind::custom:
      return MPI_OP_NULL;
  }
  return MPI_OP_NULL;
}

// The keyval under which a reduction_type carries its reducer, and the
// user op that reads it: made once per process (MPI frees them at
// MPI_Finalize).
inline int reducer_keyval() {
  static const int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_Type_create_keyval(MPI_TYPE_NULL_COPY_FN, MPI_TYPE_NULL_DELETE_FN, &k, nullptr);
    return k;
  }();
  return keyval;
}

// inout = in (op) inout, element by element, as MPI asks; dcomm's reductions
// are commutative, so reducer::combine's order serves.
inline void combine_with_attribute(void* in, void* inout, int* len, MPI_Datatype* type) {
  void* value = nullptr;
  int found = 0;
  MPI_Type_get_attr(*type, reducer_keyval(), &value, &found);
  if (!found || !value || *len <= 0) return;
  static_cast<const reducer*>(value)->combine(inout, in, static_cast<std::size_t>(*len));
}

inline MPI_Op reducer_op() {
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    MPI_Op_create(&combine_with_attribute, 1, &o);
    return o;
  }();
  return op;
}

// What one reduction hands MPI: the datatype and op, and for dcomm's own
// reductions the datatype made to carry the reducer (freed with this).
class reduction_type {
 public:
  explicit reduction_type(const reducer& r) {
    op_ = native_op(r);
    if (op_ != MPI_OP_NULL) {
      type_ = datatype_of(r.type);
      return;
    }
    MPI_Type_contiguous(static_cast<int>(size_of(r.type)), MPI_BYTE, &type_);
    MPI_Type_commit(&type_);
    MPI_Type_set_attr(type_, reducer_keyval(), const_cast<reducer*>(&r));
    made_ = true;
    op_ = reducer_op();
  }
  reduction_type(const reduction_type&) = delete;
  reduction_type& operator=(const reduction_type&) = delete;
  ~reduction_type() {
    if (made_) MPI_Type_free(&type_);
  }
  MPI_Datatype type() const { return type_; }
  MPI_Op op() const { return op_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  MPI_Op op_ = MPI_OP_NULL;
  bool made_ = false;
};

// The largest options::p2p_all_reduce_limit: each such call holds twice
// the limit in scratch while it runs (mpi/impl/all_reduce.hpp).
inline constexpr std::size_t max_p2p_all_reduce_limit = 1 << 20;

// What options::check_calls compares across a group: the operation, its
// dtype, count, root and reduce op, mixed into one word.
inline std::uint64_t signature(operation k, dtype t = dtype::uint8, std::size_t count = 0,
                               int root = -1, reduce_kind op = reduce_kind::sum) {
  std::uint64_t h = static_cast<std::uint64_t>(k) * 0x9e3779b97f4a7c15ull;
  for (std::uint64_t v : {static_cast<std::uint64_t>(t), static_cast<std::uint64_t>(count),
                          static_cast<std::uint64_t>(root + 1), static_cast<std::uint64_t>(op)})
    h = (h ^ v) * 0x100000001b3ull + (h >> 29);
  return h;
}

// What ring_all_reduce sends and receives at a time (its scratch). Its
// blocks are detail/partition.hpp's split.
inline constexpr std::size_t ring_segment = 1 << 20;

// A group's communicators: MPI's collectives and the user's messages use
// `comm`; dcomm's own collectives over messages use `own`, a duplicate,
// so that their tags never meet the user's.
struct group_comms {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm own = MPI_COMM_NULL;
};

// MPI counts are ints: larger ones are refused before anything is sent.
inline int count_of(std::size_t n, const char* operation, const char* what = "element count") {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw_error(errc::invalid_argument, {.operation = operation,
                                         .expected = std::string("an ") + what +
                                                     " of at most INT_MAX (MPI's counts are ints)",
                                         .seen = std::to_string(n)});
  return static_cast<int>(n);
}

// MPI's error string for a code.
inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

}  // namespace dcomm::mpi
