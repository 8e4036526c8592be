// Tests of the dx/dw split: every graph shape is checked against a plain
// torch::autograd::grad on the same data in float64, plus the fused path, the
// FLOP count, the memory promise and every misuse error.
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>
#include "tests/common/flop_counter.h"
#include "tests/common/oracle.h"

#include <functional>
#include <optional>
#include <string>

#include "hp/autograd/grad_function.h"
#include "hp/autograd/split_plan.h"

using hp::autograd::forward_and_gradfn;
using hp::autograd::ForwardAndGradOptions;
using hp::autograd::GradFunction;
using hp::autograd::GradPosition;
using hp::autograd::TensorList;
using Fn = std::function<TensorList(const TensorList&)>;

namespace {

using hp::testing::expect_close;
using hp::testing::kF64;
using hp::testing::param;

// The reference: the same function on fresh copies of the inputs, one
// torch::autograd::grad for the selected inputs and all weights.
struct Reference {
  TensorList outputs, dx, dw;
};

Reference reference(const Fn& fn, const TensorList& inputs, const TensorList& weights,
                    const std::vector<int64_t>& positions, const TensorList& sens, bool has_aux) {
  TensorList in = inputs;
  TensorList wrt;
  for (int64_t p : positions) {
    in[p] = inputs[p].detach().requires_grad_(true);
    wrt.push_back(in[p]);
  }
  wrt.insert(wrt.end(), weights.begin(), weights.end());
  Reference r;
  r.outputs = fn(in);
  TensorList diff = has_aux ? TensorList{r.outputs[0]} : r.outputs;
  auto grads = torch::autograd::grad(diff, wrt, sens, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& like = wrt[i];
    auto g = grads[i].defined() ? grads[i] : torch::zeros_like(like);
    (i < positions.size() ? r.dx : r.dw).push_back(g);
  }
  return r;
}

// Runs the split (dx, then dw) and the fused path and checks both against the
// reference, including the .grad accumulation. Returns the split's stats.
hp::autograd::SplitStats check_split(const Fn& fn, const TensorList& inputs,
                                     const TensorList& weights,
                                     GradPosition position = GradPosition::all(),
                                     bool has_aux = false) {
  auto positions = position.resolve(inputs.size());
  // Random output gradients, so no slot can hide behind a gradient of one.
  TensorList probe = fn(inputs);
  TensorList sens;
  size_t num_diff = has_aux ? 1 : probe.size();
  for (size_t i = 0; i < num_diff; ++i)
    sens.push_back(torch::randn_like(probe[i]));

  for (auto& w : weights)
    w.mutable_grad() = torch::Tensor();
  Reference ref = reference(fn, inputs, weights, positions, sens, has_aux);

  auto opts = ForwardAndGradOptions().weights(weights).grad_position(position).has_aux(has_aux);
  auto [outs, split] = forward_and_gradfn(fn, inputs, opts);
  EXPECT_EQ(outs.size(), ref.outputs.size());
  for (size_t i = 0; i < outs.size(); ++i)
    expect_close(outs[i], ref.outputs[i], "output " + std::to_string(i));
  TensorList dx = split.compute_input_grad(sens);
  EXPECT_EQ(dx.size(), positions.size());
  for (size_t i = 0; i < dx.size(); ++i)
    expect_close(dx[i], ref.dx[i], "dx " + std::to_string(i));
  for (auto& w : weights)
    EXPECT_FALSE(w.grad().defined()) << "dx must leave weight gradients untouched";
  TensorList dw = split.compute_weight_grad();
  EXPECT_EQ(dw.size(), weights.size());
  for (size_t i = 0; i < dw.size(); ++i) {
    expect_close(dw[i], ref.dw[i], "dw " + std::to_string(i));
    expect_close(weights[i].grad(), ref.dw[i], ".grad of weight " + std::to_string(i));
  }
  // W of a training step: dw only into .grad, through the engine's own
  // accumulation (NOTE [dw into .grad]), bit for bit what compute_weight_grad
  // put there.
  TensorList split_grad;
  for (auto& w : weights) {
    split_grad.push_back(w.grad().clone());
    w.mutable_grad() = torch::Tensor();
  }
  auto [outs_i, into_w] = forward_and_gradfn(fn, inputs, opts);
  into_w.compute_input_grad(sens);
  into_w.weight_grad_into_grad();
  for (size_t i = 0; i < weights.size(); ++i)
    EXPECT_TRUE(torch::equal(weights[i].grad(), split_grad[i])) << "weight " << i;
  // The same in parts (NOTE [dw in parts]): as many calls as parts (fewer
  // where there are fewer groups), the same bits, and the graph freed after.
  for (int parts : {2, 3, 64}) {
    for (auto& w : weights)
      w.mutable_grad() = torch::Tensor();
    auto [outs_p, in_parts] = forward_and_gradfn(fn, inputs, opts);
    in_parts.compute_input_grad(sens);
    const int groups = int(in_parts.stats().num_groups);
    int calls = 1;
    while (!in_parts.weight_grad_part_into_grad(parts))
      ++calls;
    bool leaves = true;
    for (const auto& w : weights)
      leaves = leaves && w.is_leaf();
    if (leaves) {
      EXPECT_EQ(calls, std::max(1, std::min(parts, groups))) << parts << " parts of " << groups;
    }
    for (size_t i = 0; i < weights.size(); ++i)
      EXPECT_TRUE(torch::equal(weights[i].grad(), split_grad[i]))
          << "weight " << i << " in " << parts << " parts";
    EXPECT_THROW(in_parts.weight_grad_part_into_grad(parts), c10::Error);
  }
  // One part, then the rest whole (a deferred W begun in a pair's waits and
  // ended outside one): the same bits, no group run twice; a dw that
  // returns every weight's is refused after a part.
  for (auto& w : weights)
    w.mutable_grad() = torch::Tensor();
  auto [outs_r, rest] = forward_and_gradfn(fn, inputs, opts);
  rest.compute_input_grad(sens);
  if (!rest.weight_grad_part_into_grad(2)) {
    EXPECT_THROW(rest.compute_weight_grad(), c10::Error);
    rest.weight_grad_into_grad();
  }
  for (size_t i = 0; i < weights.size(); ++i)
    EXPECT_TRUE(torch::equal(weights[i].grad(), split_grad[i])) << "weight " << i << ", rest whole";
  // The same with one engine call per weight group.
  for (auto& w : weights)
    w.mutable_grad() = torch::Tensor();
  auto [outs_g, grouped] = forward_and_gradfn(fn, inputs, opts);
  grouped.separate_dw_calls(true);
  grouped.compute_input_grad(sens);
  dw = grouped.compute_weight_grad();
  for (size_t i = 0; i < dw.size(); ++i) {
    expect_close(dw[i], ref.dw[i], "dw " + std::to_string(i));
    expect_close(weights[i].grad(), ref.dw[i], ".grad of weight " + std::to_string(i));
  }
  auto stats = split.stats();

  for (auto& w : weights)
    w.mutable_grad() = torch::Tensor();
  auto [outs2, fused] = forward_and_gradfn(fn, inputs, opts);
  auto grads = fused(sens);
  for (size_t i = 0; i < grads.input_grads.size(); ++i)
    expect_close(grads.input_grads[i], ref.dx[i], "fused dx " + std::to_string(i));
  for (size_t i = 0; i < grads.weight_grads.size(); ++i)
    expect_close(grads.weight_grads[i], ref.dw[i], "fused dw " + std::to_string(i));
  // The fused backward of a training step: dw only in .grad (NOTE [Fused
  // backward into .grad]), bit for bit what operator() put there.
  TensorList fused_grad;
  for (auto& w : weights)
    fused_grad.push_back(w.grad().clone());
  for (auto& w : weights)
    w.mutable_grad() = torch::Tensor();
  auto [outs3, into] = forward_and_gradfn(fn, inputs, opts);
  TensorList dx3 = into.backward_into_grad(sens);
  EXPECT_EQ(dx3.size(), positions.size());
  for (size_t i = 0; i < dx3.size(); ++i) {
    expect_close(dx3[i], ref.dx[i], "backward_into_grad dx " + std::to_string(i));
    EXPECT_TRUE(torch::equal(dx3[i], grads.input_grads[i])) << "dx " << i;
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    expect_close(weights[i].grad(), ref.dw[i], "backward_into_grad .grad " + std::to_string(i));
    EXPECT_TRUE(torch::equal(weights[i].grad(), fused_grad[i])) << "weight " << i;
  }
  for (const auto& x : inputs) {
    if (x.defined()) {
      EXPECT_FALSE(x.grad().defined()) << "an input's .grad is left as it was";
    }
  }
  for (auto& w : weights)
    w.mutable_grad() = torch::Tensor();
  return stats;
}

// A multi-output custom function: both outputs depend on x and w, so its node
// is a joining node with two input slots (y1 = x*w, y2 = x*w*w).
struct TwoOutputs : torch::autograd::Function<TwoOutputs> {
  static TensorList forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                            torch::Tensor w) {
    ctx->save_for_backward({x, w});
    return {x * w, x * w * w};
  }
  static TensorList backward(torch::autograd::AutogradContext* ctx, TensorList g) {
    auto saved = ctx->get_saved_variables();
    auto x = saved[0], w = saved[1];
    return {g[0] * w + g[1] * w * w, g[0] * x + g[1] * 2 * x * w};
  }
};

