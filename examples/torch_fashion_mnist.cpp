// A torch::nn model trained data-parallel, dcomm averaging its gradients:
// what DistributedDataParallel does, with libtorch for the model and dcomm
// for the communication (dcomm/torch.hpp makes torch::Tensor a dcomm
// tensor).
//
//   torch_fashion_mnist --world 4      4 local ranks
//   dcomm-run -n 4 torch_fashion_mnist
//
// Options: --world N, --epochs 2, --lr 0.05, --momentum 0.9, --batch 128,
// --train-limit N, --data DIR.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <dcomm/dcomm.hpp>
#include <dcomm/torch.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist.hpp"

using namespace std::chrono_literals;

namespace {

struct settings {
  int world = 0;
  int epochs = 2;
  double lr = 0.05, momentum = 0.9;
  int batch = 128;
  std::size_t train_limit = 0;
  std::string data = fashion_mnist::default_dir;
};

torch::Tensor as_tensor(const fashion_mnist::dataset& d) {
  // A view of the loaded images; the dataset outlives every use.
  return torch::from_blob(const_cast<float*>(d.images.data()),
                          {static_cast<std::int64_t>(d.size()), 784}, torch::kFloat32);
}

int run(const settings& s) {
  auto comm =
      dcomm::init_process_group<dcomm::cpu_backend>({.init_method = "env://", .timeout = 60s});
  const int rank = comm.rank(), world = comm.size();
  if (s.batch % world != 0)
    throw std::runtime_error("the batch does not split evenly over the ranks");
  const auto train = fashion_mnist::load(s.data, "train", s.train_limit);
  const auto test = fashion_mnist::load(s.data, "t10k", 0);
  const auto train_x = as_tensor(train), test_x = as_tensor(test);
  const auto train_y =
      torch::tensor(std::vector<std::int64_t>(train.labels.begin(), train.labels.end()));

  torch::manual_seed(1234);
  torch::nn::Sequential model(torch::nn::Linear(784, 128), torch::nn::ReLU(),
                              torch::nn::Linear(128, 10));
  auto params = model->parameters();
  // DDP's start: every replica takes rank 0's weights.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : params) comm.broadcast(p, 0, dcomm::blocking);
  }
  // Gradients allocated once, so autograd accumulates into the buffers the
  // bucketer holds (it borrows them, as DDP's buckets view them).
  dcomm::gradient_bucketer bucketer(comm);
  for (auto& p : params) {
    p.mutable_grad() = torch::zeros_like(p);
    bucketer.add(p.mutable_grad());
  }
  std::vector<void*> grad_memory;
  for (auto& p : params) grad_memory.push_back(p.grad().data_ptr());
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(s.lr).momentum(s.momentum));

  dcomm::distributed_sampler sampler(
      {.dataset_size = train.size(), .num_replicas = world, .rank = rank, .seed = 1234});
  const auto local_batch = static_cast<std::size_t>(s.batch / world);
  if (rank == 0)
    std::printf("torch::nn on Fashion-MNIST: %zu training images, %d rank(s), batch %d\n",
                train.size(), world, s.batch);
  const auto start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const auto& order = sampler.indices();
    double loss_sum = 0;
    std::size_t batches = 0;
    for (std::size_t at = 0; at < order.size(); at += local_batch, ++batches) {
      std::vector<std::int64_t> picked(
          order.begin() + static_cast<std::ptrdiff_t>(at),
          order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), at + local_batch)));
      auto index = torch::tensor(picked);
      for (auto& p : params) p.mutable_grad().zero_();
      auto output = torch::log_softmax(model->forward(train_x.index_select(0, index)), 1);
      auto loss = torch::nll_loss(output, train_y.index_select(0, index));
      loss.backward();
      for (std::size_t i = 0; i < params.size(); ++i)
        if (params[i].grad().data_ptr() != grad_memory[i])
          throw std::runtime_error("autograd replaced a gradient buffer the bucketer holds");
      bucketer.wait(dcomm::blocking);  // averaged over the ranks
      optimizer.step();
      loss_sum += loss.item<double>();
    }
    std::vector<double> mean{loss_sum / static_cast<double>(batches)};
    comm.all_reduce(mean, dcomm::avg, dcomm::blocking);
    if (rank == 0) std::printf("epoch %d: loss %.4f\n", epoch + 1, mean[0]);
  }
  // Each rank scores a shard of the test set; the counts are summed.
  torch::NoGradGuard no_grad;
  auto shard = torch::arange(rank, static_cast<std::int64_t>(test.size()), world);
  auto predicted = model->forward(test_x.index_select(0, shard)).argmax(1);
  auto labels = torch::tensor(std::vector<std::int64_t>(test.labels.begin(), test.labels.end()))
                    .index_select(0, shard);
  std::vector<std::int64_t> counts{predicted.eq(labels).sum().item<std::int64_t>(), shard.numel()};
  comm.all_reduce(counts, dcomm::sum, dcomm::blocking);
  if (rank == 0)
    std::printf("test accuracy: %.2f%% (%lld of %lld), trained in %.1f s\n",
                100.0 * static_cast<double>(counts[0]) / static_cast<double>(counts[1]),
                static_cast<long long>(counts[0]), static_cast<long long>(counts[1]),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}

settings parse(int argc, char** argv) {
  settings s;
  dcomm::command_line cl("torch_fashion_mnist",
                         "A torch::nn model trained data-parallel, dcomm averaging its gradients.");
  fashion_mnist::training_options(cl, s, "images per step, split across the ranks");
  cl.parse(argc, argv);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    fashion_mnist::load(s.data, "t10k", 1);  // a missing dataset, before any rank starts
    // Each rank computes on one thread: the ranks share the cores.
    torch::set_num_threads(1);
    if (s.world > 0)
      dcomm::spawn(s.world, [&](int) { return run(s); });
    else
      run(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
