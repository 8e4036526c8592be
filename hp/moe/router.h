// hp/moe/router.h: which experts each token goes to, and with what weight:
// top-k over softmax or sigmoid scores, optionally limited to the best groups
// of experts (DeepSeek-V3), and the load-balancing loss of the choice.
#pragma once

#include <torch/torch.h>

#include <string>

namespace hp::moe {

/// How a router turns its logits into a choice of experts.
struct RouterOptions {
  int64_t num_experts = 8;
  int64_t top_k = 2;
  /// "softmax" (Mixtral, Qwen-MoE: probabilities over all experts) or
  /// "sigmoid" (DeepSeek-V3: an independent score per expert).
  std::string scoring = "softmax";
  /// Group-limited routing: the experts form `groups` equal groups, a group
  /// scores the sum of its two best experts, and only the `top_groups` best
  /// groups are chosen from. 1: no limit.
  int64_t groups = 1;
  int64_t top_groups = 1;
  /// Divide the chosen weights by their sum.
  bool normalize = true;
  /// Multiply the chosen weights by this (DeepSeek-V3's routed_scaling_factor).
  double scale = 1.0;

  /// Throws c10::Error saying what to change.
  void check() const;
};

/// A router's choice for T tokens.
struct Routing {
  torch::Tensor weights;  ///< [T, top_k], the logits' dtype (differentiable)
  torch::Tensor experts;  ///< [T, top_k] int64, each token's experts (no repeats)
  torch::Tensor scores;   ///< [T, num_experts]: the probabilities or sigmoid scores
};

/// Routes `logits` ([T, num_experts]). `selection_bias` ([num_experts], may
/// be undefined) is added to the scores for choosing only, as DeepSeek-V3's
/// correction bias: the weights stay the unbiased scores.
Routing route(const torch::Tensor& logits, const RouterOptions& options,
              const torch::Tensor& selection_bias = {});

/// Mixtral's load-balancing term: num_experts * sum_e f_e * P_e, with f_e
/// the share of (token, slot) pairs sent to expert e per slot and P_e the
/// mean score of e over the tokens. A scalar of the scores' dtype.
torch::Tensor load_balancing_loss(const Routing& routing, int64_t num_experts);

}  // namespace hp::moe