class SplitTest : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(1234); }
};

}  // namespace

TEST_F(SplitTest, MlpForwardDxDw) {
  auto x = torch::randn({8, 16}, kF64);
  TensorList ws{param({16, 32}), param({32}), param({32, 8}), param({8})};
  Fn mlp = [&](const TensorList& in) {
    auto h = torch::relu(torch::addmm(ws[1], in[0], ws[0]));
    return TensorList{torch::tanh(torch::addmm(ws[3], h, ws[2]))};
  };
  auto st = check_split(mlp, {x}, ws);
  EXPECT_EQ(st.num_groups, 2u) << "each layer's weight and bias share their addmm";
}

// NOTE [dw in parts]: weights whose dw starts from an output's gradient
// (kept, not moved into the call) and one captured at a join: a part, then
// the rest whole, runs each group once (a group run again would add its dw
// into .grad twice).
TEST_F(SplitTest, DwInPartsThenTheRestRunsEachGroupOnce) {
  auto x = torch::randn({4, 6}, kF64);
  TensorList ws{param({6}), param({3}), param({6, 5})};
  Fn fn = [&](const TensorList& in) {
    return TensorList{ws[0].sin() * 2, ws[1].cos(), torch::tanh(in[0].matmul(ws[2]))};
  };
  auto st = check_split(fn, {x}, ws);
  EXPECT_EQ(st.num_groups, 3u);
  TensorList sens{torch::randn({6}, kF64), torch::randn({3}, kF64), torch::randn({4, 5}, kF64)};
  Reference ref = reference(fn, {x}, ws, {0}, sens, false);
  for (int first_parts : {3, 2}) {
    for (auto& w : ws)
      w.mutable_grad() = torch::Tensor();
    auto [outs, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights(ws));
    gf.compute_input_grad(sens);
    EXPECT_FALSE(gf.weight_grad_part_into_grad(first_parts));
    gf.weight_grad_into_grad();
    for (size_t i = 0; i < ws.size(); ++i)
      expect_close(ws[i].grad(), ref.dw[i], "weight " + std::to_string(i));
  }
}

