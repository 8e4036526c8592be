// Data parallelism across pipelines: the weight gradients of a rank's stages
// averaged over its data-parallel group, each stage's started as soon as its
// last microbatch's W (or B) has run, so the reduction overlaps the rest of
// the pipeline's cool-down.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/schedule/schedule.h"

namespace hp::pipeline {

// NOTE [Gradient reduction in the cool-down]
// Once stage s has run the W (or B) of every microbatch of the step, its
// parameters' gradients are final; the last W's of a schedule come in its
// cool-down, while other stages (on this rank or its neighbours) still work.
// So each stage's all-reduce over the data-parallel group starts from the
// stage's on_done hook, and the step waits for all of them only at its end.
// A tensor held by several of the rank's stages (a chunk computed twice) is
// reduced once, when the last of them is done. The average is the same on
// every replica: every rank sums the same parts in rank order.

/// Averages gradients over `dp` as the stages finish (see the NOTE).
class GradientReducer {
 public:
  /// `stage_parameters[s]`: the tensors whose .grad stage s accumulates;
  /// `stage_microbatches[s]`: how many microbatches stage s runs per step
  /// (all of them, except where a schedule splits them between mirrored
  /// copies of a stage, as DualPipe does; `microbatches_per_stage`).
  GradientReducer(std::shared_ptr<distributed::Comm> dp,
                  const std::map<int, std::vector<torch::Tensor>>& stage_parameters,
                  std::map<int, int> stage_microbatches);
  /// Starts a step (checks the previous one finished).
  void begin_step();
  /// The StageHooks::on_done of (stage, mb): counts, and starts the stage's
  /// reduction when it has run all its microbatches.
  void on_done(int stage, int mb);
  /// Waits for every reduction of the step; each gradient is then the
  /// average over the group. Throws if a stage did not run all microbatches.
  void finish_step();
  /// Seconds of the last step spent waiting in finish_step (the part of the
  /// reduction the pipeline did not hide).
  double exposed_seconds() const { return exposed_; }

 private:
  void start(size_t tensor);

  std::shared_ptr<distributed::Comm> dp_;
  std::map<int, int> microbatches_;                   // stage -> microbatches per step
  std::vector<torch::Tensor> tensors_;                // unique parameters
  std::map<int, std::vector<size_t>> stage_tensors_;  // stage -> indices into tensors_
  std::vector<int> holders_;                          // per tensor: stages holding it
  std::vector<int> remaining_;                        // per tensor, this step
  std::map<int, int> done_;                           // stage -> microbatches done
  std::vector<distributed::Work> pending_;
  double exposed_ = 0;
};

/// How many microbatches each of `rank`'s stages runs per step: its F actions
/// in the rank's list.
std::map<int, int> microbatches_per_stage(const schedule::Schedule& schedule, int rank);

}  // namespace hp::pipeline
