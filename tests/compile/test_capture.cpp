// Capture and replay against eager torch::autograd (float64, 1e-12): the
// capture contract (placeholders, FQNs, outputs), several training steps with
// the live weights updated in between, loss.backward() inside train_fn, a
// shared parameter, frozen shapes, and .grad left untouched.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/compile/capture.h"
#include "hp/compile/graph.h"
#include "test_models.h"

using namespace hp::compile;
using hp_test::expect_close;
using hp_test::kF64;

namespace {

// Eager oracle: the loss and d loss / d p for every FQN of the model.
std::vector<torch::Tensor> eager(torch::nn::Module& model, const TrainFn& fn,
                                 const torch::Tensor& x, const torch::Tensor& y) {
  auto loss = fn(model, x, y);
  std::vector<torch::Tensor> params;
  for (auto& p : model.named_parameters())
    params.push_back(p.value());
  auto grads = torch::autograd::grad({loss}, params, {}, false, false, true);
  std::vector<torch::Tensor> out{loss.detach()};
  for (size_t i = 0; i < grads.size(); ++i)
    out.push_back(grads[i].defined() ? grads[i] : torch::zeros_like(params[i]));
  return out;
}

// Captures once, then for `steps` fresh batches compares replay to eager and
// moves the live weights (SGD) so that replay must read current values.
void check_training(torch::nn::Module& model, const TrainFn& fn,
                    const std::function<std::pair<torch::Tensor, torch::Tensor>(int)>& batch,
                    int steps) {
  auto [x0, y0] = batch(0);
  Graph g = capture_train_step(model, fn, x0, y0);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s);
    auto got = replay(g, placeholder_values(g, model, x, y));
    auto want = eager(model, fn, x, y);
    ASSERT_EQ(got.size(), want.size());
    expect_close(got[0], want[0], "step " + std::to_string(s) + " loss");
    auto names = g.output().output_names;
    for (size_t i = 1; i < got.size(); ++i)
      expect_close(got[i], want[i], "step " + std::to_string(s) + " grad " + names[i]);
    torch::NoGradGuard ng;
    auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i)
      params[i].sub_(0.1 * want[i + 1]);
  }
}

TEST(Capture, ContractPlaceholdersAndOutputs) {
  torch::manual_seed(0);
  hp_test::Mlp mlp(4, 8, 3);
  auto x = torch::randn({5, 4}, kF64), y = torch::randn({5, 3}, kF64);
  Graph g = capture_train_step(*mlp, hp_test::mse_fn<hp_test::MlpImpl>(), x, y);
  auto ph = g.placeholders();
  ASSERT_EQ(ph.size(), 6u);
  std::vector<std::string> names;
  for (size_t i : ph)
    names.push_back(g.nodes()[i].name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                             "input", "label"}));
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(g.nodes()[ph[i]].role, PlaceholderRole::Parameter);
  EXPECT_EQ(g.nodes()[ph[4]].role, PlaceholderRole::Input);
  EXPECT_EQ(g.nodes()[ph[0]].shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(ph, (std::vector<size_t>{0, 1, 2, 3, 4, 5}));  // leading
  EXPECT_EQ(g.output().output_names,
            (std::vector<std::string>{"loss", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  // A joint graph: forward ops and backward ops; no parameter is written.
  EXPECT_GE(g.count_calls("aten::tanh"), 1);
  EXPECT_GE(g.count_calls("aten::tanh_backward"), 1);
  EXPECT_GE(g.count_calls("aten::mm"), 2);  // backward matmuls
  for (const auto& n : g.nodes()) {
    if (!n.is_mutable()) continue;
    for (int64_t v : n.inputs()) {
      EXPECT_GE(v, 4) << "a mutable call writes a parameter: " << n.str();
    }
  }
  g.lint();
  const std::string text = g.str();
  EXPECT_NE(text.find("placeholder[param] fc1.weight Double[8, 4]"), std::string::npos) << text;
  EXPECT_NE(text.find("return (loss=%"), std::string::npos) << text;
  // Capture leaves .grad alone.
  for (auto& p : mlp->parameters())
    EXPECT_FALSE(p.grad().defined());
}

TEST(Capture, MlpReplayEqualsEagerOverTraining) {
  torch::manual_seed(1);
  hp_test::Mlp mlp(6, 16, 4);
  auto fn = hp_test::mse_fn<hp_test::MlpImpl>();
  check_training(
      *mlp, fn,
      [](int s) {
        torch::manual_seed(100 + s);
        return std::make_pair(torch::randn({8, 6}, kF64), torch::randn({8, 4}, kF64));
      },
      4);
}

TEST(Capture, TransformerBlockReplayEqualsEagerOverTraining) {
  torch::manual_seed(2);
  hp_test::Block block(8, 5);
  auto fn = hp_test::ce_fn<hp_test::BlockImpl>();
  check_training(
      *block, fn,
      [](int s) {
        torch::manual_seed(200 + s);
        return std::make_pair(torch::randn({3, 4, 8}, kF64), torch::randint(0, 5, {3}));
      },
      4);
}

// Multi-head attention as the reference GPT writes it: 4-d matmuls whose
// second operand is a transposed view, so matmul's composite kernel copies it
// and bmm's backward saves the copy (NOTE [Which kernel autograd runs]).
// Recording matmul as one call baked that copy in as a constant, and replays
// on later batches silently used the first batch's values.
TEST(Capture, MultiHeadAttentionSavesNoStaleTensors) {
  torch::manual_seed(3);
  const int64_t B = 2, T = 4, H = 2, D = 8, hd = D / H;
  hp_test::Mlp proj(D, D, D);  // fc1: qkv-like input projection, fc2: output
  auto qkv = torch::randn({3 * D, D}, kF64).mul(0.3).requires_grad_(true);
  proj->register_parameter("qkv", qkv);
  TrainFn fn = [&](torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    auto& mod = static_cast<hp_test::MlpImpl&>(m);
    auto parts = torch::matmul(x, qkv.t()).split(D, -1);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, hd}).transpose(1, 2); };
    auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    auto att = q.matmul(k.transpose(-2, -1)).mul(1.0 / std::sqrt(double(hd))).softmax(-1);
    auto out = mod.forward(att.matmul(v).transpose(1, 2).reshape({B, T, D}));
    return torch::mse_loss(out, y);
  };
  auto batch = [&](int s) {
    torch::manual_seed(300 + s);
    return std::make_pair(torch::randn({B, T, D}, kF64), torch::randn({B, T, D}, kF64));
  };
  auto [x0, y0] = batch(0);
  Graph g = capture_train_step(*proj, fn, x0, y0);
  for (const auto& n : g.nodes()) {
    for (const auto& a : n.args) {
      if (a.kind != Arg::Kind::Constant || !a.constant.isTensor()) continue;
      if (!a.constant.toTensor().defined()) continue;
      EXPECT_LE(a.constant.toTensor().numel(), 1)
          << "a captured tensor became a constant: " << n.str();
    }
  }
  check_training(*proj, fn, batch, 4);
}