TEST_F(SplitTest, KeepGraphGivesIdenticalRepeatedDw) {
  auto x = torch::randn({4, 6}, kF64);
  auto w = param({6, 6});
  auto [out, gf] = forward_and_gradfn(
      [&](const TensorList& in) { return TensorList{(in[0].matmul(w).sin()).matmul(w).sum()}; },
      {x}, ForwardAndGradOptions().weights({w}));
  gf.compute_input_grad();
  auto first = gf.compute_weight_grad(/*keep_graph=*/true)[0].clone();
  auto second = gf.compute_weight_grad(/*keep_graph=*/true)[0].clone();
  auto third = gf.compute_weight_grad(/*keep_graph=*/false)[0];
  EXPECT_TRUE(torch::equal(first, second));
  EXPECT_TRUE(torch::equal(first, third));
  expect_close(w.grad(), first * 3, ".grad after three dw calls");
  EXPECT_THROW(gf.compute_weight_grad(), c10::Error);
}

TEST_F(SplitTest, MultiOutputIntermediatesKeepPerSlotGradients) {
  auto x = torch::randn({6, 6}, kF64);
  TensorList ws{param({6, 6}), param({6, 4})};
  Fn fn = [&](const TensorList& in) {
    auto parts = in[0].matmul(ws[0]).chunk(3, 1);  // SplitBackward inside the dx closure
    auto wparts = ws[1].split(2, 1);               // a split weight: a multi-slot dw node
    auto a = parts[0].matmul(wparts[0].narrow(0, 0, 2));
    auto b = parts[1].sin().matmul(wparts[1].narrow(0, 2, 2));
    return TensorList{a * b + parts[2].pow(2).sum(1, true)};
  };
  check_split(fn, {x}, ws);
}

TEST_F(SplitTest, MultiSlotJoiningNode) {
  auto x = torch::randn({5}, kF64);
  auto w = param({5});
  Fn fn = [&](const TensorList& in) {
    auto ys = TwoOutputs::apply(in[0].cos(), w);
    return TensorList{ys[0].sum() * 3 + (ys[1] * ys[1]).sum()};
  };
  auto st = check_split(fn, {x}, {w});
  EXPECT_EQ(st.num_join_nodes, 1u);
}

