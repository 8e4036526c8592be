// hp/moe/dispatch.h: tokens to the ranks that hold their experts and back.
// Dispatch sorts each (token, slot) pair by expert, exchanges the counts per
// expert, sends the rows with one all-to-all and regroups them by local
// expert; combine undoes each step and sums every token's experts weighted
// by the router (NOTE [Dispatch and combine]).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::moe {

/// Which experts a rank of an expert-parallel group holds: the group's
/// `size` ranks hold `num_experts / size` consecutive experts each.
struct ExpertPlacement {
  int64_t num_experts = 1;
  int rank = 0;  ///< this rank in the EP group
  int size = 1;  ///< ranks in the EP group
  int64_t local() const { return num_experts / size; }
  int64_t first() const { return rank * local(); }
  /// Throws c10::Error when the experts do not divide over the ranks.
  void check() const;
};

/// What dispatch hands the local experts, and what combine needs.
struct Dispatched {
  /// [N, hidden]: the rows this rank's experts compute, by local expert
  /// (tokens_per_expert[0] rows for the first, then the next, ...).
  torch::Tensor tokens;
  std::vector<int64_t> tokens_per_expert;
  /// The pairs routed (t * top_k + j, sorted by expert; pairs over an
  /// expert's capacity left out), and the pairs' row counts per rank, sent
  /// and received.
  torch::Tensor order;
  std::vector<int64_t> send_rows, recv_rows;
  /// From the received order (by source rank, then expert) to tokens' order
  /// (by expert, then source rank), and back.
  torch::Tensor by_expert, by_source;
  int64_t num_tokens = 0, top_k = 0;
  /// (token, slot) pairs this rank routed that an expert's capacity dropped.
  int64_t dropped = 0;
};

/// Options of a TokenDispatcher.
struct DispatchOptions {
  /// 0: dropless (every pair is computed). Above 0: each expert takes at most
  /// ceil(capacity_factor * tokens * top_k / num_experts) pairs from each
  /// rank, the earliest tokens first; the rest are dropped (they add nothing
  /// to the output) and counted.
  double capacity_factor = 0.0;
};

/// Moves tokens between the ranks of an expert-parallel group (NOTE
/// [Dispatch and combine]). A group of one rank (or none) computes every
/// expert locally, with the same permutations.
class TokenDispatcher {
 public:
  TokenDispatcher(std::shared_ptr<distributed::Comm> group, int64_t num_experts,
                  DispatchOptions options = {});
  /// `x` [T, hidden], `experts` [T, top_k] (int64, global expert ids).
  /// Collective over the group (two exchanges: the counts, then the rows;
  /// one on the CPU over a group in lanes, NOTE [Counts at the head of the
  /// rows] in all_to_all.cpp).
  Dispatched dispatch(const torch::Tensor& x, const torch::Tensor& experts) const;
  /// `y` [N, hidden]: the local experts' output for `d.tokens`, row for row;
  /// `weights` [T, top_k]: the router's. Returns [T, hidden], every token's
  /// experts summed by weight. Collective (one exchange).
  torch::Tensor combine(const torch::Tensor& y, const Dispatched& d,
                        const torch::Tensor& weights) const;

  const ExpertPlacement& placement() const { return placement_; }
  const std::shared_ptr<distributed::Comm>& group() const { return group_; }

 private:
  std::shared_ptr<distributed::Comm> group_;

  /// The group as it carries tensors on `device`: itself on the CPU and over
  /// NCCL, else staged through host memory (distributed::for_device: two
  /// ranks sharing a GPU over Gloo).
  std::shared_ptr<distributed::Comm> comm_for(const c10::Device& device) const {
    return distributed::for_device(group_, device);
  }
  ExpertPlacement placement_;
  DispatchOptions options_;
};

}  // namespace hp::moe
