// A parameter server over remote calls (dcomm/rpc.hpp) on Fashion-MNIST,
// as in torch's RPC parameter-server tutorial: rank 0 holds the model and
// applies updates; every other rank trains: step after step it fetches the
// current weights ("get_weights"), computes gradients on its own batch and
// pushes them ("push_gradients"), without waiting for the other trainers
// (asynchronous SGD: a gradient may be a few updates stale). When every
// trainer is done (rpc shutdown: the group goes quiet), rank 0 scores the
// test set.
//
//   dcomm-run -n 3 parameter_server      rank 0 serves, ranks 1 and 2 train (env://)
//   parameter_server --world 3           the same, spawned here
//
// Options: --world N, --epochs 2, --lr 0.05, --momentum 0.5, --batch 64
// (images per push), --seed 1234, --data DIR, --train-limit N.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <dcomm/dcomm.hpp>
#include <dcomm/rpc.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist.hpp"
#include "mlp.hpp"

using namespace std::chrono_literals;
using fashion_mnist::dataset;

namespace {

struct settings {
  int world = 0;  // 0: one rank of a launched job (env://)
  int epochs = 2;
  float lr = 0.05f;
  // Less than the synchronous demo's 0.9: with a few trainers a pushed
  // gradient is an update or two stale, and heavy momentum amplifies that
  // (0.9: 73% after the test's two epochs; 0.5: 83%).
  float momentum = 0.5f;
  int batch = 64;
  std::uint64_t seed = 1234;
  std::string data = fashion_mnist::default_dir;
  std::size_t train_limit = 0;
};

using comm_t = dcomm::communicator<dcomm::cpu_backend>;
using agent_t = dcomm::rpc::agent<dcomm::cpu_backend>;

// The model's parameters as one vector, and back.
std::vector<float> flatten(const std::vector<std::vector<float>*>& parts) {
  std::vector<float> flat;
  for (const auto* p : parts) flat.insert(flat.end(), p->begin(), p->end());
  return flat;
}
void unflatten(std::span<const float> flat, const std::vector<std::vector<float>*>& parts) {
  std::size_t at = 0;
  for (auto* p : parts) at += p->size();
  if (flat.size() != at)
    throw std::invalid_argument("expected " + std::to_string(at) + " values, got " +
                                std::to_string(flat.size()));
  at = 0;
  for (auto* p : parts) {
    std::copy(flat.begin() + static_cast<std::ptrdiff_t>(at),
              flat.begin() + static_cast<std::ptrdiff_t>(at + p->size()), p->begin());
    at += p->size();
  }
}

// Rank 0: serves the weights and applies each push as it arrives.
asio::awaitable<void> serve(comm_t& comm, const settings& s) {
  mlp model(s.seed);
  gradients grad;
  std::vector<std::vector<float>> velocity;
  std::int64_t updates = 0;
  dcomm::rpc::registry functions;
  functions.add("get_weights", [&] { return flatten(model.parameters()); });
  functions.add("push_gradients", [&](std::vector<float> g) {
    unflatten(g, grad.all());
    sgd_step(model, grad, velocity, s.lr, s.momentum);
    return ++updates;
  });
  const auto start = std::chrono::steady_clock::now();
  // Shutdown waits for the trainers: as long as a training run may take.
  auto rpc = co_await dcomm::rpc::start(comm, functions, {.shutdown_timeout = 1h});
  std::printf("parameter server: rank 0 holds the model (%zu parameters); %d trainer(s)\n",
              flatten(model.parameters()).size(), comm.size() - 1);
  std::fflush(stdout);
  co_await rpc.shutdown();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const dataset test = fashion_mnist::load(s.data, "t10k", 0);
  const auto counts = score(model, test, 0, 1);
  std::printf("%lld updates in %.1f s (%.0f images/s)\n", static_cast<long long>(updates), seconds,
              static_cast<double>(updates) * s.batch / seconds);
  std::printf("test accuracy: %.2f%% (%lld of %lld)\n",
              100.0 * static_cast<double>(counts[0]) / static_cast<double>(counts[1]),
              static_cast<long long>(counts[0]), static_cast<long long>(counts[1]));
  std::fflush(stdout);
}

// Ranks 1..N-1: fetch, compute, push, on their share of the training set.
asio::awaitable<void> train(comm_t& comm, const settings& s) {
  dcomm::rpc::registry nothing;  // a trainer serves no function
  auto rpc = co_await dcomm::rpc::start(comm, nothing);
  const dataset data = fashion_mnist::load(s.data, "train", s.train_limit);
  const int trainers = comm.size() - 1, me = comm.rank() - 1;
  dcomm::distributed_sampler sampler(
      {.dataset_size = data.size(), .num_replicas = trainers, .rank = me, .seed = s.seed});
  mlp model(s.seed);
  gradients grad;
  backward_work work;
  const auto batch = static_cast<std::size_t>(s.batch);
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const auto& order = sampler.indices();
    double loss = 0;
    std::size_t steps = 0;
    for (std::size_t at = 0; at < order.size(); at += batch, ++steps) {
      auto weights = co_await rpc.call<std::vector<float>>(0, "get_weights");
      unflatten(weights, model.parameters());
      loss += backward(model, data, {order.data() + at, std::min(batch, order.size() - at)}, grad,
                       work, [] {});
      const auto pushed = flatten(grad.all());
      co_await rpc.call<std::int64_t>(0, "push_gradients", pushed);
    }
    std::printf("trainer %d: epoch %d: loss %.4f over %zu steps\n", comm.rank(), epoch + 1,
                loss / static_cast<double>(steps), steps);
    std::fflush(stdout);
  }
  co_await rpc.shutdown();
}

asio::awaitable<void> run(const settings& s) {
  auto ex = co_await asio::this_coro::executor;
  dcomm::init_options<dcomm::cpu_backend> options{.init_method = "env://", .timeout = 60s};
  auto comm = co_await dcomm::init_process_group<dcomm::cpu_backend>(ex, options);
  if (comm.size() < 2)
    throw std::invalid_argument("a parameter server needs at least one trainer: 2 ranks or more");
  if (comm.rank() == 0)
    co_await serve(comm, s);
  else
    co_await train(comm, s);
}

settings parse(int argc, char** argv) {
  settings s;
  dcomm::command_line cl("parameter_server",
                         "Asynchronous SGD on Fashion-MNIST through a parameter server over "
                         "remote calls: rank 0 holds the model, the others train.");
  fashion_mnist::training_options(cl, s, "images per push");
  cl.parse(argc, argv);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    fashion_mnist::load(s.data, "t10k", 1);  // fail before starting ranks without the data
    auto rank = [&](int) {
      dcomm::sync_wait(run(s));
      return 0;
    };
    if (s.world > 0)
      dcomm::spawn(s.world, rank);
    else
      rank(0);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parameter_server: %s\n", e.what());
    return 1;
  }
}