TEST_F(SplitTest, WeightOnlySubgraphJoinsLate) {
  auto x = torch::randn({3, 5}, kF64);
  TensorList ws{param({5, 5}), param({5, 5}), param({5})};
  Fn fn = [&](const TensorList& in) {
    auto wl = (ws[0] * 2).tanh().matmul(ws[1]) + ws[2];  // depends on weights only
    return TensorList{in[0].matmul(wl).exp().sum()};
  };
  auto st = check_split(fn, {x}, ws);
  EXPECT_EQ(st.num_groups, 1u);
}

TEST_F(SplitTest, SharedIntermediatesMergeGroups) {
  auto x = torch::randn({4, 4}, kF64);
  TensorList ws{param({4, 4}), param({4, 4}), param({4, 4})};
  Fn fn = [&](const TensorList& in) {
    auto v = ws[0] * ws[1];  // shared by two joins
    auto h = in[0].matmul(v).relu() + in[0].sin().matmul(v);
    return TensorList{h.matmul(ws[2]).sum(0)};
  };
  auto st = check_split(fn, {x}, ws);
  EXPECT_EQ(st.num_groups, 2u) << "w0 and w1 share v; w2 stands alone";
}

TEST_F(SplitTest, NestedReuseOfOneWeight) {
  auto x = torch::randn({3, 4}, kF64);
  auto w = param({4, 4});
  Fn fn = [&](const TensorList& in) { return TensorList{in[0].matmul(w).matmul(w)}; };
  auto st = check_split(fn, {x}, {w});
  EXPECT_EQ(st.num_join_nodes, 2u) << "both matmuls join, one is the other's ancestor";
  Fn deeper = [&](const TensorList& in) {
    auto h = in[0];
    for (int i = 0; i < 4; ++i)
      h = torch::tanh(h.matmul(w)) + h;
    return TensorList{h.sum(1)};
  };
  check_split(deeper, {x}, {w});
}

TEST_F(SplitTest, ResidualAndBranchingGraphs) {
  auto x = torch::randn({4, 8}, kF64);
  TensorList ws{param({8, 8}), param({8, 8}), param({8})};
  Fn fn = [&](const TensorList& in) {
    auto a = in[0].matmul(ws[0]);
    auto b = torch::sigmoid(in[0]).matmul(ws[1]);
    auto h = in[0] + torch::gelu(a) * b + ws[2];
    auto l = torch::layer_norm(h, {8});
    return TensorList{l, (h * l).sum(1)};  // two outputs
  };
  check_split(fn, {x}, ws);
}

TEST_F(SplitTest, FrozenWeightAndUnusedWeight) {
  auto x = torch::randn({3, 3}, kF64);
  auto frozen = torch::randn({3, 3}, kF64);  // does not require grad
  auto w = param({3, 3});
  auto unused = param({7});
  Fn fn = [&](const TensorList& in) {
    return TensorList{in[0].matmul(frozen).matmul(w).cos().sum()};
  };
  check_split(fn, {x}, {w, unused});
  auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({w, unused}));
  gf.compute_input_grad();
  auto dw = gf.compute_weight_grad();
  EXPECT_TRUE(torch::equal(dw[1], torch::zeros({7}, kF64))) << "no path: zeros";
  w.mutable_grad() = torch::Tensor();
  unused.mutable_grad() = torch::Tensor();
}

TEST_F(SplitTest, GradPositionAllNoneSubsetAndSeveralInputs) {
  TensorList xs{torch::randn({2, 3}, kF64), torch::randn({3, 3}, kF64), torch::randn({2, 3}, kF64)};
  auto w = param({3, 3});
  Fn fn = [&](const TensorList& in) {
    return TensorList{(in[0].matmul(in[1]).matmul(w) * in[2]).tanh()};
  };
  check_split(fn, xs, {w}, GradPosition::all());
  check_split(fn, xs, {w}, GradPosition::none());
  check_split(fn, xs, {w}, GradPosition::indices({2, 0}));
  check_split(fn, xs, {}, GradPosition::indices({1}));  // inputs only, no weights
}

TEST_F(SplitTest, HasAuxDifferentiatesOnlyTheFirstOutput) {
  auto x = torch::randn({4, 4}, kF64);
  auto w = param({4, 4});
  Fn fn = [&](const TensorList& in) {
    auto y = in[0].matmul(w);
    return TensorList{y.pow(2).sum(), y.detach().mean(), y.max()};
  };
  check_split(fn, {x}, {w}, GradPosition::all(), /*has_aux=*/true);
}

