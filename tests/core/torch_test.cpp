// dcomm/torch.hpp: torch::Tensor as a dcomm tensor. Its traits (every
// dtype, devices, refusals), collectives on torch tensors in a thread
// world, the gradients of a torch::nn module through p.grad() and
// p.mutable_grad(), gradient_bucketer over them, and torch tensors as
// arguments and results of remote calls (dcomm/rpc/torch.hpp).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "dcomm/gradient_bucketer.hpp"
#include "dcomm/rpc.hpp"
#include "dcomm/rpc/torch.hpp"
#include "dcomm/torch.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::check_failed;
using dcomm::test::comm;
using dcomm::test::require;

namespace {

const std::vector<std::pair<torch::Dtype, dcomm::dtype>> dtypes = {
    {torch::kInt8, dcomm::dtype::int8},       {torch::kUInt8, dcomm::dtype::uint8},
    {torch::kInt32, dcomm::dtype::int32},     {torch::kInt64, dcomm::dtype::int64},
    {torch::kFloat16, dcomm::dtype::float16}, {torch::kBFloat16, dcomm::dtype::bfloat16},
    {torch::kFloat32, dcomm::dtype::float32}, {torch::kFloat64, dcomm::dtype::float64},
};

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const dcomm::error& e) {
    return e.code() == dcomm::errc::invalid_argument ? e.what()
                                                     : "wrong code: " + std::string(e.what());
  }
  return "";
}

}  // namespace

static_assert(dcomm::mutable_tensor<torch::Tensor&>);
static_assert(dcomm::mutable_tensor<const torch::Tensor&>);  // shallow constness, like span

