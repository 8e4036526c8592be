// The reference MoE layer: route, dispatch, local experts, combine, shared
// experts beside them.
#include "hp/moe/moe_layer.h"

#include <ATen/CPUGeneratorImpl.h>

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
  // The local experts, one product each over all their rows.
  std::vector<torch::Tensor> outs;
  int64_t at = 0;
  for (size_t e = 0; e < up_.size(); ++e) {
    auto rows = d.tokens.narrow(0, at, d.tokens_per_expert[e]);
    outs.push_back(down_[e](torch::gelu(up_[e](rows))));
    at += d.tokens_per_expert[e];
  }
  auto y = outs.empty() ? d.tokens.narrow(0, 0, 0) : torch::cat(outs, 0);
  auto out = dispatcher_.combine(y, d, routing.weights);
  for (size_t s = 0; s < shared_up_.size(); ++s)
    out = out + shared_down_[s](torch::gelu(shared_up_[s](flat)));
  return out.view(x.sizes());
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