TEST_F(SplitTest, TransformerBlock) {
  const int64_t B = 2, T = 6, D = 16, H = 4, hd = D / H;
  auto x = torch::randn({B, T, D}, kF64);
  TensorList ws{param({D}),        param({D}),      // ln1 weight, bias
                param({D, 3 * D}), param({3 * D}),  // qkv
                param({D, D}),     param({D}),      // proj
                param({D}),        param({D}),      // ln2
                param({D, 4 * D}), param({4 * D}),  // fc
                param({4 * D, D}), param({D})};     // fc2
  Fn block = [&](const TensorList& in) {
    auto h = in[0];
    auto a = torch::layer_norm(h, {D}, ws[0], ws[1]);
    auto qkv = torch::matmul(a, ws[2]) + ws[3];
    auto parts = qkv.split(D, -1);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, hd}).transpose(1, 2); };
    auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    auto mask = torch::ones({T, T}, torch::kBool).triu(1);
    auto att = (q.matmul(k.transpose(-2, -1)) / std::sqrt(double(hd))).masked_fill(mask, -1e9);
    auto y = att.softmax(-1).matmul(v).transpose(1, 2).reshape({B, T, D});
    h = h + torch::matmul(y, ws[4]) + ws[5];
    auto m = torch::layer_norm(h, {D}, ws[6], ws[7]);
    h = h + torch::matmul(torch::gelu(torch::matmul(m, ws[8]) + ws[9]), ws[10]) + ws[11];
    return TensorList{h};
  };
  check_split(block, {x}, ws);
}

TEST_F(SplitTest, RepeatedMicrobatchesAccumulate) {
  auto w = param({5, 5});
  auto b = param({5});
  Fn fn = [&](const TensorList& in) { return TensorList{torch::tanh(in[0].matmul(w) + b)}; };
  torch::Tensor ref_w = torch::zeros_like(w), ref_b = torch::zeros_like(b);
  std::vector<GradFunction> pending;
  std::vector<torch::Tensor> xs;
  for (int mb = 0; mb < 3; ++mb) {
    xs.push_back(torch::randn({4, 5}, kF64));
    auto r = reference(fn, {xs.back()}, {w, b}, {0}, {torch::ones({4, 5}, kF64)}, false);
    ref_w += r.dw[0];
    ref_b += r.dw[1];
  }
  // Three forwards, three dx, then the dw's late and out of order, as ZB-H2
  // would; then the same with W only into .grad (NOTE [dw into .grad]), bit
  // for bit.
  std::vector<torch::Tensor> split_sums;
  for (bool into : {false, true}) {
    w.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    pending.clear();
    for (auto& x : xs) {
      auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({w, b}));
      gf.compute_input_grad();
      pending.push_back(gf);
    }
    for (int k : {2, 0, 1}) {
      if (into) {
        pending[k].weight_grad_into_grad();
      } else {
        pending[k].compute_weight_grad();
      }
    }
    expect_close(w.grad(), ref_w, "accumulated dw");
    expect_close(b.grad(), ref_b, "accumulated db");
    split_sums.push_back(w.grad().clone());
    split_sums.push_back(b.grad().clone());
  }
  EXPECT_TRUE(torch::equal(split_sums[0], split_sums[2]));
  EXPECT_TRUE(torch::equal(split_sums[1], split_sums[3]));
  // Fused backwards accumulate the same, through operator() and through the
  // engine's own accumulation (backward_into_grad), bit for bit.
  std::vector<torch::Tensor> sums;
  for (bool into : {false, true}) {
    w.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    for (auto& x : xs) {
      auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({w, b}));
      if (into) {
        gf.backward_into_grad();
      } else {
        gf();
      }
    }
    expect_close(w.grad(), ref_w, "fused accumulated dw");
    sums.push_back(w.grad().clone());
    sums.push_back(b.grad().clone());
  }
  EXPECT_TRUE(torch::equal(sums[0], sums[2]));
  EXPECT_TRUE(torch::equal(sums[1], sums[3]));
}

