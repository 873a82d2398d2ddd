// The backends on CUDA tensors. "nccl": dcomm/nccl.hpp, what needs no GPU
// (the mapping of dtypes, reduce ops and NCCL's errors, the choice of
// device, a clean refusal without a device) and a world of one for every
// operation where a GPU is present (NCCL refuses two ranks on one GPU, and
// the machines lent here have one). "cpu cuda": CUDA tensors over the tcp
// backend, staged through pinned host memory, several ranks sharing the GPU.
// The cases that need a GPU say "skipped: no CUDA device" otherwise.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/cuda.hpp"
#include "dcomm/gradient_bucketer.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/store/hash_store.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"
#include "support/staged_cases.hpp"
#if DCOMM_HAS_NCCL
#include "dcomm/nccl.hpp"
#include "support/text.hpp"
#endif

using namespace std::chrono_literals;

namespace {

using dcomm::test::contains;

bool gpu_present() {
  if (dcomm::cuda::device_count() > 0) return true;
  MESSAGE("skipped: no CUDA device");
  return false;
}

template <class T>
dcomm::cuda::device_buffer<T> upload(const std::vector<T>& host) {
  dcomm::cuda::device_buffer<T> d(host.size());
  d.copy_from(host);
  return d;
}
template <class T>
std::vector<T> download(const dcomm::cuda::device_buffer<T>& d) {
  std::vector<T> host(d.size());
  d.copy_to(host);
  return host;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Device buffers for the staged cases (support/staged_cases.hpp).
struct cuda_memory {
  template <class T>
  using buffer = dcomm::cuda::device_buffer<T>;
  template <class T>
  static buffer<T> upload(const std::vector<T>& host) {
    return ::upload(host);
  }
  template <class T>
  static std::vector<T> download(const buffer<T>& d) {
    return ::download(d);
  }
  template <class T>
  static void refill(buffer<T>& d, const std::vector<T>& host) {
    d.copy_from(host);
  }
};

#if DCOMM_HAS_NCCL
using nccl_comm = dcomm::communicator<dcomm::nccl_backend>;

// Runs body on a world of one over NCCL; returns the error message, or ""
// when it succeeded.
template <class Body>
std::string world_of_one(Body body, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  asio::io_context ctx;
  try {
    auto s =
        dcomm::hash_store::create(ctx.get_executor(), std::make_shared<dcomm::hash_store::table>());
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      dcomm::init_options<dcomm::nccl_backend> o{.timeout = timeout, .job_token = ""};
      auto c =
          co_await dcomm::init_process_group<dcomm::nccl_backend>(ctx.get_executor(), s, 0, 1, o);
      co_await body(c);
    }());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

#endif

}  // namespace

TEST_SUITE("cpu cuda") {
  TEST_CASE(
      "with dcomm/cuda.hpp the CPU backend takes CUDA tensors; a failed copy is device_error") {
    DCOMM_TEST_DEADLINE(120s);
    if (dcomm::cuda::device_count() > 0) {
      MESSAGE("a CUDA device is present: the staged collectives below run instead");
      return;
    }
    // No device: staging fails, typed, before anything is sent.
    DCOMM_REQUIRE_WORLD(1, [](dcomm::test::comm& c, int) -> asio::awaitable<void> {
      dcomm::cuda::device_span<float> fake(reinterpret_cast<float*>(std::uintptr_t{0x1000}), 4, 0);
      try {
        co_await c.all_reduce(fake, dcomm::sum);
        dcomm::test::require(false, "a copy from a device that is not there succeeded");
      } catch (const dcomm::error& e) {
        dcomm::test::require(e.code() == dcomm::errc::device_error, e.what());
        // The staging names the CUDA call that failed (the pinned buffer's, first).
        dcomm::test::require(
            contains(e.what(), "cudaMallocHost") || contains(e.what(), "cudaMemcpy"), e.what());
      }
    });
  }

  TEST_CASE("three ranks on one GPU: every collective and send/recv on device buffers") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    dcomm::test::staged::every_operation<cuda_memory>();
  }

  TEST_CASE("slice by slice: send, recv and element-wise collectives beyond staging_slice") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    dcomm::test::staged::slice_by_slice<cuda_memory>();
  }

  TEST_CASE("a collective's ranks must agree on slicing, else mismatch on every rank") {
    DCOMM_TEST_DEADLINE(60s);
    if (!gpu_present()) return;
    dcomm::test::staged::slicing_must_agree<cuda_memory>();
  }

  TEST_CASE("gradient_bucketer packs CUDA gradients on their GPU") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    dcomm::test::staged::bucketer_on_device<cuda_memory>();
  }
}

