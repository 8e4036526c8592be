// `hp demo split`: a short, self-checking demonstration of the dx/dw split on
// a small MLP: dx and dw run apart, compared with one fused torch backward.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "hp/autograd/grad_function.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct DemoOptions {
  int64_t batch = 64;
  int64_t width = 256;
  int64_t layers = 4;
  uint64_t seed = 0;
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int run_split_demo(const DemoOptions& o) {
  torch::manual_seed(o.seed);
  auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  std::vector<torch::Tensor> weights;
  for (int64_t l = 0; l < o.layers; ++l)
    weights.push_back(
        (torch::randn({o.width, o.width}, opts) / std::sqrt(double(o.width))).requires_grad_(true));
  auto x = torch::randn({o.batch, o.width}, opts);
  auto mlp = [&](const autograd::TensorList& in) {
    auto h = in[0];
    for (const auto& w : weights)
      h = torch::tanh(h.matmul(w));
    return autograd::TensorList{h.pow(2).sum()};
  };

  std::printf("hp demo split: %lld-layer MLP, batch %lld, width %lld, float64\n",
              (long long)o.layers, (long long)o.batch, (long long)o.width);
  auto [out, grad_fn] =
      autograd::forward_and_gradfn(mlp, {x}, autograd::ForwardAndGradOptions().weights(weights));
  auto t0 = std::chrono::steady_clock::now();
  auto dx = grad_fn.compute_input_grad();
  double dx_ms = ms_since(t0);
  auto st = grad_fn.stats();
  std::printf(
      "  dx  (compute_input_grad):  %7.2f ms   graph: %zu nodes, %zu on the dx path, "
      "%zu joining nodes, %zu dw groups\n",
      dx_ms, st.num_nodes, st.num_dx_nodes, st.num_join_nodes, st.num_groups);
  t0 = std::chrono::steady_clock::now();
  auto dw = grad_fn.compute_weight_grad();
  std::printf("  dw  (compute_weight_grad): %7.2f ms   (can run later, in a pipeline bubble)\n",
              ms_since(t0));

  // Reference: one plain torch::autograd::grad on a fresh forward.
  auto xr = x.detach().requires_grad_(true);
  auto loss = mlp({xr})[0];
  std::vector<torch::Tensor> wrt{xr};
  wrt.insert(wrt.end(), weights.begin(), weights.end());
  t0 = std::chrono::steady_clock::now();
  auto ref = torch::autograd::grad({loss}, wrt);
  std::printf("  fused torch::autograd::grad: %5.2f ms\n", ms_since(t0));

  double max_err = (dx[0] - ref[0]).abs().max().item<double>();
  for (size_t i = 0; i < dw.size(); ++i)
    max_err = std::max(max_err, (dw[i] - ref[i + 1]).abs().max().item<double>());
  bool ok = max_err < 1e-10;
  std::printf("  max |split - fused| = %.3g  -> %s\n", max_err, ok ? "identical" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto* demo = app.add_subcommand("demo", "short demonstrations of the library");
  demo->require_subcommand(1);
  auto* split = demo->add_subcommand("split", "dx/dw split of an MLP's backward, checked");
  auto o = std::make_shared<DemoOptions>();
  split->add_option("--batch", o->batch, "rows of the input")->check(CLI::PositiveNumber);
  split->add_option("--width", o->width, "width of every layer")->check(CLI::PositiveNumber);
  split->add_option("--layers", o->layers, "number of layers")->check(CLI::PositiveNumber);
  split->add_option("--seed", o->seed, "random seed");
  split->callback([o] {
    int rc = run_split_demo(*o);
    if (rc != 0) throw std::runtime_error("the split's gradients differ from the fused backward");
  });
}

HP_CLI_COMMAND(add_demo_command);

}  // namespace hp::cli
