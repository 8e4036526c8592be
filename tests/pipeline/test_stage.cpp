// PipelineStage alone (no communication): two stages of a small network run
// F, I, W by hand in zero-bubble order and through a released output; the
// gradients must equal one plain backward of the whole network.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/pipeline/stage.h"

using hp::pipeline::PipelineStage;
using hp::pipeline::StageModule;

namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

struct Net {
  torch::Tensor w0 = torch::randn({6, 6}, kF64).requires_grad_(true);
  torch::Tensor w1 = torch::randn({6, 3}, kF64).requires_grad_(true);
  torch::Tensor stage0(const torch::Tensor& x) const { return torch::tanh(x.matmul(w0)); }
  torch::Tensor stage1(const torch::Tensor& h) const { return h.matmul(w1).exp(); }
};

}  // namespace

TEST(PipelineStage, SplitBackwardAcrossTwoStagesEqualsOneBackward) {
  torch::manual_seed(3);
  Net net;
  std::vector<torch::Tensor> xs{torch::randn({4, 6}, kF64), torch::randn({4, 6}, kF64)};
  auto loss_of = [](const torch::Tensor& y, int mb) { return y.sum() * (mb + 1) / 2.0; };

  // Reference: plain autograd, accumulated over the microbatches.
  torch::Tensor g0 = torch::zeros_like(net.w0), g1 = torch::zeros_like(net.w1);
  for (int mb = 0; mb < 2; ++mb) {
    auto grads =
        torch::autograd::grad({loss_of(net.stage1(net.stage0(xs[mb])), mb)}, {net.w0, net.w1});
    g0 += grads[0];
    g1 += grads[1];
  }

  std::map<int, StageModule> modules;
  modules[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}};
  modules[1] = {[&](const torch::Tensor& h) { return net.stage1(h); }, {net.w1}};
  PipelineStage stage(modules, loss_of);
  for (int mb = 0; mb < 2; ++mb) {
    auto h = stage.forward(0, mb, xs[mb], /*input_needs_grad=*/false, /*is_last=*/false);
    stage.forward(1, mb, h, /*input_needs_grad=*/true, /*is_last=*/true);
    stage.release_output(0, mb);  // as after a send: only the history is needed
    EXPECT_EQ(stage.output(0, mb).numel(), 0);
  }
  EXPECT_EQ(stage.in_flight(), 4u);
  // Zero-bubble order: both dx first, weights later and out of order.
  auto dh1 = stage.backward_input(1, 1, {});
  auto dh0 = stage.backward_input(1, 0, {});
  EXPECT_FALSE(net.w0.grad().defined());
  EXPECT_FALSE(stage.backward_input(0, 1, dh1).defined()) << "the first stage has no dx";
  stage.backward_weight(1, 0);
  stage.backward_weight(0, 1);
  stage.backward(0, 0, dh0);  // fused B for the last one
  stage.backward_weight(1, 1);
  EXPECT_EQ(stage.in_flight(), 0u);
  EXPECT_LE((net.w0.grad() - g0).abs().max().item<double>(), 1e-12);
  EXPECT_LE((net.w1.grad() - g1).abs().max().item<double>(), 1e-12);
  stage.reset();
}

TEST(PipelineStage, OutOfOrderUseIsAClearError) {
  Net net;
  std::map<int, StageModule> modules;
  modules[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}};
  PipelineStage stage(modules, [](const torch::Tensor& y, int) { return y.sum(); });
  EXPECT_THROW(stage.backward_input(0, 0, {}), c10::Error);
  stage.forward(0, 0, torch::randn({2, 6}, kF64), false, true);
  EXPECT_THROW(stage.forward(0, 0, torch::randn({2, 6}, kF64), false, true), c10::Error);
  EXPECT_THROW(stage.backward_weight(0, 0), c10::Error) << "W before I";
  EXPECT_THROW(stage.reset(), c10::Error) << "a microbatch is still in flight";
  EXPECT_THROW(stage.forward(5, 0, torch::randn({2, 6}, kF64), false, true), c10::Error);
}