#if DCOMM_HAS_NCCL
static_assert(dcomm::backend<dcomm::nccl_backend>);
static_assert(!dcomm::nccl_backend::supports_bitwise_reduce);
static_assert(!dcomm::nccl_backend::supports_custom_reduce);

TEST_SUITE("nccl") {
  TEST_CASE("every dcomm dtype maps to the NCCL type of its size and kind") {
    DCOMM_TEST_DEADLINE(120s);
    using dcomm::dtype;
    namespace n = dcomm::nccl;
    CHECK(n::data_type(dtype::int8) == ncclInt8);
    CHECK(n::data_type(dtype::uint8) == ncclUint8);
    CHECK(n::data_type(dtype::int32) == ncclInt32);
    CHECK(n::data_type(dtype::int64) == ncclInt64);
    CHECK(n::data_type(dtype::float16) == ncclFloat16);
    CHECK(n::data_type(dtype::bfloat16) == ncclBfloat16);
    CHECK(n::data_type(dtype::float32) == ncclFloat32);
    CHECK(n::data_type(dtype::float64) == ncclFloat64);
    CHECK_THROWS_AS(n::data_type(static_cast<dtype>(200)), dcomm::error);
  }

  TEST_CASE("reduce ops map to NCCL's; the others are refused with a reason") {
    DCOMM_TEST_DEADLINE(120s);
    using dcomm::reduce_kind;
    namespace n = dcomm::nccl;
    CHECK(n::reduce_op(reduce_kind::sum) == ncclSum);
    CHECK(n::reduce_op(reduce_kind::prod) == ncclProd);
    CHECK(n::reduce_op(reduce_kind::min) == ncclMin);
    CHECK(n::reduce_op(reduce_kind::max) == ncclMax);
    CHECK(n::reduce_op(reduce_kind::avg) == ncclAvg);
    for (auto k : {reduce_kind::band, reduce_kind::bor, reduce_kind::bxor, reduce_kind::custom}) {
      try {
        (void)n::reduce_op(k);
        FAIL("reduce op accepted: " << dcomm::name(k));
      } catch (const dcomm::error& e) {
        CHECK(e.code() == dcomm::errc::invalid_argument);
        CHECK(contains(e.what(), std::string(dcomm::name(k))));
      }
    }
  }

  TEST_CASE("NCCL's errors become the dcomm errors a user acts on") {
    DCOMM_TEST_DEADLINE(120s);
    namespace n = dcomm::nccl;
    CHECK(n::error_for(ncclRemoteError) == dcomm::errc::peer_lost);
    CHECK(n::error_for(ncclInvalidArgument) == dcomm::errc::invalid_argument);
    CHECK(n::error_for(ncclInvalidUsage) == dcomm::errc::invalid_argument);
    CHECK(n::error_for(ncclSystemError) == dcomm::errc::device_error);
    CHECK(n::error_for(ncclUnhandledCudaError) == dcomm::errc::device_error);
    CHECK(contains(n::describe(ncclInvalidArgument, nullptr), "invalid argument"));
  }

  TEST_CASE("the default GPU: $LOCAL_RANK when set, else the rank, modulo the GPUs") {
    DCOMM_TEST_DEADLINE(120s);
    namespace n = dcomm::nccl;
    const char* saved = std::getenv("LOCAL_RANK");
    std::string keep = saved ? saved : "";
    ::unsetenv("LOCAL_RANK");
    ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    ::unsetenv("SLURM_LOCALID");
    CHECK(n::default_device(5, 8) == 5);
    CHECK(n::default_device(9, 8) == 1);
    ::setenv("LOCAL_RANK", "3", 1);
    CHECK(n::default_device(9, 8) == 3);
    CHECK(n::default_device(9, 2) == 1);
    ::setenv("LOCAL_RANK", "not a number", 1);
    CHECK(n::default_device(9, 8) == 1);
    if (saved)
      ::setenv("LOCAL_RANK", keep.c_str(), 1);
    else
      ::unsetenv("LOCAL_RANK");
  }

  TEST_CASE("without a CUDA device, init_process_group fails at once with device_error") {
    DCOMM_TEST_DEADLINE(120s);
    if (dcomm::cuda::device_count() > 0) {
      MESSAGE("a CUDA device is present: the GPU cases below run instead");
      return;
    }
    // A deadline far beyond the test's own limit: only an immediate,
    // typed refusal passes.
    auto what = world_of_one([](nccl_comm&) -> asio::awaitable<void> { co_return; },
                             std::chrono::minutes(10));
    INFO(what);
    CHECK(contains(what, "device error"));
    CHECK(contains(what, "no CUDA device is visible"));
    CHECK(contains(what, "rank 0"));
  }

  TEST_CASE("a world of one: every collective on device buffers, in and out of place") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      std::vector<float> host(1000);
      std::iota(host.begin(), host.end(), -3.0f);
      auto buf = upload(host);
      co_await c.all_reduce(buf, dcomm::sum);
      require(download(buf) == host, "all_reduce sum in place");
      co_await c.all_reduce(buf, dcomm::avg);
      require(download(buf) == host, "all_reduce avg in place");
      for (int op = 0; op < 3;
           ++op) {  // not a braced list: g++ 12 cannot keep one in a coroutine frame
        dcomm::cuda::device_buffer<float> out(host.size());
        if (op == 0) co_await c.all_reduce(buf, out, dcomm::max);
        if (op == 1) co_await c.all_reduce(buf, out, dcomm::min);
        if (op == 2) co_await c.all_reduce(buf, out, dcomm::prod);
        require(download(out) == host, "all_reduce out of place, op " + std::to_string(op));
      }
      {  // NCCL's pre-multiplied sum, made per call with its factor
        dcomm::cuda::device_buffer<float> out(host.size());
        co_await c.all_reduce(buf, out, dcomm::premul_sum(0.5));
        std::vector<float> half(host);
        for (auto& x : half) x *= 0.5f;
        require(download(out) == half, "all_reduce premul_sum(0.5)");
      }
      std::vector<std::int64_t> ints(7);
      std::iota(ints.begin(), ints.end(), 1 << 20);
      auto ibuf = upload(ints);
      co_await c.broadcast(ibuf, 0);
      require(download(ibuf) == ints, "broadcast");
      dcomm::cuda::device_buffer<std::int64_t> iout(ints.size());
      co_await c.reduce(ibuf, iout, 0, dcomm::sum);
      require(download(iout) == ints, "reduce");
      dcomm::cuda::device_buffer<std::int64_t> gathered(ints.size());
      co_await c.all_gather(ibuf, gathered);
      require(download(gathered) == ints, "all_gather");
      co_await c.gather(ibuf, gathered, 0);
      require(download(gathered) == ints, "gather");
      co_await c.scatter(ibuf, gathered, 0);
      require(download(gathered) == ints, "scatter");
      co_await c.reduce_scatter(ibuf, gathered, dcomm::sum);
      require(download(gathered) == ints, "reduce_scatter");
      co_await c.all_to_all(ibuf, gathered);
      require(download(gathered) == ints, "all_to_all");
      co_await c.all_to_all(gathered);
      require(download(gathered) == ints, "all_to_all in place");
      co_await c.barrier();
      std::vector<std::int64_t> v;
      auto counts = co_await c.all_gather_v(ibuf, v);
      require(counts == std::vector<std::size_t>{ints.size()} && v == ints, "all_gather_v");
      std::vector<std::size_t> send_counts(1, ints.size());
      counts = co_await c.all_to_all_v(ibuf, send_counts, v);
      require(counts == std::vector<std::size_t>{ints.size()} && v == ints, "all_to_all_v");
      dcomm::cuda::device_buffer<double> empty;
      co_await c.all_reduce(empty, dcomm::sum);
      std::string word = "nccl";
      co_await c.broadcast_object(word, 0);
      auto words = co_await c.all_gather_object(word);
      require(words == std::vector<std::string>{"nccl"}, "all_gather_object");
      auto part = co_await c.split(0, 0);
      require(part.has_value() && part->size() == 1, "split");
      co_await part->all_reduce(buf, dcomm::sum);
      auto alone = c.new_group({0});
      require(alone.has_value(), "new_group");
      co_await alone->barrier();
      require(download(buf) == host, "all_reduce on a split group");
    });
    INFO(what);
    CHECK(what.empty());
  }

  TEST_CASE("every dtype through all_reduce sum, float16 and bfloat16 included") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      auto one = [&]<class T>(std::type_identity<T>) -> asio::awaitable<void> {
        std::vector<T> host(33);
        for (std::size_t i = 0; i < host.size(); ++i) host[i] = T(static_cast<float>(i % 7));
        auto d = upload(host);
        co_await c.all_reduce(d, dcomm::sum);
        auto back = download(d);
        for (std::size_t i = 0; i < host.size(); ++i)
          require(static_cast<float>(back[i]) == static_cast<float>(host[i]),
                  std::string(dcomm::name(dcomm::dtype_of_v<T>)));
      };
      co_await one(std::type_identity<std::int8_t>{});
      co_await one(std::type_identity<std::uint8_t>{});
      co_await one(std::type_identity<std::int32_t>{});
      co_await one(std::type_identity<std::int64_t>{});
      co_await one(std::type_identity<dcomm::float16>{});
      co_await one(std::type_identity<dcomm::bfloat16>{});
      co_await one(std::type_identity<float>{});
      co_await one(std::type_identity<double>{});
    });
    INFO(what);
    CHECK(what.empty());
  }

  TEST_CASE("stream-ordered: completes once enqueued; the stream orders the result") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      cudaStream_t s = nullptr;
      dcomm::cuda::check(cudaStreamCreate(&s), "cudaStreamCreate");
      std::vector<double> host(4096, 1.5);
      auto buf = upload(host);
      dcomm::cuda::device_buffer<double> out(host.size());
      co_await c.all_reduce(buf, out, dcomm::sum, {.stream = s});
      dcomm::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      require(download(out) == host, "stream-ordered all_reduce");
      (void)cudaStreamDestroy(s);
    });
    INFO(what);
    CHECK(what.empty());
  }

  TEST_CASE("gradient_bucketer on NCCL: CUDA gradients packed on the GPU, averaged") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      std::vector<float> a(1001), b(70001);
      std::vector<double> d(33);
      for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 13);
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i % 7) + 0.5f;
      for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(i) * 0.25;
      auto ga = upload(a), gb = upload(b);
      auto gd = upload(d);
      dcomm::gradient_bucketer bucketer(
          c, dcomm::bucketer_options{.first_bucket_bytes = 1024, .bucket_bytes = 64 * 1024});
      bucketer.add(ga);
      bucketer.add(gb);
      bucketer.add(gd);
      require(bucketer.bucket_count() >= 3, "one bucket per dtype at least");
      for (int step = 0; step < 3; ++step) {
        bucketer.mark_ready(2);
        bucketer.mark_ready(1);
        bucketer.mark_ready(0);
        co_await bucketer.wait();
        // The average over a world of one is the gradient itself.
        require(download(ga) == a && download(gb) == b && download(gd) == d,
                "step " + std::to_string(step));
      }
    });
    INFO(what);
    CHECK(what.empty());
  }

  TEST_CASE("long operations, one after another and four at once, complete with their results") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    // 256 MiB all_reduce takes ~200 us on an H100, long enough for the
    // awaited form to sleep through most of it (completion_estimate) once
    // it has seen a few; four at once cut each other's naps short.
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      const std::size_t n = std::size_t{64} << 20;
      std::vector<float> host(n);
      for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000);
      auto a = upload(host);
      for (int round = 0; round < 12; ++round) {
        dcomm::cuda::device_buffer<float> out(n);
        if (round % 2)
          co_await c.all_reduce(a, out, dcomm::max);
        else
          co_await c.all_reduce(a, out, dcomm::sum);
        require(download(out) == host, "round " + std::to_string(round));
      }
      auto b = upload(host), d = upload(host), e = upload(host);
      int done = 0;
      std::string failed;
      auto ex = co_await asio::this_coro::executor;
      for (auto* buf : {&a, &b, &d, &e})
        c.all_reduce(*buf, dcomm::avg, [&](std::exception_ptr p) {
          ++done;
          if (p) try {
              std::rethrow_exception(p);
            } catch (const std::exception& x) {
              failed = x.what();
            }
        });
      asio::steady_timer t(ex);
      while (done < 4) {
        t.expires_after(1ms);
        co_await t.async_wait(asio::use_awaitable);
      }
      require(failed.empty(), failed);
      for (auto* buf : {&a, &b, &d, &e}) require(download(*buf) == host, "four at once");
    });
    INFO(what);
    CHECK(what.empty());
  }

  TEST_CASE("host memory and another GPU's memory are refused before anything is sent") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      std::vector<float> host(8, 1.0f);
      try {
        co_await c.all_reduce(host, dcomm::sum);
        require(false, "host memory was accepted");
      } catch (const dcomm::error& e) {
        require(e.code() == dcomm::errc::invalid_argument && contains(e.what(), "host memory"),
                e.what());
      }
      dcomm::cuda::device_span<float> elsewhere(reinterpret_cast<float*>(std::uintptr_t{0x1000}), 8,
                                                c.backend().device() + 1);
      try {
        co_await c.broadcast(elsewhere, 0);
        require(false, "another device's memory was accepted");
      } catch (const dcomm::error& e) {
        require(e.code() == dcomm::errc::invalid_argument && contains(e.what(), "device"),
                e.what());
      }
      co_await c.barrier();  // still usable
    });
    INFO(what);
    CHECK(what.empty());
  }

  TEST_CASE("abort fails what comes next with errc::aborted") {
    DCOMM_TEST_DEADLINE(120s);
    if (!gpu_present()) return;
    auto what = world_of_one([](nccl_comm& c) -> asio::awaitable<void> {
      co_await c.barrier();
      c.abort();
      try {
        co_await c.barrier();
        require(false, "a barrier after abort() succeeded");
      } catch (const dcomm::error& e) {
        require(e.code() == dcomm::errc::aborted, e.what());
      }
    });
    INFO(what);
    CHECK(what.empty());
  }
}
#endif  // DCOMM_HAS_NCCL
