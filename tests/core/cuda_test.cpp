// dcomm/cuda.hpp: device spans and buffers as dcomm tensors, CUDA errors as
// dcomm errors, and device memory round trips. The parts that need a GPU
// say "skipped: no CUDA device" where none is visible (CI).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dcomm/cuda.hpp"
#include "support/text.hpp"

namespace {

using dcomm::test::contains;

// Runs a test that needs a GPU, or says why it did not.
bool have_device() {
  if (dcomm::cuda::device_count() > 0) return true;
  MESSAGE("skipped: no CUDA device");
  return false;
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("a device_span is a tensor on its GPU: pointer, count, dtype, device index") {
    // Never dereferenced on the host, so any pointer value will do.
    auto* p = reinterpret_cast<float*>(std::uintptr_t{0x1000});
    dcomm::cuda::device_span<float> s(p, 96, 1);
    static_assert(dcomm::mutable_tensor<dcomm::cuda::device_span<float>&>);
    static_assert(!dcomm::mutable_tensor<dcomm::cuda::device_span<const float>&>);
    static_assert(dcomm::tensor<dcomm::cuda::device_span<const std::int64_t>&>);
    auto v = dcomm::mutable_view(s);
    CHECK(v.data == p);
    CHECK(v.count == 96);
    CHECK(v.type == dcomm::dtype::float32);
    CHECK(v.device == dcomm::device::cuda(1));
    CHECK(s.size_bytes() == 96 * sizeof(float));
    const dcomm::cuda::device_span<const std::int64_t> c(nullptr, 0, 0);
    auto cv = dcomm::view(c);
    CHECK(cv.type == dcomm::dtype::int64);
    CHECK(cv.device == dcomm::device::cuda(0));
  }

  TEST_CASE("a device_buffer is a tensor on its GPU; an empty one needs no device") {
    static_assert(dcomm::mutable_tensor<dcomm::cuda::device_buffer<double>&>);
    static_assert(!dcomm::mutable_tensor<const dcomm::cuda::device_buffer<double>&>);
    static_assert(dcomm::tensor<const dcomm::cuda::device_buffer<double>&>);
    dcomm::cuda::device_buffer<double> empty(0, 2);
    auto v = dcomm::mutable_view(empty);
    CHECK(v.data == nullptr);
    CHECK(v.count == 0);
    CHECK(v.type == dcomm::dtype::float64);
    CHECK(v.device == dcomm::device::cuda(2));
    dcomm::cuda::device_buffer<double> moved(std::move(empty));
    CHECK(moved.size() == 0);
    CHECK(moved.device() == 2);
  }

  TEST_CASE("a failed CUDA call is a device_error naming the call and CUDA's error") {
    try {
      dcomm::cuda::check(cudaErrorInvalidValue, "cudaMemcpy in a test");
      FAIL("check() returned on an error");
    } catch (const dcomm::error& e) {
      CHECK(e.code() == dcomm::errc::device_error);
      const std::string what = e.what();
      INFO(what);
      CHECK(contains(what, "cudaMemcpy in a test"));
      CHECK(contains(what, "cudaErrorInvalidValue"));
    }
    CHECK_NOTHROW(dcomm::cuda::check(cudaSuccess, "nothing"));
  }

  TEST_CASE("a device index that is not there is refused before any CUDA allocation") {
    const int n = dcomm::cuda::device_count();
    CHECK(n >= 0);
    try {
      dcomm::cuda::device_buffer<float> b(16, n + 3);
      FAIL("allocated on a device that does not exist");
    } catch (const dcomm::error& e) {
      CHECK(e.code() == dcomm::errc::invalid_argument);
      const std::string what = e.what();
      INFO(what);
      CHECK(contains(what, std::to_string(n + 3)));
      if (n == 0) CHECK(contains(what, "no CUDA device is visible"));
    }
  }

  TEST_CASE("device_buffer: host to device to host, exact sizes only") {
    if (!have_device()) return;
    std::vector<std::int32_t> host(1000);
    std::iota(host.begin(), host.end(), -500);
    dcomm::cuda::device_buffer<std::int32_t> d(host.size(), 0);
    CHECK(d.data() != nullptr);
    d.copy_from(host);
    std::vector<std::int32_t> back(host.size(), 0);
    d.copy_to(back);
    CHECK(back == host);
    std::vector<std::int32_t> short_host(999);
    CHECK_THROWS_AS(d.copy_to(short_host), dcomm::error);
    auto moved = std::move(d);
    CHECK(moved.size() == 1000);
    CHECK(d.size() == 0);  // NOLINT: moved-from is empty by contract
  }
}
