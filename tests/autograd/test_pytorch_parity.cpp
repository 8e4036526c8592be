// The behaviours PyTorch's own dx/dw split tests check (its pipelining
// backward tests: stage_backward_input / stage_backward_weight), restated for
// our GradFunction on torch::nn modules and checked against plain
// loss.backward() on a deep copy of the same module and data, in float64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "hp/autograd/grad_function.h"
#include "tests/common/oracle.h"

namespace {

using hp::autograd::forward_and_gradfn;
using hp::autograd::ForwardAndGradOptions;
using hp::autograd::GradFunction;
using hp::autograd::TensorList;
using hp::testing::expect_close;
using hp::testing::kF64;

constexpr int64_t kHidden = 32, kBatch = 16;

// PyTorch's MLPModule: net1 -> relu -> net2.
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : net1(register_module("net1", torch::nn::Linear(kHidden, kHidden))),
        net2(register_module("net2", torch::nn::Linear(kHidden, kHidden))) {}
  torch::Tensor forward(const torch::Tensor& x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1, net2;
};
TORCH_MODULE(Mlp);

// PyTorch's MultiInterMediateModel: a chunk() splits the hidden state, and
// both halves feed the output (one backward node with two used slots).
struct MultiIntermediateImpl : torch::nn::Module {
  MultiIntermediateImpl()
      : net1(register_module("net1", torch::nn::Linear(kHidden, kHidden))),
        net2(register_module("net2", torch::nn::Linear(kHidden, kHidden))),
        net3(register_module("net3", torch::nn::Linear(kHidden, kHidden * 2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(net1(x));
    auto parts = torch::relu(net3(h)).chunk(2, -1);
    return net2(parts[0]) * torch::sigmoid(parts[1]);
  }
  torch::nn::Linear net1, net2, net3;
};
TORCH_MODULE(MultiIntermediate);

template <class M>
M make() {
  M m;
  m->to(torch::kFloat64);
  return m;
}
template <>
torch::nn::Linear make<torch::nn::Linear>() {
  torch::nn::Linear m(kHidden, kHidden);
  m->to(torch::kFloat64);
  return m;
}

// A second module of the same kind with the same parameter values.
template <class M>
M copy_of(const M& m) {
  M c = make<M>();
  torch::NoGradGuard no_grad;
  auto src = m->named_parameters();
  for (auto& item : c->named_parameters())
    item.value().copy_(src[item.key()]);
  return c;
}

torch::Tensor mse_sum(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target, at::Reduction::Sum);
}

// Runs the stage's forward + loss, as the last stage of a pipeline does, and
// returns the GradFunction of it (x is the stage input, which needs dx).
template <class M>
std::pair<torch::Tensor, GradFunction> stage_forward(M& mod, const torch::Tensor& x,
                                                     const torch::Tensor& target) {
  auto [outs, gf] = forward_and_gradfn(
      [&](const TensorList& in) { return TensorList{mse_sum(mod->forward(in[0]), target)}; }, {x},
      ForwardAndGradOptions().weights(mod->parameters()));
  return {outs[0], gf};
}

// Every parameter's .grad of `mod` equals the reference module's.
template <class M>
void expect_same_weight_grads(M& mod, M& ref, const std::string& what) {
  auto mine = mod->named_parameters(), theirs = ref->named_parameters();
  for (const auto& item : theirs)
    expect_close(mine[item.key()].grad(), item.value().grad(), what + item.key());
}

// One microbatch through the stage: I then W on `mod`, loss.backward() on
// `ref` (same weights); checks dx and returns nothing (the .grads accumulate).
template <class M>
void split_backward_matches(M& mod, M& ref, const std::string& what) {
  auto x = torch::randn({kBatch, kHidden}, kF64);
  auto target = torch::randn({kBatch, kHidden}, kF64);
  auto [loss, gf] = stage_forward(mod, x, target);
  auto dx = gf.compute_input_grad();
  gf.compute_weight_grad();
  auto ref_x = x.clone().requires_grad_(true);
  mse_sum(ref->forward(ref_x), target).backward();
  expect_close(dx[0], ref_x.grad(), what + "dx");
}

class PytorchParity : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(7); }
};

