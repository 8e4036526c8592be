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
//
// NOTE [Reductions in a fixed order]
// The reductions are point-to-point exchanges without tags, so every rank
// of the group must post them in one order, on one lane. Which action ends
// a stage, and so which thread posts its reduction and when, may depend on
// timing: with overlapped pairs taking turns as messages arrive and
// deferred W's, a stage's last microbatch may end in a W run in some wait
// on one rank and in a B of the schedule on its peer, and two stages of a
// rank may end in either order. Ready turns with --defer-wgrad hung so
// (both ranks waiting on a reduction). So the stages' reductions are
// posted in an order fixed by the schedule (`order`: the rank's stages by
// their last backward in its action list), each once it and every stage
// before it are done, and always on the deferred W's lane
// (distributed::kDeferredLane; a group without lanes has one).

/// Averages gradients over `dp` as the stages finish (see the NOTE).
class GradientReducer {
 public:
  /// `stage_parameters[s]`: the tensors whose .grad stage s accumulates;
  /// `stage_microbatches[s]`: how many microbatches stage s runs per step
  /// (all of them, except where a schedule splits them between mirrored
  /// copies of a stage, as DualPipe does; `microbatches_per_stage`);
  /// `order`: the stages in the order their reductions are posted (NOTE
  /// [Reductions in a fixed order]; `stages_by_last_backward`), by default
  /// ascending.
  GradientReducer(std::shared_ptr<distributed::Comm> dp,
                  const std::map<int, std::vector<torch::Tensor>>& stage_parameters,
                  std::map<int, int> stage_microbatches, std::vector<int> order = {});
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
  void post_ready();  // the done stages at the head of order_, in order

  std::shared_ptr<distributed::Comm> dp_;
  std::map<int, int> microbatches_;                   // stage -> microbatches per step
  std::vector<torch::Tensor> tensors_;                // unique parameters
  std::map<int, std::vector<size_t>> stage_tensors_;  // stage -> indices into tensors_
  std::vector<int> holders_;                          // per tensor: stages holding it
  std::vector<int> remaining_;                        // per tensor, this step
  std::map<int, int> done_;                           // stage -> microbatches done
  std::vector<int> order_;                            // NOTE [Reductions in a fixed order]
  size_t posted_ = 0;                                 // stages of order_ posted this step
  std::vector<distributed::Work> pending_;
  double exposed_ = 0;
};

/// How many microbatches each of `rank`'s stages runs per step: its F actions
/// in the rank's list.
std::map<int, int> microbatches_per_stage(const schedule::Schedule& schedule, int rank);

/// `rank`'s stages in the order of their last backward (B, W, or an FB's
/// backward half) in its action list (NOTE [Reductions in a fixed order]).
std::vector<int> stages_by_last_backward(const schedule::Schedule& schedule, int rank);

}  // namespace hp::pipeline
