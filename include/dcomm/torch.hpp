// libtorch interop: torch::Tensor (at::Tensor) is a dcomm tensor.
//
//   #include <torch/torch.h>
//   #include <dcomm/torch.hpp>
//   for (auto& p : model->parameters())
//     comm.all_reduce(p.mutable_grad(), dcomm::avg, dcomm::blocking);
//
// Optional: needs libtorch (Debian: libtorch-dev); the Meson feature
// `torch` finds it and builds the example and tests that use this header.
// A tensor's memory is used in place, so it must be contiguous (call
// .contiguous() first, and copy back if you made a copy). Its dtype must
// be one of dcomm's eight; its device is reported as torch knows it (the
// CPU backend takes CPU tensors). Like std::span, a tensor's constness is
// shallow: a const torch::Tensor& can still be received into, as in torch.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <string>

#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/tensor.hpp"

namespace dcomm {

namespace detail {

inline dtype dtype_of_torch(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::Char:
      return dtype::int8;
    case at::ScalarType::Byte:
      return dtype::uint8;
    case at::ScalarType::Int:
      return dtype::int32;
    case at::ScalarType::Long:
      return dtype::int64;
    case at::ScalarType::Half:
      return dtype::float16;
    case at::ScalarType::BFloat16:
      return dtype::bfloat16;
    case at::ScalarType::Float:
      return dtype::float32;
    case at::ScalarType::Double:
      return dtype::float64;
    default:
      break;
  }
  throw_error(errc::invalid_argument,
              {.operation = "torch tensor",
               .expected = "int8, uint8, int32, int64, float16, bfloat16, float32 or float64",
               .seen = std::string("torch dtype ") + c10::toString(t)});
}

}  // namespace detail

template <>
struct tensor_traits<at::Tensor> {
  static void* data(const at::Tensor& t) {
    if (!t.defined())
      throw_error(errc::invalid_argument,
                  {.operation = "torch tensor", .detail = "an undefined tensor (no storage)"});
    if (!t.is_contiguous())
      throw_error(errc::invalid_argument,
                  {.operation = "torch tensor",
                   .detail = "a non-contiguous tensor (strided view): call .contiguous() first"});
    return t.data_ptr();
  }
  static std::size_t size(const at::Tensor& t) {
    return t.defined() ? static_cast<std::size_t>(t.numel()) : 0;
  }
  static dcomm::dtype dtype(const at::Tensor& t) {
    return t.defined() ? detail::dtype_of_torch(t.scalar_type()) : dcomm::dtype::float32;
  }
  static dcomm::device device(const at::Tensor& t) {
    if (t.defined() && t.device().is_cuda()) return dcomm::device::cuda(t.device().index());
    return dcomm::device::cpu();
  }
};

}  // namespace dcomm
