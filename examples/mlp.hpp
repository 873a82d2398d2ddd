// The examples' model: a two-layer perceptron (784-128-10, ReLU,
// log_softmax) with its gradients computed by hand, and torch.optim.SGD's
// step. Shared by train_fashion_mnist (synchronous data parallelism) and
// parameter_server (asynchronous SGD over RPC).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "fashion_mnist.hpp"

// 784 -> 128 (ReLU) -> 10 -> log_softmax. Weights are stored input-major,
// so every inner loop runs over contiguous outputs and vectorises.
struct mlp {
  static constexpr std::size_t in = 784, hidden = 128, out = 10;
  std::vector<float> w1 = std::vector<float>(in * hidden), b1 = std::vector<float>(hidden),
                     w2 = std::vector<float>(hidden * out), b2 = std::vector<float>(out);

  // torch.nn.Linear's default: uniform in +-1/sqrt(fan_in).
  explicit mlp(std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    auto init = [&](std::vector<float>& v, std::size_t fan_in) {
      std::uniform_real_distribution<float> u(-1.0f / std::sqrt(static_cast<float>(fan_in)),
                                              1.0f / std::sqrt(static_cast<float>(fan_in)));
      for (auto& x : v) x = u(gen);
    };
    init(w1, in);
    init(b1, in);
    init(w2, hidden);
    init(b2, hidden);
  }
  std::vector<std::vector<float>*> parameters() { return {&w1, &b1, &w2, &b2}; }

  // Hidden activations and logits of one image.
  void forward(std::span<const float> x, float* h, float* z) const {
    std::copy(b1.begin(), b1.end(), h);
    for (std::size_t k = 0; k < in; ++k) {
      const float xk = x[k];
      const float* row = w1.data() + k * hidden;
      for (std::size_t j = 0; j < hidden; ++j) h[j] += xk * row[j];
    }
    for (std::size_t j = 0; j < hidden; ++j) h[j] = std::max(h[j], 0.0f);
    std::copy(b2.begin(), b2.end(), z);
    for (std::size_t j = 0; j < hidden; ++j) {
      const float* row = w2.data() + j * out;
      for (std::size_t o = 0; o < out; ++o) z[o] += h[j] * row[o];
    }
  }
  static void log_softmax(float* z) {
    float top = *std::max_element(z, z + out), sum = 0;
    for (std::size_t o = 0; o < out; ++o) sum += std::exp(z[o] - top);
    const float log_sum = top + std::log(sum);
    for (std::size_t o = 0; o < out; ++o) z[o] -= log_sum;
  }
};

struct gradients {
  std::vector<float> w1 = std::vector<float>(mlp::in * mlp::hidden),
                     b1 = std::vector<float>(mlp::hidden),
                     w2 = std::vector<float>(mlp::hidden * mlp::out),
                     b2 = std::vector<float>(mlp::out);
  std::vector<std::vector<float>*> all() { return {&w1, &b1, &w2, &b2}; }
  void zero() {
    for (auto* g : all()) std::fill(g->begin(), g->end(), 0.0f);
  }
};

// What backward() keeps between calls (per sample of a batch).
struct backward_work {
  std::vector<float> hidden, logits, dz, dh;
};

// Forward and backward over one batch: fills grad (zeroed first) with the
// gradients of the batch's mean loss, which it returns. The second layer's
// gradients are complete first: second_layer_done() is called then (a
// gradient_bucketer starts averaging them while the first layer's are
// computed).
template <class SecondLayerDone>
float backward(const mlp& model, const fashion_mnist::dataset& data,
               std::span<const std::size_t> batch, gradients& grad, backward_work& w,
               SecondLayerDone&& second_layer_done) {
  const std::size_t n = batch.size(), H = mlp::hidden, O = mlp::out;
  w.hidden.resize(n * H);
  w.logits.resize(n * O);
  w.dz.resize(n * O);
  w.dh.resize(H);
  grad.zero();
  float loss = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float* z = w.logits.data() + i * O;
    model.forward(data.image(batch[i]), w.hidden.data() + i * H, z);
    mlp::log_softmax(z);
    const auto y = data.labels[batch[i]];
    loss -= z[y];
    // d(mean nll)/dz = (softmax - onehot) / n
    for (std::size_t o = 0; o < O; ++o)
      w.dz[i * O + o] = (std::exp(z[o]) - (o == y ? 1.0f : 0.0f)) / static_cast<float>(n);
  }
  for (std::size_t i = 0; i < n; ++i) {
    const float* h = w.hidden.data() + i * H;
    for (std::size_t j = 0; j < H; ++j)
      for (std::size_t o = 0; o < O; ++o) grad.w2[j * O + o] += h[j] * w.dz[i * O + o];
    for (std::size_t o = 0; o < O; ++o) grad.b2[o] += w.dz[i * O + o];
  }
  second_layer_done();
  for (std::size_t i = 0; i < n; ++i) {
    const float* h = w.hidden.data() + i * H;
    for (std::size_t j = 0; j < H; ++j) {
      float acc = 0;
      for (std::size_t o = 0; o < O; ++o) acc += w.dz[i * O + o] * model.w2[j * O + o];
      w.dh[j] = h[j] > 0 ? acc : 0.0f;
    }
    auto x = data.image(batch[i]);
    for (std::size_t k = 0; k < mlp::in; ++k) {
      const float xk = x[k];
      float* row = grad.w1.data() + k * H;
      for (std::size_t j = 0; j < H; ++j) row[j] += xk * w.dh[j];
    }
    for (std::size_t j = 0; j < H; ++j) grad.b1[j] += w.dh[j];
  }
  return loss / static_cast<float>(n);
}

// SGD with momentum, as torch.optim.SGD: v = m v + g; p -= lr v.
inline void sgd_step(mlp& model, gradients& grad, std::vector<std::vector<float>>& velocity,
                     float lr, float momentum) {
  auto params = model.parameters();
  auto grads = grad.all();
  if (velocity.empty())
    for (auto* p : params) velocity.emplace_back(p->size(), 0.0f);
  for (std::size_t p = 0; p < params.size(); ++p)
    for (std::size_t i = 0; i < params[p]->size(); ++i) {
      velocity[p][i] = momentum * velocity[p][i] + (*grads[p])[i];
      (*params[p])[i] -= lr * velocity[p][i];
    }
}

// The share of `data` (every stride-th image from `first`) that the model
// classifies right: {correct, seen}.
inline std::vector<std::int64_t> score(const mlp& model, const fashion_mnist::dataset& data,
                                       std::size_t first, std::size_t stride) {
  std::vector<std::int64_t> counts{0, 0};
  std::vector<float> h(mlp::hidden), z(mlp::out);
  for (std::size_t i = first; i < data.size(); i += stride) {
    model.forward(data.image(i), h.data(), z.data());
    counts[0] += std::max_element(z.begin(), z.end()) - z.begin() == data.labels[i];
    counts[1] += 1;
  }
  return counts;
}