// stage_backward_input: dx only. The input gradient is right and no weight
// gradient exists yet.
TEST_F(PytorchParity, InputGradOnlyLeavesWeightGradientsUntouched) {
  auto mod = make<Mlp>();
  auto ref = copy_of(mod);
  auto x = torch::randn({kBatch, kHidden}, kF64);
  auto target = torch::randn({kBatch, kHidden}, kF64);

  auto [loss, gf] = stage_forward(mod, x, target);
  auto dx = gf.compute_input_grad();

  auto ref_x = x.clone().requires_grad_(true);
  mse_sum(ref->forward(ref_x), target).backward();
  expect_close(dx[0], ref_x.grad(), "dx");
  for (const auto& p : mod->parameters())
    EXPECT_FALSE(p.grad().defined()) << "dx wrote a weight gradient";
}

// stage_backward_weight after stage_backward_input: together they equal one
// full backward, for the input and every weight.
TEST_F(PytorchParity, InputThenWeightEqualsFullBackward) {
  auto mod = make<Mlp>();
  auto ref = copy_of(mod);
  split_backward_matches(mod, ref, "");
  expect_same_weight_grads(mod, ref, "");
}

// Several iterations of I then W accumulate into .grad exactly as repeated
// loss.backward() calls do.
TEST_F(PytorchParity, RepeatedInputAndWeightGradsAccumulate) {
  auto mod = make<Mlp>();
  auto ref = copy_of(mod);
  for (int it = 0; it < 4; ++it)
    split_backward_matches(mod, ref, "iteration " + std::to_string(it) + ": ");
  expect_same_weight_grads(mod, ref, "accumulated ");
}

// Intermediates with several outputs (chunk) keep a gradient per slot: the
// split's dw must see both halves' contributions.
TEST_F(PytorchParity, MultiOutputIntermediatesKeepPerSlotGradients) {
  auto mod = make<MultiIntermediate>();
  auto ref = copy_of(mod);
  split_backward_matches(mod, ref, "");
  expect_same_weight_grads(mod, ref, "");
}

// One weight used at several depths (a layer applied twice, nested): its
// gradient is the sum of both uses, counted once.
TEST_F(PytorchParity, SharedWeightsAcrossNestedUsesAreNotDoubleCounted) {
  auto lin = make<torch::nn::Linear>();
  auto ref = copy_of(lin);
  auto x = torch::randn({kBatch, kHidden}, kF64);
  auto fn = [](torch::nn::LinearImpl& l, const torch::Tensor& in) {
    return l.forward(torch::tanh(l.forward(in))).pow(2).sum();
  };
  auto [outs, gf] =
      forward_and_gradfn([&](const TensorList& in) { return TensorList{fn(*lin, in[0])}; }, {x},
                         ForwardAndGradOptions().weights(lin->parameters()));
  auto dx = gf.compute_input_grad();
  auto dw = gf.compute_weight_grad();

  auto ref_x = x.clone().requires_grad_(true);
  fn(*ref, ref_x).backward();
  expect_close(dx[0], ref_x.grad(), "dx");
  expect_close(dw[0], ref->weight.grad(), "dW returned");
  expect_close(lin->weight.grad(), ref->weight.grad(), "W .grad (once, not twice)");
  expect_close(lin->bias.grad(), ref->bias.grad(), "b .grad");
}

// Inputs that are not tensors (here: undefined tensors, e.g. an optional
// mask not given) are ignored: no dx for them, the others unaffected.
TEST_F(PytorchParity, NonTensorInputsAreIgnored) {
  auto mod = make<Mlp>();
  auto ref = copy_of(mod);
  auto x = torch::randn({kBatch, kHidden}, kF64).requires_grad_(true);
  auto target = torch::randn({kBatch, kHidden}, kF64);
  auto loss = mse_sum(mod->forward(x), target);
  GradFunction gf({loss}, {torch::Tensor(), x, torch::Tensor()}, mod->parameters());
  auto dx = gf.compute_input_grad();
  ASSERT_EQ(dx.size(), 3u);
  EXPECT_FALSE(dx[0].defined());
  EXPECT_FALSE(dx[2].defined());
  gf.compute_weight_grad();
  auto ref_x = x.detach().clone().requires_grad_(true);
  mse_sum(ref->forward(ref_x), target).backward();
  expect_close(dx[1], ref_x.grad(), "dx of the tensor input");
  expect_same_weight_grads(mod, ref, "");
}

}  // namespace
