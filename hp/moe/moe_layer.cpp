// The reference MoE layer: route, dispatch, local experts, combine, shared
// experts beside them.
#include "hp/moe/moe_layer.h"

#include <ATen/CPUGeneratorImpl.h>

#include "hp/core/compat.h"

namespace hp::moe {
namespace {

at::Generator expert_generator(uint64_t seed, int64_t expert) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 6364136223846793005ull +
                                                  1442695040888963407ull * uint64_t(expert + 1));
}

torch::nn::Linear linear(int64_t in, int64_t out, at::Generator& gen, double std) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(false));
  torch::NoGradGuard g;
  l->weight.normal_(0.0, std, gen);
  return l;
}

}  // namespace

MoELayerImpl::MoELayerImpl(const MoELayerOptions& options,
                           std::shared_ptr<distributed::Comm> ep_group, uint64_t seed,
                           double init_std, double residual_std)
    : options_(options),
      dispatcher_(std::move(ep_group), options.router.num_experts, options.dispatch) {
  options_.router.check();
  TORCH_CHECK(options_.d_model >= 1 && options_.hidden >= 1 && options_.shared_experts >= 0,
              "a MoE layer needs positive widths, got d_model ", options_.d_model, ", hidden ",
              options_.hidden, ", shared experts ", options_.shared_experts);
  const int64_t E = options_.router.num_experts;
  {
    // The router and the shared experts from the layer's own generator
    // (index -1); the routed experts each from theirs.
    auto gen = expert_generator(seed, -1);
    torch::NoGradGuard g;
    router_ =
        register_parameter("router", torch::empty({E, options_.d_model}).normal_(0, init_std, gen));
    for (int64_t s = 0; s < options_.shared_experts; ++s) {
      shared_up_.push_back(
          register_module("shared" + std::to_string(s) + "_fc",
                          linear(options_.d_model, options_.hidden, gen, init_std)));
      shared_down_.push_back(
          register_module("shared" + std::to_string(s) + "_fc2",
                          linear(options_.hidden, options_.d_model, gen, residual_std)));
    }
  }
  const auto& p = dispatcher_.placement();
  for (int64_t e = p.first(); e < p.first() + p.local(); ++e) {
    auto gen = expert_generator(seed, e);
    const std::string name = "expert" + std::to_string(e);
    up_.push_back(
        register_module(name + "_fc", linear(options_.d_model, options_.hidden, gen, init_std)));
    down_.push_back(register_module(name + "_fc2",
                                    linear(options_.hidden, options_.d_model, gen, residual_std)));
  }
}

torch::Tensor MoELayerImpl::forward(const torch::Tensor& x) {
  const int64_t D = options_.d_model;
  TORCH_CHECK(x.size(-1) == D, "MoE layer: the input's last dimension must be d_model ", D,
              ", got ", x.sizes());
  auto flat = x.reshape({-1, D});
  Routing routing = route(torch::matmul(flat, router_.t()), options_.router);
  balance_loss_ = load_balancing_loss(routing, options_.router.num_experts);
  Dispatched d = dispatcher_.dispatch(flat, routing.experts);
  dropped_ = d.dropped;
  auto y = experts(d.tokens, d.tokens_per_expert);
  auto out = dispatcher_.combine(y, d, routing.weights);
  for (size_t s = 0; s < shared_up_.size(); ++s)
    out = out + shared_down_[s](torch::gelu(shared_up_[s](flat)));
  return out.view(x.sizes());
}

// NOTE [Grouped expert products]
// A rank's experts each take a block of the dispatched rows (grouped by
// local expert). The loop runs two products per expert, each over all its
// rows; the grouped product (at::_grouped_mm, LibTorch 2.9 and later) runs
// each projection of every expert as one call over the stacked weights
// [experts, in, out] and the running row ends, which a GPU runs as one
// kernel however unevenly the router spread the rows. The stacked weights
// are a copy made each forward (the experts stay separate Linear modules,
// so their names, initial values and checkpoints are the loop's); its
// backward hands each expert its slice, so the dx/dw split and the W's
// without an exchange hold as for the loop. LibTorch 2.11's CPU kernel takes
// float32 and bfloat16 (never float64) with every row stride a multiple of
// 16 bytes; `Auto` checks both (compat::has_grouped_mm probes the dtype
// once) and takes the loop otherwise, so the float64 oracles of the tests
// run the loop and a float32 run the grouped product, tested equal to the
// loop (MoELayer.GroupedProductsEqualTheLoop). Debian's LibTorch 2.6 has no
// grouped product: there `Auto` is the loop and `Grouped` an error.
torch::Tensor MoELayerImpl::experts(const torch::Tensor& rows, const std::vector<int64_t>& counts) {
  const int64_t D = options_.d_model, H = options_.hidden;
  const int64_t align = 16 / static_cast<int64_t>(rows.element_size());
  const bool fits = compat::has_grouped_mm(rows.scalar_type(), rows.device()) &&
                    16 % rows.element_size() == 0 && D % align == 0 && H % align == 0;
  TORCH_CHECK(options_.experts != ExpertCompute::Grouped || fits,
              "MoE layer: grouped expert products need LibTorch 2.9 or later (this is ",
              torch_version(), ") with a grouped product for ", rows.scalar_type(), " on ",
              rows.device(), " (float32 or bfloat16 on the CPU) and widths that are multiples of ",
              "16 bytes (d_model ", D, ", hidden ", H, "); use the loop (\"loop\" or \"auto\")");
  grouped_ = fits && options_.experts != ExpertCompute::Loop;
  if (grouped_) {
    std::vector<torch::Tensor> ups, downs;
    std::vector<int32_t> ends;
    int64_t at = 0;
    for (size_t e = 0; e < up_.size(); ++e) {
      ups.push_back(up_[e]->weight);
      downs.push_back(down_[e]->weight);
      at += counts[e];
      ends.push_back(static_cast<int32_t>(at));
    }
    auto offs = torch::tensor(ends, torch::TensorOptions().dtype(torch::kInt)).to(rows.device());
    // Linear weights are [out, in]: the stacks, transposed, are [e, in, out].
    auto h = compat::grouped_mm(rows.contiguous(), torch::stack(ups).transpose(1, 2), offs);
    return compat::grouped_mm(torch::gelu(h), torch::stack(downs).transpose(1, 2), offs);
  }
  // The loop: one product each over all their rows.
  std::vector<torch::Tensor> outs;
  int64_t at = 0;
  for (size_t e = 0; e < up_.size(); ++e) {
    auto block = rows.narrow(0, at, counts[e]);
    outs.push_back(down_[e](torch::gelu(up_[e](block))));
    at += counts[e];
  }
  return outs.empty() ? rows.narrow(0, 0, 0) : torch::cat(outs, 0);
}

ExpertCompute expert_compute_from_string(const std::string& name) {
  if (name == "auto") return ExpertCompute::Auto;
  if (name == "loop") return ExpertCompute::Loop;
  if (name == "grouped") return ExpertCompute::Grouped;
  TORCH_CHECK(false, "expert compute must be auto, loop or grouped, got \"", name, "\"");
}

std::vector<torch::Tensor> MoELayerImpl::expert_parameters() const {
  std::vector<torch::Tensor> out;
  for (size_t e = 0; e < up_.size(); ++e) {
    out.push_back(up_[e]->weight);
    out.push_back(down_[e]->weight);
  }
  return out;
}

}  // namespace hp::moe
