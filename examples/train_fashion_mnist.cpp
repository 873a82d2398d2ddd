// Distributed synchronous SGD on Fashion-MNIST: the PyTorch tutorial's
// run() / average_gradients() program in C++, and the README's demo.
//
//   dcomm-run -n 4 train_fashion_mnist            4 ranks from env://
//   train_fashion_mnist --world 4                 the same, spawned here
//   train_fashion_mnist --world 1                 one rank, same result
//   mpirun -np 4 train_fashion_mnist --backend mpi   the MPI backend, ranks from mpirun
//                                                 (where dcomm was built with MPI)
//   dcomm-run -n 4 --elastic train_fashion_mnist --elastic
//                                                 trains on through failures:
//                                                 elastic_training.hpp
//
// Each rank reads its share of the training set (distributed_sampler,
// seeded: the 128 samples of a step are the same whatever the world size),
// with a batch of 128 / world; a two-layer perceptron (784-128-10, ReLU)
// computes its gradients by hand; gradient_bucketer averages them while the
// backward pass goes on (or, with --average per_tensor, the tutorial's
// average_gradients: one all_reduce per parameter). Rank 0 prints each
// epoch's loss, throughput and time, the share of the ranks' time spent
// waiting for communication, and the slowest rank (the one that called
// the collectives last most often: comm.stats()); then the test accuracy,
// counted by every rank on its shard of the test set and summed with
// all_reduce.
//
// Options: --backend cpu|mpi, --world N, --epochs 3, --lr 0.05, --momentum 0.9, --batch 128,
// --seed 1234, --data DIR (/usr/share/datasets/fashion-mnist),
// --train-limit N (use the first N training images), --average
// bucketer|per_tensor, --slow-rank R --slow-ms MS (rank R sleeps MS
// milliseconds per step, as a slow data loader would: a straggler to find),
// --elastic (--grow-every N: the steps between admissions of replacements; 10).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dcomm/dcomm.hpp>
#include <filesystem>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "elastic_training.hpp"
#include "fashion_mnist.hpp"
#include "mlp.hpp"

#if DCOMM_HAS_MPI
#include <dcomm/mpi.hpp>
#endif

using namespace std::chrono_literals;
using fashion_mnist::dataset;
using fashion_mnist::load;

namespace {

struct settings {
  std::string backend = "cpu";
  int world = 0;  // 0: one rank of a launched job (env://, or mpirun's)
  int epochs = 3;
  float lr = 0.05f;
  float momentum = 0.9f;
  int batch = 128;  // in total, split across ranks
  std::uint64_t seed = 1234;
  std::string data = fashion_mnist::default_dir;
  std::size_t train_limit = 0;
  bool bucketer = true;
  int slow_rank = -1;
  int slow_ms = 0;
  bool elastic = false;
  int grow_every = 10;
};

// --------------------------------------------------------- training

// The rank that called the collectives last most often since the previous
// look (comm.stats(): measured from the calls' own messages), and by how
// much on average.
struct slowest_rank {
  std::vector<std::uint64_t> last;
  std::vector<double> late_us;  // total, per rank
  std::uint64_t measured = 0;

  std::string since_last(const dcomm::trace::comm_stats& now) {
    last.resize(now.ranks.size());
    late_us.resize(now.ranks.size());
    int who = -1;
    std::uint64_t most = 0;
    double late = 0;
    for (const auto& r : now.ranks) {
      const auto i = static_cast<std::size_t>(r.rank);
      const std::uint64_t n = r.last - last[i];
      const double total = r.late_mean_us * static_cast<double>(r.last);
      if (n > most) {
        most = n;
        who = r.rank;
        late = (total - late_us[i]) / static_cast<double>(n);
      }
      last[i] = r.last;
      late_us[i] = total;
    }
    const std::uint64_t calls = now.collectives_measured - measured;
    measured = now.collectives_measured;
    if (who < 0) return "no collectives between ranks";
    char b[160];
    std::snprintf(b, sizeof b,
                  "slowest rank %d (last into %.0f%% of %llu collectives, %.2f ms late)", who,
                  100.0 * static_cast<double>(most) / static_cast<double>(calls),
                  static_cast<unsigned long long>(calls), late / 1e3);
    return b;
  }
};

template <class Backend>
struct trainer {
  using comm_t = dcomm::communicator<Backend>;
  const settings& s;
  comm_t& comm;
  const dataset& train;
  mlp model;
  gradients grad;
  std::vector<std::vector<float>> velocity;  // sgd_step's, made on its first step
  backward_work work;
  double waited = 0;  // seconds spent waiting for gradients to be averaged