TEST_F(SplitTest, BackwardIntoGradFallsBackOnANonLeafInput) {
  // An input that is not a leaf (here 2a) keeps its .grad empty; the result
  // is operator()'s.
  auto a = torch::randn({4, 5}, kF64).requires_grad_(true);
  auto w = param({5, 5});
  auto x = a * 2;
  Fn fn = [&](const TensorList& in) { return TensorList{torch::tanh(in[0].matmul(w)).matmul(w)}; };
  auto r = reference(fn, {x.detach()}, {w}, {0}, {torch::ones({4, 5}, kF64)}, false);
  w.mutable_grad() = torch::Tensor();
  auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({w}));
  TensorList dx = gf.backward_into_grad();
  expect_close(dx[0], r.dx[0], "dx of a non-leaf input");
  expect_close(w.grad(), r.dw[0], ".grad");
  EXPECT_FALSE(a.grad().defined()) << "nothing flows past the input";
  EXPECT_THROW(gf.backward_into_grad(), c10::Error);  // the graph is freed
}

TEST_F(SplitTest, BackwardIntoGradLeavesAnUntrainedLeafAlone) {
  // NOTE [An unlimited engine call where limits change nothing]: a graph that
  // reaches a leaf outside the inputs and weights (here `frozen`, which
  // requires grad but is not trained) keeps the engine limited, so that
  // leaf's .grad stays as it was; one that reaches only inputs and weights
  // runs unlimited, and both equal plain autograd.
  auto w = param({5, 5});
  auto frozen = torch::randn({5, 5}, kF64).requires_grad_(true);
  auto x = torch::randn({4, 5}, kF64);
  auto sens = torch::randn({4, 5}, kF64);
  for (bool reach : {true, false}) {
    Fn fn = [&](const TensorList& in) {
      auto h = torch::tanh(in[0].matmul(w));
      return TensorList{reach ? h.matmul(frozen).matmul(w) : h.matmul(w).matmul(w)};
    };
    auto r = reference(fn, {x}, {w}, {0}, {sens}, false);
    w.mutable_grad() = torch::Tensor();
    frozen.mutable_grad() = torch::Tensor();
    auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({w}));
    TensorList dx = gf.backward_into_grad({sens});
    expect_close(dx[0], r.dx[0], reach ? "dx past an untrained leaf" : "dx");
    expect_close(w.grad(), r.dw[0], reach ? ".grad past an untrained leaf" : ".grad");
    EXPECT_FALSE(frozen.grad().defined()) << "reach " << reach;
  }
}

TEST_F(SplitTest, WeightGradIntoGradRunsHooksAndFallsBackOnANonLeafWeight) {
  // NOTE [dw into .grad]: W through the engine's accumulation runs a weight's
  // AccumulateGrad node (and so its hooks) as backward() does, once per W; a
  // weight that is not a leaf has no such node and takes the captured path,
  // with the same .grad.
  auto w = param({5, 5});
  auto base = param({5});
  auto b = base * 2;  // not a leaf
  auto unused = param({3});
  Fn fn = [&](const TensorList& in) { return TensorList{torch::tanh(in[0].matmul(w) + b)}; };
  auto x = torch::randn({4, 5}, kF64);
  auto sens = torch::randn({4, 5}, kF64);
  auto r = reference(fn, {x}, {w, b}, {0}, {sens}, false);
  int fired = 0;
  struct Count : torch::autograd::FunctionPostHook {
    explicit Count(int* n) : n_(n) {}
    TensorList operator()(const TensorList& outputs, const TensorList&) override {
      ++*n_;
      return outputs;
    }
    int* n_;
  };
  torch::autograd::impl::grad_accumulator(w)->add_post_hook(std::make_unique<Count>(&fired));
  for (bool leaves_only : {true, false}) {
    w.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    unused.mutable_grad() = torch::Tensor();
    TensorList weights = leaves_only ? TensorList{w, unused} : TensorList{w, b, unused};
    auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights(weights));
    gf.compute_input_grad({sens});
    fired = 0;
    gf.weight_grad_into_grad();
    expect_close(w.grad(), r.dw[0], "dw of w");
    EXPECT_TRUE(torch::equal(unused.grad(), torch::zeros({3}, kF64))) << "no path: zeros";
    if (!leaves_only) expect_close(b.grad(), r.dw[1], "dw of a non-leaf weight");
    EXPECT_EQ(fired, leaves_only ? 1 : 0) << "the hook runs when the engine accumulates";
    EXPECT_FALSE(base.grad().defined()) << "nothing flows past the weights";
    EXPECT_THROW(gf.weight_grad_into_grad(), c10::Error);  // the graph is freed
  }
  w.mutable_grad() = torch::Tensor();
}

