// Benchmark of the dx/dw split: a fused backward vs dx then dw on the same
// graph shape, and the graph analysis alone, timed side by side in every
// iteration (so machine noise hits both alike) on a transformer block and a
// wide MLP. Reports the ratios (dx + dw) / fused and analysis / fused.
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "hp/autograd/grad_function.h"
#include "hp/autograd/split_plan.h"
#include "hp/core/memory.h"

using hp::autograd::TensorList;
namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Model {
  TensorList weights;
  torch::Tensor input;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

torch::Tensor init(std::vector<int64_t> shape, double scale) {
  return (torch::randn(shape) * scale).requires_grad_(true);
}

// A GPT-style block: pre-norm causal self-attention and a GELU MLP, residuals.
Model transformer_block(int64_t batch, int64_t seq, int64_t d, int64_t heads) {
  Model m;
  const double s = 1.0 / std::sqrt(double(d));
  m.weights = {torch::ones({d}).requires_grad_(true),
               torch::zeros({d}).requires_grad_(true),
               init({d, 3 * d}, s),
               torch::zeros({3 * d}).requires_grad_(true),
               init({d, d}, s),
               torch::zeros({d}).requires_grad_(true),
               torch::ones({d}).requires_grad_(true),
               torch::zeros({d}).requires_grad_(true),
               init({d, 4 * d}, s),
               torch::zeros({4 * d}).requires_grad_(true),
               init({4 * d, d}, s / 2),
               torch::zeros({d}).requires_grad_(true)};
  m.input = torch::randn({batch, seq, d});
  auto w = m.weights;
  const int64_t hd = d / heads;
  auto mask = torch::ones({seq, seq}, torch::kBool).triu(1);
  m.forward = [=](const torch::Tensor& x) {
    auto a = torch::layer_norm(x, {d}, w[0], w[1]);
    auto parts = (torch::matmul(a, w[2]) + w[3]).split(d, -1);
    auto split_heads = [&](const torch::Tensor& t) {
      return t.view({batch, seq, heads, hd}).transpose(1, 2);
    };
    auto q = split_heads(parts[0]), k = split_heads(parts[1]), v = split_heads(parts[2]);
    auto att = (q.matmul(k.transpose(-2, -1)) / std::sqrt(double(hd))).masked_fill(mask, -1e9);
    auto y = att.softmax(-1).matmul(v).transpose(1, 2).reshape({batch, seq, d});
    auto h = x + torch::matmul(y, w[4]) + w[5];
    auto f = torch::layer_norm(h, {d}, w[6], w[7]);
    return h + torch::matmul(torch::gelu(torch::matmul(f, w[8]) + w[9]), w[10]) + w[11];
  };
  return m;
}

Model wide_mlp(int64_t batch, int64_t width, int64_t layers) {
  Model m;
  for (int64_t l = 0; l < layers; ++l) {
    m.weights.push_back(init({width, width}, 1.0 / std::sqrt(double(width))));
    m.weights.push_back(torch::zeros({width}).requires_grad_(true));
  }
  m.input = torch::randn({batch, width});
  auto w = m.weights;
  m.forward = [=](const torch::Tensor& x) {
    auto h = x;
    for (size_t l = 0; l < w.size(); l += 2)
      h = torch::relu(torch::addmm(w[l + 1], h, w[l]));
    return h;
  };
  return m;
}

// One iteration = a fused backward, a split backward and an analysis, each on
// a fresh forward of the same model and data, in an order that alternates.
void run(benchmark::State& state, const Model& m) {
  at::set_num_threads(1);
  std::vector<double> fused, dx, dw, analysis;
  auto forward = [&] {
    auto x = m.input.detach().requires_grad_(true);
    return std::make_pair(x, m.forward(x));
  };
  int64_t it = 0;
  for (auto _ : state) {
    for (int order = 0; order < 2; ++order) {
      if ((order + it) % 2 == 0) {
        auto [x, y] = forward();
        hp::autograd::GradFunction gf({y}, {x}, m.weights);
        auto t0 = Clock::now();
        gf();
        fused.push_back(seconds(t0, Clock::now()));
      } else {
        auto [x, y] = forward();
        hp::autograd::GradFunction gf({y}, {x}, m.weights);
        auto t0 = Clock::now();
        gf.compute_input_grad();
        auto t1 = Clock::now();
        gf.compute_weight_grad();
        auto t2 = Clock::now();
        dx.push_back(seconds(t0, t1));
        dw.push_back(seconds(t1, t2));
      }
    }
    {
      auto [x, y] = forward();
      std::vector<torch::autograd::Edge> weight_edges;
      for (const auto& w : m.weights)
        weight_edges.push_back(torch::autograd::impl::gradient_edge(w));
      auto t0 = Clock::now();
      auto plan = hp::autograd::plan_split({torch::autograd::impl::gradient_edge(y)},
                                           {torch::autograd::impl::gradient_edge(x)}, weight_edges);
      benchmark::DoNotOptimize(plan.groups.size());
      analysis.push_back(seconds(t0, Clock::now()));
    }
    state.SetIterationTime(fused.back());
    ++it;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> split(dx.size());
  for (size_t i = 0; i < dx.size(); ++i)
    split[i] = dx[i] + dw[i];
  double f = median(fused);
  state.counters["fused_ms"] = f * 1e3;
  state.counters["dx_ms"] = median(dx) * 1e3;
  state.counters["dw_ms"] = median(dw) * 1e3;
  state.counters["split_over_fused"] = median(split) / f;
  state.counters["analysis_pct"] = 100.0 * median(analysis) / f;
  for (auto& w : m.weights)
    w.mutable_grad() = torch::Tensor();
}

void BM_TransformerBlock(benchmark::State& state) {
  torch::manual_seed(0);
  static Model m = transformer_block(/*batch=*/8, /*seq=*/128, /*d=*/256, /*heads=*/4);
  run(state, m);
}
void BM_WideMlp(benchmark::State& state) {
  torch::manual_seed(0);
  static Model m = wide_mlp(/*batch=*/256, /*width=*/1024, /*layers=*/4);
  run(state, m);
}

}  // namespace

BENCHMARK(BM_TransformerBlock)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_WideMlp)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(3.0);
int main(int argc, char** argv) {
  hp::keep_freed_memory_mapped();  // NOTE [glibc malloc and page faults]
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
