// Executor: walks one rank's lowered action list of any schedule (it never
// sees a schedule's name), moving activations and gradients over a Comm or
// by local hand-off, and times every action on the host or on the device
// (StepTimer).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/message.h"
#include "hp/pipeline/overlap.h"
#include "hp/pipeline/stage.h"
#include "hp/pipeline/step_timer.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/timeline.h"

namespace hp::pipeline {

/// What the executor needs to know about the data flowing between stages.
struct ExecutorOptions {
  /// The model input of microbatch `mb` (read by the first stage of its
  /// route): one tensor, or with `input_message` set, a message.
  std::function<torch::Tensor(int mb)> input;
  std::function<Message(int mb)> input_message;
  /// What stage `stage` outputs for microbatch `mb` (the next stage's receive
  /// buffers; its leaves that take a gradient shape the gradients that come
  /// back): NOTE [Messages between stages] in message.h. Unset: one tensor of
  /// `activation_shape` and `dtype` that takes a gradient.
  std::function<Layout(int stage, int mb)> layout;
  /// Shape of the one-tensor activation stage `stage` outputs for microbatch
  /// `mb` (where `layout` is unset). Neither set: messages describe
  /// themselves (NOTE [Messages that describe themselves] in frames.h).
  std::function<std::vector<int64_t>(int stage, int mb)> activation_shape;
  /// Messages that describe themselves: each channel's frame size before it
  /// saw a message (it then grows to the largest message seen).
  int64_t first_frame_bytes = 64 << 10;
  /// dtype of one-tensor activations and gradients (where `layout` is unset).
  torch::Dtype dtype = torch::kFloat32;
  /// The stages' device: receive buffers are allocated there, and the step
  /// runs with it as the current device.
  torch::Device device = torch::kCPU;
  /// Free a sent output's storage as soon as its send completes.
  bool release_sent_outputs = true;
  /// Makes the step's timer; unset: the host clock on the CPU, the device's
  /// events elsewhere (NOTE [Timing on the device]).
  std::function<std::unique_ptr<StepTimer>()> make_timer;
  /// With each batch, also post the RECVs of the next `receive_lookahead`
  /// batches (NOTE [Receives posted ahead] in executor.cpp; measured slower
  /// on the benchmark host, so 0 by default). More than 0 is refused on a
  /// Comm that does not say early receives are free (NCCL).
  int receive_lookahead = 0;
  /// On the CPU, CPU tensors allocated during a step take their memory from
  /// the step cache, a pool of blocks freed by earlier such tensors (NOTE [The
  /// step cache] in hp/core/memory.cpp). Installs the tracking allocator.
  bool cache_cpu_memory = false;
  /// Runs each FB action's forward and backward as partners that compute
  /// while the other waits on communication (NOTE [Overlapped pairs] in
  /// overlap.cpp); off: the forward, then the backward.
  bool fb_overlap = false;
  /// With fb_overlap: each pair's backward runs I alone and queues its W,
  /// which runs in a wait of a later half that nothing else fills, or at the
  /// step's end (NOTE [Weight gradients in the waits] in overlap.cpp).
  bool defer_wgrad = false;
  /// With fb_overlap: a half whose wait ended takes the CPU as soon as it is
  /// free, not in the code's order (NOTE [Turns as messages arrive] in
  /// overlap.cpp). Only where every group the halves and the deferred W's
  /// post on is in lanes (distributed::with_lanes): else ranks would post
  /// in different orders.
  bool pair_first_ready = false;
  /// With defer_wgrad and pair_first_ready, > 1: each deferred W runs in
  /// this many parts, which fill a wait until its message or the partner's
  /// is there (NOTE [Weight gradients until the message is there] in
  /// overlap.cpp); 1: one whole W per wait.
  int deferred_w_parts = 1;
  /// Runs each FB pair in place of the built-in order (torch's
  /// register_custom_function(OVERLAP_F_B, fn)); unset: fb_overlap decides.
  std::function<void(PairCall&)> pair_function;
};

/// What one step did on this rank.
struct StepStats {
  double loss_sum = 0.0;   ///< losses of the microbatches that ended on this rank
  double wall = 0.0;       ///< seconds from the first to the last action
  double compute = 0.0;    ///< seconds in F, I, W, B, FB
  double comm_wait = 0.0;  ///< seconds in communication: posting sends and receives (on
                           ///< loopback the kernel copies a send in the posting call)
                           ///< and waiting for them
  /// Seconds computing actions waited inside their chunks (an expert
  /// layer's all-to-alls: NOTE [A chunk's own waits] in step_timer.h) with
  /// nothing else to compute: outside pairs their waits, in an overlapped
  /// pair the time neither half computed (PairStats::chunk_idle).
  double chunk_wait = 0.0;
  double overhead = 0.0;  ///< wall - compute - comm_wait - chunk_wait: the executor's own time
  /// Points where this rank's executor thread waited for the device or for a
  /// peer: waits on host-blocking receives, the end-of-step wait for
  /// host-blocking sends, the timer's read-out and the loss read from a
  /// device. With stream-ordered communication (NCCL on CUDA) this does not
  /// grow with the number of actions (NOTE [No host synchronization per action]).
  int host_syncs = 0;
  /// Seconds from the step start: each compute action (its compute only), each
  /// send's posting, each receive's wait (NOTE [Compute events exclude waits] in step_timer.cpp).
  std::vector<schedule::Event> events;
  std::vector<schedule::Action> executed;  ///< compute actions in the order they ran
  /// Overlapped FB pairs (ExecutorOptions::fb_overlap): how many ran, and
  /// the seconds of their waits on communication that the partner's compute
  /// hid, and that it did not (PairStats).
  int pairs = 0;
  double pair_hidden = 0.0;
  double pair_exposed = 0.0;
  double pair_exposed_alone = 0.0;  ///< of pair_exposed, after the partner ended
  int pair_reordered = 0;           ///< PairStats::reordered (ready turns), summed
  /// defer_wgrad: the W's that ran in a pair's waits, and those left for
  /// the step's end.
  int deferred_w_in_waits = 0;
  int deferred_w_at_end = 0;
  /// Bytes of the largest message this rank sent (a sizing for a probe of
  /// the link: Pipeline::choose_deferred_w).
  int64_t largest_message_bytes = 0;
};

// NOTE [Executor protocol]
// * SEND/RECV actions are posted exactly in list order, with no tags
//   (NOTE [Point-to-point without tags]): each run of consecutive SEND/RECV
//   actions between two compute actions is one batch (`Comm::batch`; one
//   coalesced group on NCCL). Lowering places every RECV where it should be
//   posted - early enough that its data arrives while the rank computes, in
//   one order the two ranks of every message agree on (NOTE [Lowering and
//   message order]) - so the executor never reorders. Asked to
//   (ExecutorOptions::receive_lookahead) where the Comm allows it (Gloo), it
//   posts receives batches ahead, each channel's still in list order (NOTE
//   [Receives posted ahead] in executor.cpp).
// * A RECV's buffer is waited for by its consumer (F for RECV_F, I/B for
//   RECV_B); the wait is the receive's timed event.
// * A transfer is a Message (NOTE [Messages between stages] in message.h):
//   one send or receive per tensor, all posted in the action's batch.
// * A SEND's data is the output (F) or input gradient (I/B) it names; a
//   helper thread waits for sends in order and frees each sent output (NOTE
//   [Releasing a sent output]), except a send complete when posted, finished
//   at once (NOTE [Sends complete when posted]); the step ends only when
//   every send completed.
// * Consecutive route stages on one rank hand off locally: the output (or
//   dx) is passed as a tensor, never sent.
// * A CommError (a lost peer, a timeout) reaches the caller as a CommError,
//   its message prefixed with the rank and action.
//
// NOTE [No host synchronization per action]
// On a device the executor's thread only enqueues work; it stops for the
// device (or a peer) only where something forces it, and StepStats::host_syncs
// counts each such point. In the steady state nothing per action does:
// * a receive's wait is stream-ordered on NCCL (the compute stream waits for
//   the data, the host goes on; NOTE [Stream-ordered waits]);
// * sends are completed by the helper thread, which waits for NCCL's work on
//   a side stream of its own (so the compute stream never waits for a send),
//   marks each sent tensor as used on that stream (record_stream: the caching
//   allocator reuses its memory only after the send) and only then frees it;
// * the losses are summed on the device and read once per step;
// * the timer's events are read once per step.
// So a step costs two host synchronizations (the timer, the loss) whatever
// its length. Over a host-blocking transport (Gloo, host staging) every
// receive's wait is one more, and the end-of-step wait for the sends another.

/// Runs one rank's lowered action list, one step per call.
class Executor {
 public:
  /// `schedule` must be lowered; `comm` connects the pipeline's ranks (rank r
  /// of the schedule is rank r of the Comm). Not collective: the ranks agree
  /// on the pipeline before they make their executors (hp/pipeline/agreement.h,
  /// which a Pipeline calls).
  Executor(const schedule::Schedule& schedule, int rank, PipelineStage& stage,
           std::shared_ptr<distributed::Comm> comm, ExecutorOptions options);
  ~Executor();

  /// Runs every action of this rank once. Throws (naming stage, microbatch
  /// and action) on any failure, including a lost peer.
  StepStats run_step();

  /// Replaces ExecutorOptions::pair_function (between steps).
  void set_pair_function(std::function<void(PairCall&)> fn);

  /// Replaces ExecutorOptions::defer_wgrad and pair_first_ready (between
  /// steps; the pair runner is made again at the next pair).
  void set_deferred_w(bool defer_wgrad, bool pair_first_ready);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace hp::pipeline