TEST_F(SplitTest, UndefinedInputsAreIgnored) {
  auto x = torch::randn({3, 3}, kF64).requires_grad_(true);
  auto w = param({3, 3});
  auto out = x.matmul(w).sum();
  GradFunction gf({out}, {torch::Tensor(), x}, {w});
  auto dx = gf.compute_input_grad();
  ASSERT_EQ(dx.size(), 2u);
  EXPECT_FALSE(dx[0].defined());
  auto ref = torch::autograd::grad({x.matmul(w).sum()}, {x, w});
  expect_close(dx[1], ref[0], "dx");
  expect_close(gf.compute_weight_grad()[0], ref[1], "dw");
}

// NOTE [Anchors] in split_plan.h: a node that stands for a collective (here
// y = 2 x, counting its backward calls) runs in dx, also on a first stage
// whose input takes no gradient (C would be empty without it), and never in
// dw; values equal plain autograd in both cases.
int g_anchor_calls = 0;

struct DoublingAnchor : hp::autograd::AnchorNode {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    ++g_anchor_calls;
    return {grads.at(0).defined() ? grads[0] * 2 : torch::Tensor()};
  }
};

torch::Tensor anchored_double(const torch::Tensor& x) {
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = x * 2;
  }
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    auto node = std::shared_ptr<DoublingAnchor>(new DoublingAnchor(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(out, node);
  }
  return out;
}

TEST_F(SplitTest, AnchorsRunInDxAlsoWithoutAnInputAndNeverInDw) {
  auto x = torch::randn({4, 3}, kF64);
  TensorList weights = {param({3, 5}), param({5, 5}), param({5, 2})};
  Fn fn = [&](const TensorList& in) {
    auto h = torch::tanh(in[0].matmul(weights[0]));
    auto z = torch::tanh(anchored_double(h).matmul(weights[1]));
    // h also feeds the output past the anchors: its node gets gradient twice.
    return TensorList{anchored_double(z).matmul(weights[2]) + h.narrow(1, 0, 2)};
  };
  Fn plain = [&](const TensorList& in) {
    auto h = torch::tanh(in[0].matmul(weights[0]));
    auto z = torch::tanh((h * 2).matmul(weights[1]));
    return TensorList{(z * 2).matmul(weights[2]) + h.narrow(1, 0, 2)};
  };
  for (bool with_input : {false, true}) {
    SCOPED_TRACE(with_input ? "with an input" : "a first stage");
    const GradPosition position = with_input ? GradPosition::all() : GradPosition::none();
    auto stats = check_split(fn, {x}, weights, position);
    auto plain_stats = check_split(plain, {x}, weights, position);
    if (with_input) {  // each anchor stands where the plain graph's doubling was
      EXPECT_EQ(stats.num_dx_nodes, plain_stats.num_dx_nodes);
    } else {  // without anchors a first stage's dx runs nothing
      EXPECT_EQ(plain_stats.num_dx_nodes, 0u);
      EXPECT_GT(stats.num_dx_nodes, 0u);
    }
    auto opts = ForwardAndGradOptions().weights(weights).grad_position(position);
    auto [outs, split] = forward_and_gradfn(fn, {x}, opts);
    g_anchor_calls = 0;
    split.compute_input_grad({torch::randn_like(outs[0])});
    EXPECT_EQ(g_anchor_calls, 2) << "dx runs both anchors";
    split.weight_grad_into_grad();
    EXPECT_EQ(g_anchor_calls, 2) << "dw runs no anchor";
    for (auto& w : weights)
      w.mutable_grad() = torch::Tensor();
  }
}

using hp::testing::FlopCounter;

TEST_F(SplitTest, DxPlusDwCostsTheFlopsOfOneFusedBackward) {
  auto x = torch::randn({16, 32}, kF64);
  TensorList ws{param({32, 64}), param({64}), param({64, 64}), param({64, 32})};
  Fn fn = [&](const TensorList& in) {
    auto h = torch::gelu(torch::addmm(ws[1], in[0], ws[0]));
    h = h + torch::tanh(h.matmul(ws[2])).matmul(ws[2]);  // nested reuse of ws[2]
    auto att = h.unsqueeze(0).matmul(h.unsqueeze(0).transpose(1, 2)).softmax(-1);  // bmm
    return TensorList{att.matmul(h.unsqueeze(0)).squeeze(0).matmul(ws[3])};
  };
  auto opts = ForwardAndGradOptions().weights(ws);
  auto [o1, fused] = forward_and_gradfn(fn, {x}, opts);
  int64_t fused_flops = 0, dx_flops = 0, dw_flops = 0;
  {
    FlopCounter c;
    fused();
    fused_flops = FlopCounter::flops();
  }
  auto [o2, split] = forward_and_gradfn(fn, {x}, opts);
  {
    FlopCounter c;
    split.compute_input_grad();
    dx_flops = FlopCounter::flops();
  }
  {
    FlopCounter c;
    split.compute_weight_grad();
    dw_flops = FlopCounter::flops();
  }
  EXPECT_GT(fused_flops, 0);
  EXPECT_GT(dx_flops, 0);
  EXPECT_GT(dw_flops, 0);
  EXPECT_EQ(dx_flops + dw_flops, fused_flops);
  for (auto& w : ws)
    w.mutable_grad() = torch::Tensor();
}

