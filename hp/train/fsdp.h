// `hp train --fsdp`: the parameters of a pipeline's stages sharded over the
// data-parallel copies between steps (NOTE [PP x FSDP in hp train]).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::train {

// NOTE [PP x FSDP in hp train]
// With --pp P --dp D --fsdp, each of the D copies of a pipeline stage keeps
// 1/D of the stage's parameters, of their gradients and of the optimizer's
// state between steps (ZeRO-3 at the granularity of a step):
//   * shards: every parameter flattened and padded to a multiple of D; copy
//     d keeps elements [d * n/D, (d+1) * n/D). The optimizer steps the
//     shards (elementwise, so AdamW and SGD on shards equal them on the
//     whole; padding stays zero).
//   * gather, before a step: the rank's shards concatenated, one all-gather
//     over the dp group, every parameter rebuilt whole in its own tensor
//     (same Parameter, `set_data`), so the pipeline's stages see a plain
//     model for the whole step: I and W read the weights F read.
//   * scatter, after the step: every whole gradient laid out as (D, n/D)
//     rows, one reduce-scatter (average) over the dp group into the shards'
//     gradients; the whole parameters and gradients are then freed.
// So the whole parameters live from the step's first F to its end (like
// the Python Pipeline's FSDP2 stages, NOTE [FSDP2 stages]); between steps a
// rank holds 1/D of them. Gradients are averaged once per step, over D x m
// microbatches, which is what one process training on all of them does.
// The step's loss is averaged over the copies by the Pipeline (its dp
// option), which reduces no gradient here (the chunks' dp_parameters are
// empty). Two collectives per step per rank, not per parameter.
// With --ep the experts stay out of the shards: each copy of an EP group
// holds other experts (nothing to shard across it), their gradients are the
// Pipeline's (NOTE [Expert gradients]), and the optimizer steps them whole
// beside the shards.
class FsdpShards {
 public:
  /// `params`: the rank's distinct parameters, whole (as built); `dp`: the
  /// group of copies. Keeps this copy's shard of each; the whole tensors
  /// stay until the first `scatter`.
  FsdpShards(std::shared_ptr<distributed::Comm> dp, std::vector<torch::Tensor> params);
  /// The tensors the optimizer steps: one shard per parameter (leaves).
  const std::vector<torch::Tensor>& shards() const { return shards_; }
  /// Every parameter whole again, from every copy's shards.
  void gather();
  /// The whole gradients averaged over the copies into the shards'
  /// gradients; the whole parameters and their gradients freed.
  void scatter();
  /// Bytes of this rank's shards (what it holds between steps).
  int64_t shard_bytes() const;

 private:
  std::shared_ptr<distributed::Comm> dp_;
  std::vector<torch::Tensor> params_;  // the model's, whole during a step
  std::vector<torch::Tensor> shards_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> numel_, shard_numel_, offset_;
  int64_t total_ = 0;  // elements of one copy's shards
  int world_ = 1, rank_ = 0;
};

}  // namespace hp::train