  trainer(const settings& options, comm_t& c, const dataset& data)
      : s(options), comm(c), train(data), model(options.seed) {}

  // The tutorial's average_gradients: one all_reduce per parameter.
  void average_gradients() {
    const auto size = static_cast<float>(comm.size());
    for (auto* g : grad.all()) {
      comm.all_reduce(*g, dcomm::sum, dcomm::blocking);
      for (auto& x : *g) x /= size;
    }
  }

  // Forward and backward over one local batch; returns its mean loss.
  // Gradients of the second layer are complete first: with the bucketer,
  // their all_reduce runs while the first layer's are computed.
  float step(std::span<const std::size_t> batch, dcomm::gradient_bucketer<Backend>* b) {
    if (comm.rank() == s.slow_rank)
      std::this_thread::sleep_for(std::chrono::milliseconds(s.slow_ms));
    const float loss = backward(model, train, batch, grad, work, [&] {
      if (b) {
        b->mark_ready(2);  // w2
        b->mark_ready(3);  // b2
      }
    });
    const auto wait_start = std::chrono::steady_clock::now();
    if (b) {
      b->mark_ready(0);
      b->mark_ready(1);
      b->wait(dcomm::blocking);
    } else {
      average_gradients();
    }
    waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
    // SGD with momentum, as torch.optim.SGD: v = m v + g; p -= lr v.
    sgd_step(model, grad, velocity, s.lr, s.momentum);
    return loss;
  }
};

template <class Backend>
int run(const settings& s) {
  auto comm = dcomm::init_process_group<Backend>({.init_method = "env://", .timeout = 60s});
  const int rank = comm.rank(), world = comm.size();
  auto say = [&](const char* line) {
    if (rank == 0) {
      std::fputs(line, stdout);
      std::fflush(stdout);
    }
  };
  char line[256];
  if (s.batch % world != 0)
    throw std::runtime_error("the batch of " + std::to_string(s.batch) +
                             " does not split evenly over " + std::to_string(world) + " ranks");
  const dataset train = load(s.data, "train", s.train_limit);
  const dataset test = load(s.data, "t10k", 0);

  trainer<Backend> t(s, comm, train);
  // Every replica starts from rank 0's weights, as DDP does.
  for (auto* p : t.model.parameters()) comm.broadcast(*p, 0, dcomm::blocking);
  dcomm::gradient_bucketer<Backend> bucketer(comm);
  for (auto* g : t.grad.all()) bucketer.add(*g);

  dcomm::distributed_sampler sampler(
      {.dataset_size = train.size(), .num_replicas = world, .rank = rank, .seed = s.seed});
  const std::size_t local_batch = static_cast<std::size_t>(s.batch / world);
  std::snprintf(line, sizeof line,
                "Fashion-MNIST: %zu training images, %d rank(s), batch %d (%zu per rank), %s\n",
                train.size(), world, s.batch, local_batch,
                s.bucketer ? "gradients averaged by gradient_bucketer"
                           : "gradients averaged per tensor (the tutorial's average_gradients)");
  say(line);
  const auto start = std::chrono::steady_clock::now();
  slowest_rank slowest;
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const auto epoch_start = std::chrono::steady_clock::now();
    t.waited = 0;
    const auto& order = sampler.indices();
    double loss_sum = 0;
    std::size_t batches = 0;
    for (std::size_t at = 0; at < order.size(); at += local_batch, ++batches) {
      std::span<const std::size_t> batch(order.data() + at,
                                         std::min(local_batch, order.size() - at));
      loss_sum += t.step(batch, s.bucketer ? &bucketer : nullptr);
    }
    // The epoch's loss and share of time waiting for communication,
    // averaged over ranks, as every rank sees them.
    const double busy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    std::vector<double> mean{loss_sum / static_cast<double>(batches), t.waited / busy};
    comm.all_reduce(mean, dcomm::avg, dcomm::blocking);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    std::snprintf(line, sizeof line,
                  "epoch %d: loss %.4f, %.0f images/s, %.1f s; waiting for communication %.0f%% "
                  "of the time; %s\n",
                  epoch + 1, mean[0], static_cast<double>(sampler.total_size()) / seconds, seconds,
                  100.0 * mean[1], slowest.since_last(comm.stats()).c_str());
    say(line);
  }