TEST_F(SplitTest, MemoryDxFreesWhatOnlyDxNeededDwFreesTheRest) {
  auto x = torch::randn({64, 64}, kF64);
  auto w1 = param({64, 64}), w2 = param({64, 64});
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> e_weak, s_weak;
  Fn fn = [&](const TensorList& in) {
    auto e = in[0].matmul(w1).exp();  // saved by ExpBackward and SinBackward: dx only
    auto s = e.sin();                 // saved by the second matmul for dw2
    e_weak.emplace(e.storage().getWeakStorageImpl());
    s_weak.emplace(s.storage().getWeakStorageImpl());
    return TensorList{s.matmul(w2).sum()};
  };
  auto [out, gf] = forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({w1, w2}));
  EXPECT_FALSE(e_weak->expired());
  EXPECT_FALSE(s_weak->expired());
  gf.compute_input_grad();
  EXPECT_TRUE(e_weak->expired()) << "dx must free tensors only dx needed";
  EXPECT_FALSE(s_weak->expired()) << "dw still needs s";
  gf.compute_weight_grad();
  EXPECT_TRUE(s_weak->expired()) << "dw without keep_graph frees the graph's saved tensors";
  w1.mutable_grad() = torch::Tensor();
  w2.mutable_grad() = torch::Tensor();
}

// Every misuse fails with a message that says what to do.
using hp::testing::expect_error;

TEST_F(SplitTest, MisuseIsAClearError) {
  auto x = torch::randn({3, 3}, kF64);
  auto w = param({3, 3});
  Fn fn = [&](const TensorList& in) { return TensorList{in[0].matmul(w)}; };
  auto opts = ForwardAndGradOptions().weights({w});

  expect_error([&] { forward_and_gradfn(fn, {x}, opts).second.compute_weight_grad(); },
               "call compute_input_grad(sens) first");
  expect_error(
      [&] {
        auto gf = forward_and_gradfn(fn, {x}, opts).second;
        gf.compute_input_grad();
        gf.compute_input_grad();
      },
      "dx runs once per forward");
  expect_error(
      [&] {
        auto gf = forward_and_gradfn(fn, {x}, opts).second;
        gf.compute_input_grad();
        gf();
      },
      "finish with compute_weight_grad");
  expect_error(
      [&] {
        forward_and_gradfn(fn, {x}, ForwardAndGradOptions().grad_position(GradPosition::none()));
      },
      "no weights and no input positions");
  expect_error(
      [&] {
        forward_and_gradfn(fn, {x}, ForwardAndGradOptions().weights({torch::randn({3, 3}, kF64)}));
      },
      "does not require grad");
  expect_error(
      [&] {
        forward_and_gradfn(
            fn, {x},
            ForwardAndGradOptions().weights({w}).grad_position(GradPosition::indices({1})));
      },
      "out of range");
  expect_error(
      [&] {
        forward_and_gradfn(
            fn, {x},
            ForwardAndGradOptions().weights({w}).grad_position(GradPosition::indices({0, 0})));
      },
      "twice");
  expect_error([&] { GradFunction({torch::ones({2}, kF64)}, {}, {w}); },
               "output 0 does not require grad");
  expect_error(
      [&] {
        forward_and_gradfn(fn, {x}, opts)
            .second.compute_input_grad({torch::ones({3, 3}, kF64), torch::ones({3, 3}, kF64)});
      },
      "sens has 2 tensors but there are 1");
  expect_error(
      [&] {
        forward_and_gradfn(fn, {x}, opts).second.compute_input_grad({torch::ones({3}, kF64)});
      },
      "has shape");
  expect_error(
      [&] {
        forward_and_gradfn(fn, {x}, opts).second.compute_input_grad({torch::ones({3, 3})});
      },
      "has dtype");
  expect_error(
      [&] {
        forward_and_gradfn(fn, {torch::ones({3, 3}, torch::kLong)}, opts);
      },
      "has no gradient");
  w.mutable_grad() = torch::Tensor();
}
