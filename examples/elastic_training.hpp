// train_fashion_mnist --elastic: the demo's training, kept going through
// failures (docs/elastic.md). Under dcomm-run --elastic, the job's store
// outlives every rank and a dead rank's slot is restarted with
// DCOMM_JOINING=1:
//
//   - a failure (a lost peer, or the revocation it causes on the others:
//     revoke_on_failure) ends the step's calls on every rank; the survivors
//     shrink to a world of themselves and heal: the most advanced one's
//     model, momentum and step go to the others (none lost, none redone);
//   - every --grow-every steps the members grow: the replacements waiting
//     in join() come in and are healed the same way;
//   - each step's 128 images are the same whatever the world: the ranks
//     split the step's slice of the epoch's permutation, and each scales
//     its gradients by its share, so the bucketer's average is the mean
//     over the 128 (the result does not depend on how many ranks there
//     were at each step, up to the order of the sums);
//   - when done, rank 0 closes the job to joiners (dcomm::close_joins): a
//     replacement still waiting ends (exit 0) instead of waiting out its
//     timeout.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dcomm/dcomm.hpp>
#include <dcomm/elastic.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fashion_mnist.hpp"
#include "mlp.hpp"

namespace elastic_training {

using comm_t = dcomm::communicator<dcomm::cpu_backend>;

// What heal() brings a rank: the model, SGD's momentum, the failures
// counted so far, and (separately) the step.
struct replica {
  mlp model;
  gradients grad;
  std::vector<std::vector<float>> velocity;
  backward_work work;
  std::vector<std::int64_t> failures{0};  // the job's, as its survivors count them

