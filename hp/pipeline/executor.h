// Executor: walks one rank's lowered action list of any schedule (it never
// sees a schedule's name), moving activations and gradients over a Comm or
// by local hand-off, and times every action.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/stage.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::pipeline {

/// What the executor needs to know about the data flowing between stages.
struct ExecutorOptions {
  /// The model input of microbatch `mb` (read by the first stage of its route).
  std::function<torch::Tensor(int mb)> input;
  /// Shape of the activation stage `stage` outputs for microbatch `mb` (the
  /// receive buffer of the next stage; also the shape of its output gradient).
  std::function<std::vector<int64_t>(int stage, int mb)> activation_shape;
  /// dtype of activations and gradients.
  torch::Dtype dtype = torch::kFloat32;
  /// Where receive buffers are allocated (the stages' device).
  torch::Device device = torch::kCPU;
  /// Free a sent output's storage as soon as its send completes.
  bool release_sent_outputs = true;
};

/// What one step did on this rank.
struct StepStats {
  double loss_sum = 0.0;   ///< losses of the microbatches that ended on this rank
  double wall = 0.0;       ///< seconds from the first to the last action
  double compute = 0.0;    ///< seconds in F, I, W, B, FB
  double comm_wait = 0.0;  ///< seconds in communication: posting sends and receives (on
                           ///< loopback the kernel copies a send in the posting call)
                           ///< and waiting for them
  double overhead = 0.0;   ///< wall - compute - comm_wait: the executor's own time
  /// Seconds from the step start: each compute action (its compute only), each
  /// send's posting, each receive's wait (NOTE [Compute events exclude waits]).
  std::vector<schedule::Event> events;
  std::vector<schedule::Action> executed;  ///< compute actions in the order they ran
};

// NOTE [Executor protocol]
// * SEND/RECV actions are posted exactly in list order, with no tags
//   (NOTE [Point-to-point without tags]): each run of consecutive SEND/RECV
//   actions between two compute actions is one batch (`Comm::batch`; one
//   coalesced group on NCCL). Lowering places every RECV where it should be
//   posted - early enough that its data arrives while the rank computes, in
//   one order the two ranks of every message agree on (NOTE [Lowering and
//   message order]) - so the executor never reorders.
// * A RECV's buffer is waited for by its consumer (F for RECV_F, I/B for
//   RECV_B); the wait is the receive's timed event.
// * A SEND's data is the output (F) or input gradient (I/B) it names; a
//   helper thread waits for sends in order and frees each sent output (NOTE
//   [Releasing a sent output]); the step ends only when every send completed.
// * Consecutive route stages on one rank hand off locally: the output (or
//   dx) is passed as a tensor, never sent.
// * A CommError (a lost peer, a timeout) reaches the caller as a CommError,
//   its message prefixed with the rank and action.

/// Runs one rank's lowered action list, one step per call.
class Executor {
 public:
  /// `schedule` must be lowered; `comm` connects the pipeline's ranks (rank r
  /// of the schedule is rank r of the Comm).
  Executor(const schedule::Schedule& schedule, int rank, PipelineStage& stage,
           std::shared_ptr<distributed::Comm> comm, ExecutorOptions options);
  ~Executor();

  /// Runs every action of this rank once. Throws (naming stage, microbatch
  /// and action) on any failure, including a lost peer.
  StepStats run_step();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace hp::pipeline
