// Top-k routing (softmax or sigmoid scores, group-limited choice) and the
// load-balancing loss.
#include "hp/moe/router.h"

namespace hp::moe {

void RouterOptions::check() const {
  TORCH_CHECK(num_experts >= 1, "a MoE layer needs at least one expert, got ", num_experts);
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "top_k must be in [1, ", num_experts,
              "] (the number of experts), got ", top_k);
  TORCH_CHECK(scoring == "softmax" || scoring == "sigmoid", "router scoring must be 'softmax' or ",
              "'sigmoid', got '", scoring, "'");
  TORCH_CHECK(groups >= 1 && num_experts % groups == 0, "the ", num_experts,
              " experts do not form ", groups, " equal groups");
  TORCH_CHECK(top_groups >= 1 && top_groups <= groups, "top_groups must be in [1, ", groups,
              "], got ", top_groups);
  TORCH_CHECK(groups == 1 || top_groups * (num_experts / groups) >= top_k, "the ", top_groups,
              " best groups hold ", top_groups * (num_experts / groups),
              " experts, fewer than top_k ", top_k);
}

Routing route(const torch::Tensor& logits, const RouterOptions& o,
              const torch::Tensor& selection_bias) {
  o.check();
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) == o.num_experts,
              "router logits must be [tokens, ", o.num_experts, "], got ", logits.sizes());
  Routing r;
  r.scores = o.scoring == "softmax" ? logits.softmax(-1) : logits.sigmoid();
  torch::Tensor choose = r.scores.detach();
  if (selection_bias.defined()) choose = choose + selection_bias.detach().to(choose.dtype());
  if (o.groups > 1) {
    // A group's score: the sum of its two best experts (its best alone when
    // a group holds one); the experts of the groups not chosen cannot win.
    const int64_t T = choose.size(0), per = o.num_experts / o.groups;
    auto grouped = choose.view({T, o.groups, per});
    auto group_score = std::get<0>(grouped.topk(std::min<int64_t>(2, per), -1)).sum(-1);
    auto best = std::get<1>(group_score.topk(o.top_groups, -1));
    auto keep = torch::zeros({T, o.groups}, choose.options().dtype(torch::kBool))
                    .scatter_(1, best, true)
                    .unsqueeze(-1)
                    .expand({T, o.groups, per})
                    .reshape({T, o.num_experts});
    choose = choose.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  }
  r.experts = std::get<1>(choose.topk(o.top_k, -1));
  r.weights = r.scores.gather(1, r.experts);
  if (o.normalize) {
    auto sum = r.weights.sum(-1, true);
    r.weights = o.scoring == "sigmoid" ? r.weights / (sum + 1e-20) : r.weights / sum;
  }
  if (o.scale != 1.0) r.weights = r.weights * o.scale;
  return r;
}

torch::Tensor load_balancing_loss(const Routing& routing, int64_t num_experts) {
  // [T, k, E] one-hot choices: their mean over tokens is f per slot.
  auto chosen = torch::one_hot(routing.experts, num_experts).to(routing.scores.dtype());
  auto share = chosen.mean(0);               // [k, E]
  auto mean_score = routing.scores.mean(0);  // [E]
  return (share * mean_score.unsqueeze(0)).sum() * double(num_experts);
}

}  // namespace hp::moe