  // Each rank scores its shard of the test set; the counts are summed.
  auto counts = score(t.model, test, static_cast<std::size_t>(rank),
                      static_cast<std::size_t>(world));  // correct, seen
  comm.all_reduce(counts, dcomm::sum, dcomm::blocking);
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::snprintf(line, sizeof line, "test accuracy: %.2f%% (%lld of %lld), trained in %.1f s\n",
                100.0 * static_cast<double>(counts[0]) / static_cast<double>(counts[1]),
                static_cast<long long>(counts[0]), static_cast<long long>(counts[1]), total);
  say(line);
  return 0;
}

settings parse(int argc, char** argv) {
  settings s;
  dcomm::command_line cl("train_fashion_mnist",
                         "Distributed synchronous SGD on Fashion-MNIST: a two-layer perceptron, "
                         "its gradients averaged across the ranks.");
  cl.option("backend", s.backend, "cpu|mpi",
            "mpi: the MPI backend, ranks from mpirun (where built with MPI); cpu")
      .one_of({"cpu", "mpi"});
  fashion_mnist::training_options(cl, s, "images per step, split across the ranks");
  cl.choice("average", s.bucketer, {{"bucketer", true}, {"per_tensor", false}},
            "bucketer|per_tensor",
            "gradient_bucketer during the backward pass, or one all_reduce per parameter after "
            "it; bucketer");
  cl.option("slow-rank", s.slow_rank, "R", "this rank sleeps --slow-ms per step (a straggler)");
  cl.option("slow-ms", s.slow_ms, "MS", "how long it sleeps; 0").at_least(0);
  cl.flag("elastic", s.elastic,
          "train on through failures: shrink, heal, admit replacements (under dcomm-run "
          "--elastic; docs/elastic.md)");
  cl.option("grow-every", s.grow_every, "N",
            "with --elastic: steps between admissions of replacements; 10")
      .at_least(1);
  cl.parse(argc, argv);
  if (s.elastic && (s.backend != "cpu" || s.world > 0 || !s.bucketer || s.slow_rank >= 0))
    cl.fail(
        "--elastic runs the cpu backend's ranks of a launched job (dcomm-run --elastic), "
        "averaging with the bucketer; not with --world, --backend mpi, --average "
        "per_tensor or --slow-rank");
  if (s.backend == "mpi" && s.world > 0)
    cl.fail("--backend mpi takes its ranks from mpirun, not --world");
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    // Fail before starting ranks when the data is not there.
    load(s.data, "t10k", 1);
    if (s.backend == "mpi") {
#if DCOMM_HAS_MPI
      return run<dcomm::mpi_backend>(s);
#else
      throw std::invalid_argument("--backend mpi: this build has no MPI (meson's mpi feature)");
#endif
    }
    if (s.elastic) return elastic_training::train(s);
    if (s.world > 0)
      dcomm::spawn(s.world, [&](int) { return run<dcomm::cpu_backend>(s); });
    else
      run<dcomm::cpu_backend>(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
