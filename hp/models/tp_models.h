// The tensor-parallel reference GPT (Megatron's layout): every block's
// attention and MLP split over the ranks of a TP group, column-parallel then
// row-parallel, the heads divided among the ranks; its shards put together
// are the plain GPT of models.h with the same seed.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/models/models.h"

namespace hp::models {

/// How a TP-sharded chunk reaches its TP group: this rank's place in it and
/// Megatron's two region functions, supplied by the layer that owns the
/// group (graph mode passes hp::compile::tp_copy / tp_reduce, operators a
/// capture records). With size 1 neither is called.
struct TensorParallel {
  int64_t rank = 0;
  int64_t size = 1;
  /// f: identity forward, gradient summed over the group (before a
  /// column-parallel layer).
  std::function<torch::Tensor(const torch::Tensor&)> copy_to_region;
  /// g: summed over the group forward, gradient unchanged (after a
  /// row-parallel layer).
  std::function<torch::Tensor(const torch::Tensor&)> reduce_from_region;

  /// Throws std::invalid_argument unless 0 <= rank < size, the functions are
  /// set when size > 1, and `spec` (a gpt) splits: heads and d_model divide
  /// by size (4 * d_model then does too).
  void check(const ModelSpec& spec) const;
};

// NOTE [TP layout of the reference GPT]
// Megatron's split of a pre-norm block over t ranks, rank r of t:
//   attention: a = f(ln1(x)); qkv column-parallel: rank r holds heads
//     [r*H/t, (r+1)*H/t), i.e. rows [r*D/t, (r+1)*D/t) of each of the q, k and
//     v thirds of qkv.weight/bias (stored as [q_r; k_r; v_r], 3D/t rows);
//     attention over its heads; proj row-parallel: columns [r*D/t, (r+1)*D/t)
//     of proj.weight, then g(.) and proj.bias (replicated) once.
//   MLP: m = f(ln2(h)); fc column-parallel (rows [r*4D/t, (r+1)*4D/t) of
//     fc.weight and fc.bias), GELU; fc2 row-parallel (columns of fc2.weight),
//     g(.), fc2.bias (replicated).
// Everything else (layer norms, embeddings, the head) is replicated. FQNs are
// the plain GPT's, and every replicated parameter gets the same full gradient
// on every TP rank (f sums the gradient that reaches it), so replicas stay
// equal under any optimizer. Values are cut from the plain chunk built with
// the same (spec, index, num_chunks, seed), so the shards put together equal
// it exactly (the plain chunk is built once on each rank, then dropped).

/// Chunk `index` of `num_chunks` of the gpt `spec` (kind "gpt"), this TP
/// rank's shard (NOTE [TP layout of the reference GPT]). Checks `tp` first.
std::shared_ptr<Chunk> build_tp_chunk(const ModelSpec& spec, int64_t index, int64_t num_chunks,
                                      uint64_t seed, const TensorParallel& tp);

/// How a parameter of the TP GPT is laid out over the TP group.
enum class TpSplit {
  Replicated,  ///< the full tensor on every rank
  Rows,        ///< dim 0 cut in size equal pieces, rank order
  Columns,     ///< dim 1 cut likewise
  QkvRows,     ///< each third of dim 0 (q, k, v) cut in rows; stored [q_r; k_r; v_r]
};

/// The split of parameter `fqn` ("block0.qkv.weight", ...).
TpSplit tp_split(const std::string& fqn);

/// Cuts a full parameter into rank `rank`'s shard of `size`.
torch::Tensor tp_shard(const torch::Tensor& full, TpSplit split, int64_t rank, int64_t size);

/// Puts the shards of one parameter (every TP rank's, in rank order) back
/// together into the plain model's tensor.
torch::Tensor tp_unshard(const std::vector<torch::Tensor>& shards, TpSplit split);

}  // namespace hp::models
