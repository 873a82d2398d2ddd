// torch::Tensor (at::Tensor) as an argument or result of remote calls
// (dcomm/rpc.hpp), like torch's RPC: CPU tensors of dcomm's eight dtypes,
// any shape; an undefined tensor travels as one.
//
//   #include <dcomm/rpc/torch.hpp>
//   functions.add("double", [](torch::Tensor t) { return t * 2; });
//   torch::Tensor y = co_await rpc.call<torch::Tensor>(1, "double", x);
//
// A contiguous tensor of 4 KiB or more is sent from its storage and
// received into memory the new tensor owns (no copy on either side); a
// strided one is made contiguous into the call's bytes (one copy). A CUDA
// tensor is refused when the call is made: move it to the CPU first.
// Optional: needs libtorch, like dcomm/torch.hpp. Includes dcomm/rpc.hpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dcomm/error.hpp"
#include "dcomm/rpc.hpp"
#include "dcomm/rpc/codec.hpp"
#include "dcomm/torch.hpp"

namespace dcomm {  // dcomm::codec, which dcomm::rpc::codec names

template <>
struct codec<at::Tensor> {
  static std::string name() { return "tensor"; }

  static void write(writer& w, const at::Tensor& t) {
    const std::uint8_t defined = t.defined() ? 1 : 0;
    w.raw(&defined, 1);
    if (!defined) return;
    if (!t.device().is_cpu())
      throw_error(errc::invalid_argument,
                  {.operation = "rpc: a torch tensor argument or result",
                   .detail = "it is on " + t.device().str() + ": move it to the CPU first"});
    const auto type = dcomm::detail::dtype_of_torch(t.scalar_type());
    const auto code = static_cast<std::uint8_t>(type);
    w.raw(&code, 1);
    const std::uint64_t dims = static_cast<std::uint64_t>(t.dim());
    w.raw(&dims, sizeof dims);
    for (auto size : t.sizes()) {
      const std::int64_t s = size;
      w.raw(&s, sizeof s);
    }
    const std::uint64_t n = static_cast<std::uint64_t>(t.numel());
    w.raw(&n, sizeof n);
    const bool attached =
        t.is_contiguous() && visit_dtype(type, [&]<class T>(std::type_identity<T>) {
          return w.attach(static_cast<const T*>(t.data_ptr()), n);
        });
    const std::uint8_t form = attached ? 1 : 0;
    w.raw(&form, 1);
    if (!attached) {
      const at::Tensor c = t.contiguous();
      w.raw(c.data_ptr(), static_cast<std::size_t>(n) * size_of(type));
    }
  }

  static void read(reader& r, at::Tensor& t) {
    std::uint8_t defined = 0;
    r.raw(&defined, 1);
    if (defined > 1) throw payload_error("a tensor's flag is " + std::to_string(defined));
    if (!defined) {
      t = at::Tensor();
      return;
    }
    std::uint8_t code = 0;
    r.raw(&code, 1);
    const auto type = static_cast<dtype>(code);
    if (size_of(type) == 0) throw payload_error("a tensor of dtype " + std::to_string(code));
    std::uint64_t dims = 0;
    r.raw(&dims, sizeof dims);
    if (dims > 64) throw payload_error("a tensor of " + std::to_string(dims) + " dimensions");
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(dims));
    std::uint64_t elements = 1;
    for (auto& s : sizes) {
      r.raw(&s, sizeof s);
      // Each size and their product stay below 2^48: no overflow below.
      if (s < 0 || static_cast<std::uint64_t>(s) >= (std::uint64_t{1} << 48) ||
          (s && elements > ((std::uint64_t{1} << 48) / static_cast<std::uint64_t>(s))))
        throw payload_error("a tensor's sizes do not fit");
      elements *= static_cast<std::uint64_t>(s);
    }
    std::uint64_t n = 0;
    r.raw(&n, sizeof n);
    std::uint8_t form = 0;
    r.raw(&form, 1);
    if (n != elements || form > 1)
      throw payload_error("a tensor of " + std::to_string(n) + " elements, its sizes say " +
                          std::to_string(elements));
    const auto options = at::TensorOptions().dtype(torch_type(type));
    if (form == 1) {  // the memory it was received into becomes the tensor's
      tensor_in& in = r.next_tensor(type, n);
      auto owner = in.vector;
      t = at::from_blob(
          in.data, sizes, [owner](void*) mutable { owner.reset(); }, options);
      return;
    }
    if (n * size_of(type) > r.left()) throw payload_error("a tensor longer than its payload");
    t = at::empty(sizes, options);
    r.raw(t.data_ptr(), static_cast<std::size_t>(n) * size_of(type));
  }

 private:
  static at::ScalarType torch_type(dtype type) {
    switch (type) {
      case dtype::int8:
        return at::kChar;
      case dtype::uint8:
        return at::kByte;
      case dtype::int32:
        return at::kInt;
      case dtype::int64:
        return at::kLong;
      case dtype::float16:
        return at::kHalf;
      case dtype::bfloat16:
        return at::kBFloat16;
      case dtype::float32:
        return at::kFloat;
      case dtype::float64:
        return at::kDouble;
    }
    throw payload_error("a tensor of dtype " + std::to_string(static_cast<unsigned>(type)));
  }
};

}  // namespace dcomm