TEST(Capture, BackwardInsideTrainFnAndGradUntouched) {
  torch::manual_seed(3);
  hp_test::Mlp mlp(4, 8, 2);
  TrainFn with_backward = [](torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    auto loss = torch::mse_loss(static_cast<hp_test::MlpImpl&>(m).forward(x), y);
    loss.backward();
    return loss;
  };
  // A .grad the user already had must survive capture unchanged.
  auto before = torch::full({8, 4}, 7.0, kF64);
  mlp->fc1->weight.mutable_grad() = before.clone();
  auto x = torch::randn({5, 4}, kF64), y = torch::randn({5, 2}, kF64);
  Graph g = capture_train_step(*mlp, with_backward, x, y);
  expect_close(mlp->fc1->weight.grad(), before, "user grad");
  EXPECT_FALSE(mlp->fc2->weight.grad().defined());
  mlp->fc1->weight.mutable_grad() = torch::Tensor();
  auto got = replay(g, placeholder_values(g, *mlp, x, y));
  auto want = eager(*mlp, hp_test::mse_fn<hp_test::MlpImpl>(), x, y);
  for (size_t i = 0; i < got.size(); ++i)
    expect_close(got[i], want[i], g.output().output_names[i]);
}

TEST(Capture, SharedParameterRepeatsItsGradient) {
  torch::manual_seed(4);
  hp_test::Tied tied(5, 6);
  auto fn = hp_test::mse_fn<hp_test::TiedImpl>();
  auto x = torch::randn({4, 5}, kF64), y = torch::randn({4, 5}, kF64);
  Graph g = capture_train_step(*tied, fn, x, y);
  // enc.weight and dec.weight are one tensor: one placeholder, two outputs.
  EXPECT_EQ(g.placeholders().size(),
            5u);  // enc.weight (also dec.weight), mid.w, mid.b, input, label
  EXPECT_EQ(g.nodes()[0].name, "enc.weight");
  EXPECT_EQ(g.nodes()[0].aliases, std::vector<std::string>{"dec.weight"});
  const auto& out = g.output();
  EXPECT_EQ(out.output_names, (std::vector<std::string>{"loss", "enc.weight", "mid.weight",
                                                        "mid.bias", "dec.weight"}));
  EXPECT_EQ(out.args[1].values, out.args[4].values);
  check_training(
      *tied, fn,
      [](int s) {
        torch::manual_seed(300 + s);
        return std::make_pair(torch::randn({4, 5}, kF64), torch::randn({4, 5}, kF64));
      },
      3);
}

TEST(Capture, NewShapeIsAnError) {
  torch::manual_seed(5);
  hp_test::Mlp mlp(4, 8, 2);
  auto x = torch::randn({5, 4}, kF64), y = torch::randn({5, 2}, kF64);
  Graph g = capture_train_step(*mlp, hp_test::mse_fn<hp_test::MlpImpl>(), x, y);
  auto x2 = torch::randn({6, 4}, kF64), y2 = torch::randn({6, 2}, kF64);
  try {
    replay(g, placeholder_values(g, *mlp, x2, y2));
    FAIL() << "expected a shape error";
  } catch (const c10::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'input' was captured as Double[5, 4] but got Double[6, 4]"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("freezes shapes"), std::string::npos) << m;
  }
}

}  // namespace