TEST_SUITE("torch") {
  TEST_CASE("traits: every dtype, the element count, the device; views of the memory in place") {
    for (auto [torch_type, dcomm_type] : dtypes) {
      auto t = torch::zeros({3, 5}, torch::TensorOptions().dtype(torch_type));
      auto v = dcomm::mutable_view(t);
      CHECK(v.type == dcomm_type);
      CHECK(v.count == 15);
      CHECK(v.data == t.data_ptr());
      CHECK(v.device == dcomm::device::cpu());
    }
    auto empty = torch::empty({0}, torch::kFloat32);
    CHECK(dcomm::view(empty).count == 0);
  }

  TEST_CASE("refused: strided views, undefined tensors, dtypes dcomm does not have") {
    auto t = torch::zeros({4, 6});
    auto strided = t.t();  // a transposed view: not contiguous
    CHECK(error_of([&] { (void)dcomm::mutable_view(strided); }).find("non-contiguous") !=
          std::string::npos);
    torch::Tensor undefined;
    CHECK(error_of([&] { (void)dcomm::mutable_view(undefined); }).find("undefined") !=
          std::string::npos);
    auto flags = torch::zeros({3}, torch::kBool);
    CHECK(error_of([&] { (void)dcomm::view(flags); }).find("Bool") != std::string::npos);
    auto complex = torch::zeros({3}, torch::kComplexFloat);
    CHECK(!error_of([&] { (void)dcomm::view(complex); }).empty());
  }

  TEST_CASE("collectives on torch tensors of every dtype, world 3") {
    DCOMM_TEST_DEADLINE(120s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      for (auto [torch_type, dcomm_type] : dtypes) {
        auto opts = torch::TensorOptions().dtype(torch_type);
        auto t = torch::full({7, 3}, r + 1, opts);
        co_await c.all_reduce(t, dcomm::sum);
        require(torch::equal(t, torch::full({7, 3}, 6, opts)),
                "all_reduce sum, " + std::string(dcomm::name(dcomm_type)));
        auto b = torch::full({5}, r == 1 ? 9 : 0, opts);
        co_await c.broadcast(b, 1);
        require(torch::equal(b, torch::full({5}, 9, opts)), "broadcast");
        auto mine = torch::full({2}, r, opts);
        auto all = torch::empty({3, 2}, opts);
        co_await c.all_gather(mine, all);
        require(torch::equal(all, torch::arange(3, opts).repeat_interleave(2).reshape({3, 2})),
                "all_gather");
      }
      // Out of place, into a slice that is contiguous (a row of a matrix).
      auto in = torch::full({4}, 2.0 * (r + 1), torch::kFloat64);
      auto rows = torch::zeros({2, 4}, torch::kFloat64);
      auto row = rows[1];
      co_await c.all_reduce(in, row, dcomm::avg);
      require(torch::equal(rows[1], torch::full({4}, 4.0, torch::kFloat64)) &&
                  torch::equal(rows[0], torch::zeros({4}, torch::kFloat64)),
              "all_reduce avg into a row");
    });
  }

  TEST_CASE("a torch::nn module's gradients, averaged per tensor and by gradient_bucketer") {
    DCOMM_TEST_DEADLINE(120s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      torch::manual_seed(7);  // the same weights on both ranks
      torch::nn::Sequential model(torch::nn::Linear(20, 16), torch::nn::ReLU(),
                                  torch::nn::Linear(16, 3));
      // Each rank's own batch: different gradients.
      auto x = torch::full({4, 20}, r + 1.0f) + torch::arange(80).reshape({4, 20}) / 80.0f;
      auto loss = model->forward(x).pow(2).sum();
      loss.backward();
      std::vector<torch::Tensor> local, expected;
      for (auto& p : model->parameters()) local.push_back(p.grad().clone());
      // The expectation: the tutorial's average_gradients, through p.grad()
      // (a const Tensor&) on clones, then the bucketer on the real grads.
      for (auto& g : local) {
        auto e = g.clone();
        co_await c.all_reduce(e, dcomm::sum);
        expected.push_back(e / 2);
      }
      dcomm::gradient_bucketer bucketer(c, {.first_bucket_bytes = 256, .bucket_bytes = 1024});
      for (auto& p : model->parameters()) bucketer.add(p.mutable_grad());
      require(bucketer.bucket_count() > 1, "several buckets");
      co_await bucketer.wait();
      auto params = model->parameters();
      for (std::size_t i = 0; i < params.size(); ++i)
        require(torch::allclose(params[i].grad(), expected[i]),
                "parameter " + std::to_string(i) + " gradient is not the average");
      // p.grad() itself (const Tensor&) can be received into.
      co_await c.broadcast(params[0].grad(), 0);
    });
  }

  TEST_CASE("rpc: torch tensors as arguments and results, every dtype, beside the payload") {
    DCOMM_TEST_DEADLINE(120s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      dcomm::rpc::registry f;
      f.add("twice", [](torch::Tensor t) { return t.defined() ? t + t : t; });
      f.add("shape", [](torch::Tensor t) { return t.sizes().vec(); });
      auto rpc = co_await dcomm::rpc::start(c, f);
      if (r == 0) {
        for (const auto& [torch_type, type] : dtypes) {
          CAPTURE(dcomm::name(type));
          // 4 KiB and more of a contiguous tensor travels beside the payload.
          auto big = torch::arange(6000).reshape({30, 200}).to(torch_type);
          auto before = rpc.traffic();
          auto back = co_await rpc.call<torch::Tensor>(1, "twice", big);
          auto after = rpc.traffic();
          require(back.scalar_type() == torch_type && back.sizes() == big.sizes() &&
                      torch::equal(back, big + big),
                  "twice of a 30x200 tensor");
          require(after.tensor_bytes - before.tensor_bytes == 6000 * dcomm::size_of(type),
                  "sent beside the payload");
          // Small, strided, 0-d and empty ones go in the payload.
          auto strided = big.t();
          require(torch::equal(co_await rpc.call<torch::Tensor>(1, "twice", strided),
                               strided + strided),
                  "a transposed view");
          auto small = torch::arange(5).to(torch_type);
          require(torch::equal(co_await rpc.call<torch::Tensor>(1, "twice", small), small + small),
                  "a small tensor");
          auto scalar = torch::tensor(3).to(torch_type);
          auto scalar_back = co_await rpc.call<torch::Tensor>(1, "twice", scalar);
          require(scalar_back.dim() == 0 && torch::equal(scalar_back, scalar + scalar), "0-d");
          auto empty = torch::empty({0, 7}, torch::TensorOptions().dtype(torch_type));
          auto sizes = co_await rpc.call<std::vector<std::int64_t>>(1, "shape", empty);
          require(sizes == std::vector<std::int64_t>{0, 7}, "an empty tensor's shape");
        }
        torch::Tensor none;
        require(!(co_await rpc.call<torch::Tensor>(1, "twice", none)).defined(), "undefined");
        // Refused before anything is sent: a dtype dcomm does not have.
        auto odd = torch::zeros({3}, torch::kInt16);
        auto refused = error_of([&] { (void)rpc.call<torch::Tensor>(1, "twice", odd); });
        require(!refused.empty(), "an int16 tensor was not refused");
      }
      co_await rpc.shutdown();
    });
  }
}
