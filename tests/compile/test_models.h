// Small float64 models and train functions shared by the graph-mode tests:
// an MLP (MSE loss), a transformer-like block (layer norm, attention, GELU,
// cross entropy) and a model with a parameter shared under two FQNs.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <string>

#include "hp/compile/capture.h"

namespace hp_test {

inline const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out) {
    fc1 = register_module("fc1", torch::nn::Linear(in, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, out));
    to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t classes) : d_(d) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("attn_qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("attn_proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    up = register_module("mlp_up", torch::nn::Linear(d, 2 * d));
    down = register_module("mlp_down", torch::nn::Linear(2 * d, d));
    head = register_module("head", torch::nn::Linear(d, classes));
    to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, T, d]
    auto h = ln1(x);
    auto parts = qkv(h).chunk(3, -1);
    auto att = torch::softmax(
        torch::matmul(parts[0], parts[1].transpose(1, 2)) / std::sqrt(double(d_)), -1);
    auto y = x + proj(torch::matmul(att, parts[2]));
    y = y + down(torch::gelu(up(ln2(y))));
    return head(y.mean(1));
  }
  int64_t d_;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr}, head{nullptr};
};
TORCH_MODULE(Block);

// A module that holds the weight it is given (to share one tensor).
struct HoldImpl : torch::nn::Module {
  explicit HoldImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor weight;
};
TORCH_MODULE(Hold);

// enc.weight is also dec.weight (tied): one tensor, two FQNs; mid between.
struct TiedImpl : torch::nn::Module {
  TiedImpl(int64_t in, int64_t d) {
    auto w = torch::randn({d, in}, kF64) * 0.3;
    enc = register_module("enc", Hold(w));
    mid = register_module("mid", torch::nn::Linear(d, d));
    dec = register_module("dec", Hold(w));
    mid->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(mid(torch::matmul(x, enc->weight.t())));
    return torch::matmul(h, dec->weight);
  }
  Hold enc{nullptr}, dec{nullptr};
  torch::nn::Linear mid{nullptr};
};
TORCH_MODULE(Tied);

template <class M>
hp::compile::TrainFn mse_fn() {
  return [](torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(static_cast<M&>(m).forward(x), y);
  };
}

template <class M>
hp::compile::TrainFn ce_fn() {
  return [](torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(static_cast<M&>(m).forward(x), y);
  };
}

inline void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what,
                         double tol = 1e-12) {
  ASSERT_TRUE(a.defined()) << what;
  ASSERT_TRUE(b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  double scale = std::max(1.0, b.abs().max().item<double>());
  double err = (a - b).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max abs error " << err;
}

}  // namespace hp_test
