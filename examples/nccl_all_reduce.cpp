// The tutorial's all_reduce on GPUs: communicator<nccl_backend> over device
// buffers, one rank per GPU. Run it under a launcher (one rank per GPU):
//
//   dcomm-run -n 2 build/gcc/examples/nccl_all_reduce
//
// or alone (a world of one). It checks its own results: each rank fills a
// buffer with rank + 1, sums it over the world, averages it stream-ordered
// on a stream of its own, and compares with what arithmetic says. Exits
// with 77 (a skipped test, to Meson) where no GPU is visible.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dcomm/communicator.hpp"
#include "dcomm/cuda.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/nccl.hpp"

namespace {

asio::awaitable<int> run(dcomm::init_options<dcomm::nccl_backend> options) {
  auto executor = co_await asio::this_coro::executor;
  auto comm = co_await dcomm::init_process_group<dcomm::nccl_backend>(executor, options);
  const int rank = comm.rank(), world = comm.size(), gpu = comm.backend().device();
  dcomm::cuda::device_guard on(gpu);

  constexpr std::size_t n = 1 << 20;
  dcomm::cuda::device_buffer<float> grads(n, gpu);
  grads.copy_from(std::vector<float>(n, float(rank + 1)));

  // Completes when the GPU has finished: the result can be read at once.
  co_await comm.all_reduce(grads, dcomm::sum);
  std::vector<float> host(n);
  grads.copy_to(host);
  const float sum = float(world * (world + 1) / 2);
  int wrong = 0;
  for (float x : host) wrong += x != sum;
  std::printf(
      "rank %d of %d on GPU %d: all_reduce(sum) of %zu floats = %.1f (expected %.1f), %d wrong\n",
      rank, world, gpu, n, double(host[0]), double(sum), wrong);

  // Stream-ordered: completes once enqueued on `stream`; later work on the
  // stream (here the copy back) sees the result.
  cudaStream_t stream = nullptr;
  dcomm::cuda::check(cudaStreamCreate(&stream), "cudaStreamCreate");
  co_await comm.all_reduce(grads, dcomm::avg, {.stream = stream});
  dcomm::cuda::check(cudaMemcpyAsync(host.data(), grads.data(), grads.size_bytes(),
                                     cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync");
  dcomm::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  (void)cudaStreamDestroy(stream);
  int wrong_avg = 0;
  for (float x : host) wrong_avg += x != sum;  // the average of equal sums is the sum
  std::printf("rank %d: stream-ordered all_reduce(avg) = %.1f (expected %.1f), %d wrong\n", rank,
              double(host[0]), double(sum), wrong_avg);
  co_await comm.barrier();
  co_return wrong + wrong_avg == 0 ? 0 : 1;
}

}  // namespace

int main() {
  if (dcomm::cuda::device_count() == 0) {
    std::puts("nccl_all_reduce: skipped: no CUDA device is visible to this process");
    return 77;
  }
  dcomm::init_options<dcomm::nccl_backend> options;  // env://, as torchrun and dcomm-run set it
  const std::string marker = "/tmp/dcomm-nccl-all-reduce-" + std::to_string(::getpid());
  if (!std::getenv("WORLD_SIZE")) {  // alone: a world of one
    options.init_method = "file://" + marker;
    options.rank = 0;
    options.world_size = 1;
  }
  try {
    asio::io_context context;
    const int status = dcomm::sync_wait(context, run(options));
    std::remove(marker.c_str());
    return status;
  } catch (const dcomm::error& e) {
    std::fprintf(stderr, "nccl_all_reduce: %s\n", e.what());
    std::remove(marker.c_str());
    return 1;
  }
}