  explicit replica(std::uint64_t seed) : model(seed) {
    for (auto* p : model.parameters()) velocity.emplace_back(p->size(), 0.0f);
  }
  std::vector<std::span<std::uint8_t>> state() {
    std::vector<std::span<std::uint8_t>> s;
    for (auto* p : model.parameters()) s.push_back(dcomm::bytes_of(*p));
    for (auto& v : velocity) s.push_back(dcomm::bytes_of(v));
    s.push_back(dcomm::bytes_of(failures));
    return s;
  }
};

// The first line of an error's message (the rest is its full cause).
inline std::string first_line(const std::exception& e) {
  const std::string what = e.what();
  return what.substr(0, what.find('\n'));
}

// One step over `images` (the step's slice of the epoch's permutation),
// split over the ranks; returns this rank's part of the step's mean loss,
// times the world (the ranks' average is the step's).
inline double train_step(const comm_t& comm, replica& r,
                         dcomm::gradient_bucketer<dcomm::cpu_backend>& bucketer,
                         const fashion_mnist::dataset& train, std::span<const std::size_t> images,
                         float lr, float momentum) {
  const std::size_t n = images.size();
  const auto world = static_cast<std::size_t>(comm.size());
  const auto rank = static_cast<std::size_t>(comm.rank());
  auto mine = images.subspan(n * rank / world, n * (rank + 1) / world - n * rank / world);
  const float loss = mine.empty() ? 0.0f : backward(r.model, train, mine, r.grad, r.work, [] {});
  // The bucketer averages over the ranks: scaled by each one's share, that
  // is the mean over the step's n images.
  const float share = static_cast<float>(mine.size() * world) / static_cast<float>(n);
  for (std::size_t g = 0; auto* grad : r.grad.all()) {
    for (auto& x : *grad) x = mine.empty() ? 0.0f : x * share;
    bucketer.mark_ready(g++);
  }
  bucketer.wait(dcomm::blocking);
  sgd_step(r.model, r.grad, r.velocity, lr, momentum);
  return static_cast<double>(loss) * static_cast<double>(share);
}

// The survivors' world, after a failure: shrink, tried again where it
// fails (a member lost during the shrink itself).
inline comm_t survivors_of(const comm_t& comm) {
  for (int attempt = 1;; ++attempt) {
    try {
      return comm.shrink(dcomm::blocking);
    } catch (const dcomm::error&) {
      if (attempt == 5) throw;  // the job cannot go on here: the launcher restarts this slot
    }
  }
}

// Each rank scores its shard of the test set; the counts are summed. The
// line, for rank 0 to print.
inline std::string test_accuracy(const comm_t& comm, const mlp& model,
                                 const fashion_mnist::dataset& test) {
  auto counts = score(model, test, static_cast<std::size_t>(comm.rank()),
                      static_cast<std::size_t>(comm.size()));  // correct, seen
  comm.all_reduce(counts, dcomm::sum, dcomm::blocking);
  char line[80];
  std::snprintf(line, sizeof line, "test accuracy: %.2f%% (%lld of %lld)",
                100.0 * static_cast<double>(counts[0]) / static_cast<double>(counts[1]),
                static_cast<long long>(counts[0]), static_cast<long long>(counts[1]));
  return line;
}

// Length: the loop of docs/elastic.md, with the demo's lines; its parts
// are above.
template <class Settings>
int train(const Settings& s) {
  using namespace std::chrono_literals;
  dcomm::init_options<dcomm::cpu_backend> o{.init_method = "env://", .timeout = 60s};
  o.backend.revoke_on_failure = true;  // one failure ends the step's calls on every rank
  const char* joining = std::getenv("DCOMM_JOINING");
  const bool joiner = joining && std::string(joining) == "1";
  const fashion_mnist::dataset train = fashion_mnist::load(s.data, "train", s.train_limit);
  const fashion_mnist::dataset test = fashion_mnist::load(s.data, "t10k", 0);
  comm_t comm;
  try {
    comm = joiner ? dcomm::join<dcomm::cpu_backend>(o)
                  : dcomm::init_process_group<dcomm::cpu_backend>(o);
  } catch (const dcomm::error& e) {
    if (!joiner || e.code() != dcomm::errc::closed) throw;
    std::printf("the job is done: nothing to join\n");
    return 0;
  }
  auto say = [&](const std::string& line) {
    if (comm.rank() != 0) return;
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
  };
  replica r(s.seed);
  std::optional<dcomm::gradient_bucketer<dcomm::cpu_backend>> bucketer;
  const std::size_t batch = static_cast<std::size_t>(s.batch);
  const std::int64_t steps_per_epoch =
      static_cast<std::int64_t>((train.size() + batch - 1) / batch);
  const std::int64_t last_step = steps_per_epoch * s.epochs;
  dcomm::distributed_sampler order(
      {.dataset_size = train.size(), .num_replicas = 1, .rank = 0, .seed = s.seed});
  std::int64_t step = joiner ? -1 : 0;  // a joiner has no state: heal brings it one
  std::int64_t grown_at = -1;
  bool heal_needed = true;
  double loss_sum = 0;
  say("Fashion-MNIST, elastic: " + std::to_string(train.size()) + " training images, " +
      std::to_string(comm.size()) + " rank(s), batch " + std::to_string(batch) + "\n");
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    try {
      if (heal_needed) {
        auto state = r.state();
        const dcomm::heal_result healed = dcomm::heal(comm, step, state, dcomm::blocking);
        if (!healed.healed.empty() && step >= 0)
          say("step " + std::to_string(healed.step) + ": healed " +
              std::to_string(healed.healed.size()) + " rank(s) from rank " +
              std::to_string(healed.source) + "\n");
        step = grown_at = healed.step;
        heal_needed = false;
        bucketer.emplace(comm);  // a new communicator, or a step that failed in its buckets
        for (auto* g : r.grad.all()) bucketer->add(*g);
      }
      if (step >= last_step) {
        const std::string accuracy = test_accuracy(comm, r.model, test);
        char line[120];
        std::snprintf(
            line, sizeof line,
            ", trained in %.1f s through %d failure(s), ending with %d rank(s)\n",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
            static_cast<int>(r.failures[0]), comm.size());
        say(accuracy + line);
        if (comm.rank() == 0) dcomm::close_joins(comm, dcomm::blocking);
        return 0;
      }
      if (step % s.grow_every == 0 && step != grown_at) {
        grown_at = step;
        comm_t grown = dcomm::grow(comm, o, dcomm::blocking);
        if (grown.size() != comm.size()) {
          comm = std::move(grown);
          say("step " + std::to_string(step) + ": " + std::to_string(comm.size()) +
              " rank(s) after admitting the replacements waiting\n");
          heal_needed = true;
          continue;
        }
      }
      order.set_epoch(static_cast<std::uint64_t>(step / steps_per_epoch));
      const std::size_t first = static_cast<std::size_t>(step % steps_per_epoch) * batch;
      std::span<const std::size_t> images(order.indices().data() + first,
                                          std::min(batch, train.size() - first));
      loss_sum += train_step(comm, r, *bucketer, train, images, s.lr, s.momentum);
      ++step;
      if (step % steps_per_epoch == 0) {
        std::vector<double> mean{loss_sum / static_cast<double>(steps_per_epoch)};
        loss_sum = 0;
        comm.all_reduce(mean, dcomm::avg, dcomm::blocking);
        char line[160];
        std::snprintf(
            line, sizeof line, "epoch %lld: loss %.4f (%d rank(s)), %.1f s\n",
            static_cast<long long>(step / steps_per_epoch), mean[0], comm.size(),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        say(line);
      }
    } catch (const dcomm::error& e) {
      // A member lost (or a joiner lost while the world grew): the
      // survivors' world, then the most advanced one's state.
      ++r.failures[0];
      const int was = comm.size();
      comm = survivors_of(comm);
      say("step " + std::to_string(step) + ": " + first_line(e) + "\nstep " + std::to_string(step) +
          ": " + std::to_string(comm.size()) + " of " + std::to_string(was) + " rank(s) go on\n");
      heal_needed = true;
    }
  }
}

}  // namespace elastic_training
