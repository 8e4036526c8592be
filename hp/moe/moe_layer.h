// hp/moe/moe_layer.h: a mixture-of-experts feed-forward layer with expert
// parallelism, as the reference GPT's MoE variant uses it: a router, this
// rank's slice of the experts (GELU MLPs), optional shared experts, and the
// load-balancing loss handed to the caller.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/moe/dispatch.h"
#include "hp/moe/router.h"

namespace hp::moe {

/// How a layer computes its local experts (NOTE [Grouped expert products]
/// in moe_layer.cpp): `Auto` takes the grouped product where LibTorch has
/// one for the input's dtype and device and the widths fit it, the loop
/// elsewhere; `Grouped` insists (an error where it cannot); `Loop` never.
enum class ExpertCompute { Auto, Loop, Grouped };

/// "auto", "loop" or "grouped"; throws naming the choices otherwise.
ExpertCompute expert_compute_from_string(const std::string& name);

/// The shape of a MoE layer.
struct MoELayerOptions {
  int64_t d_model = 64;
  int64_t hidden = 256;  ///< each expert's inner width
  RouterOptions router;
  /// Dense experts every token goes through beside the routed ones
  /// (DeepSeek-V3), each of `hidden` width; 0: none.
  int64_t shared_experts = 0;
  DispatchOptions dispatch;
  ExpertCompute experts = ExpertCompute::Auto;
};

/// One MoE layer holding experts [first, first + local) of the group's
/// placement (ExpertPlacement). Every expert's initial values come from its
/// own generator, seeded by (`seed`, expert), so a rank's slice equals the
/// same experts of the unsharded layer.
class MoELayerImpl : public torch::nn::Module {
 public:
  MoELayerImpl(const MoELayerOptions& options, std::shared_ptr<distributed::Comm> ep_group,
               uint64_t seed, double init_std, double residual_std);
  /// `x` [..., d_model] -> [..., d_model]. Collective over the EP group.
  torch::Tensor forward(const torch::Tensor& x);
  /// The load-balancing loss of the last forward (a scalar in the graph).
  const torch::Tensor& last_balance_loss() const { return balance_loss_; }
  /// Pairs the last forward dropped over the capacity (0 when dropless).
  int64_t last_dropped() const { return dropped_; }
  /// The routed experts' parameters this rank holds (data parallelism must
  /// not average them over the EP group: NOTE [Expert gradients]).
  std::vector<torch::Tensor> expert_parameters() const;
  const ExpertPlacement& placement() const { return dispatcher_.placement(); }
  /// Whether the last forward computed its experts with one grouped product
  /// per projection (true) or a loop over the experts (false).
  bool last_grouped() const { return grouped_; }

 private:
  MoELayerOptions options_;
  TokenDispatcher dispatcher_;
  torch::Tensor router_;  ///< [num_experts, d_model]
  std::vector<torch::nn::Linear> up_, down_;
  std::vector<torch::nn::Linear> shared_up_, shared_down_;
  torch::Tensor balance_loss_;
  int64_t dropped_ = 0;
  bool grouped_ = false;

  /// The experts on `rows` (grouped by local expert, `counts` each), by
  /// loop or by grouped product.
  torch::Tensor experts(const torch::Tensor& rows, const std::vector<int64_t>& counts);
};
TORCH_MODULE(MoELayer);

}  // namespace hp::moe
