// PipelineStage: the virtual stages one rank holds, and what runs for a
// (stage, microbatch): F, I (dx through GradFunction), W (dw), B (both). It
// knows nothing of communication or schedules; the Executor drives it.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "hp/autograd/grad_function.h"
#include "hp/pipeline/message.h"

namespace hp::pipeline {

/// What a rank runs for one virtual stage: a forward and its weights.
struct StageModule {
  /// One tensor in, one out (one-leaf messages).
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> parameters;
  /// Or: a message in, a message out (NOTE [Messages between stages] in
  /// message.h); used instead of `forward` where set.
  std::function<Message(const Message&)> forward_message;
};

/// The loss of microbatch `mb` from the last stage's output. It counts
/// PipelineStage's `loss_scale` times (e.g. 1/m for the mean over the
/// microbatches); a function may instead scale the loss itself and leave
/// loss_scale at 1.
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, int mb)>;

/// Hooks around a (stage, microbatch)'s work, for features that span F to W
/// (e.g. recompute sessions). All optional.
struct StageHooks {
  /// Wraps the forward of (stage, mb): called with a function that runs it.
  std::function<Message(int stage, int mb, const std::function<Message()>&)> around_forward;
  /// Called before the executor waits for the output gradient of (stage, mb)
  /// (e.g. to prefetch a recompute while the gradient is in flight).
  std::function<void(int stage, int mb)> before_backward;
  /// Wraps a backward part (I, W or B) of (stage, mb).
  std::function<void(int stage, int mb, char part, const std::function<void()>&)> around_backward;
  /// Called when (stage, mb) has finished its W (or B).
  std::function<void(int stage, int mb)> on_done;
};

/// The stages of one rank and the per-microbatch state between F and W.
class PipelineStage {
 public:
  /// `loss_scale` weighs every microbatch's loss (NOTE [The loss scale is the
  /// backward's seed] in stage.cpp).
  PipelineStage(std::map<int, StageModule> modules, LossFn loss, StageHooks hooks = {},
                double loss_scale = 1.0);

  /// F: runs `stage` on `input`. `takes_grad` says which input leaves are
  /// received (or handed-off) activations whose gradients will be sent back
  /// (empty: none, the model's input). When `is_last` the output, one
  /// tensor, is turned into the microbatch's loss. Returns the output (or
  /// the loss).
  const Message& forward(int stage, int mb, const Message& input,
                         const std::vector<bool>& takes_grad, bool is_last);
  /// F computed by the caller (a pair function that runs the module itself,
  /// NOTE [A pair that computes itself] in stage.cpp): as forward(), with
  /// `compute(leaves)` in place of the module and the loss; it returns the
  /// output, or on a last stage the loss. The around_forward hook wraps it.
  const Message& forward_computed(int stage, int mb, const Message& input,
                                  const std::vector<bool>& takes_grad, bool is_last,
                                  const std::function<Message(const Message& leaves)>& compute);
  /// What the backward of (stage, mb) starts from, for a caller that runs
  /// it: the output leaves that take a gradient (the loss on a last stage)
  /// and their gradients (on a last stage, empty where loss_scale is 1).
  std::pair<Message, Message> backward_roots(int stage, int mb, const Message& grad_output);
  /// Ends a B the caller ran (the engine accumulating into the weights' and
  /// the input leaves' .grad): returns the input gradients as backward()
  /// does (zeros for a leaf the backward did not reach) and ends (stage, mb).
  Message backward_computed(int stage, int mb);
  /// Runs the before_backward hook of (stage, mb), if any.
  void prepare_backward(int stage, int mb) {
    if (hooks_.before_backward) hooks_.before_backward(stage, mb);
  }
  /// I: the input gradients of (stage, mb), one per input leaf that takes a
  /// gradient, given the gradients of its output leaves that take one (empty
  /// on the last stage, whose output is the loss).
  Message backward_input(int stage, int mb, const Message& grad_output);
  /// W: dw of (stage, mb), accumulated into the parameters' .grad().
  void backward_weight(int stage, int mb);
  /// W in parts (NOTE [dw in parts] in hp/autograd/grad_function.cpp): the
  /// next of about `parts` shares of its dw; true once the W is done (then
  /// as backward_weight). Whole where a hook wraps backwards, or parts <= 1.
  bool backward_weight_part(int stage, int mb, int parts);
  /// B: I and W in one fused backward. Returns the input gradients like
  /// backward_input.
  Message backward(int stage, int mb, const Message& grad_output);

  /// The output of F (for a send or a local hand-off).
  const Message& output(int stage, int mb) const;
  /// Whether F of (stage, mb) ran and its W has not ended yet.
  bool has_output(int stage, int mb) const;
  /// Which of the output's leaves take a gradient (require grad).
  std::vector<bool> output_takes_grad(int stage, int mb) const;
  /// Frees the storage of a sent output: only its autograd history is needed
  /// for the backward. Thread-safe against the other calls.
  void release_output(int stage, int mb);

  bool holds(int stage) const { return modules_.count(stage) > 0; }
  const StageModule& module(int stage) const { return modules_.at(stage); }
  /// Sum of the losses of the microbatches whose last stage is here, each
  /// times loss_scale, since reset, in float64. Losses on the CPU are summed
  /// on the host as they come; others where they were computed (on their
  /// device), so reading the sum is the one host synchronization they cost (a
  /// per-microbatch read would stop the host at every last-stage F).
  double loss_sum() const;
  /// Number of (stage, microbatch) still between F and the end of W.
  size_t in_flight() const;
  /// Starts a new step: checks nothing is in flight, zeroes the loss sum.
  void reset();

 private:
  struct Slot {
    Message input, output;
    std::vector<bool> input_grad;   // which input leaves take a gradient (travels back)
    std::vector<bool> output_grad;  // which output leaves take a gradient
    std::optional<autograd::GradFunction> grad_fn;
    bool input_done = false;
    bool is_last = false;  // the output is the loss
  };
  /// The gradients a backward of `s` starts from: `grad_output`, or for a
  /// loss, loss_scale (empty when 1: the engine's own ones).
  autograd::TensorList seed(const Slot& s, const Message& grad_output, int stage, int mb) const;
  Slot& slot(int stage, int mb, const char* what);
  /// The module of `stage`; throws naming (stage, mb) where this rank holds none.
  const StageModule& held(int stage, int mb) const;
  void finish(int stage, int mb);

  std::map<int, StageModule> modules_;
  LossFn loss_;
  StageHooks hooks_;
  double loss_scale_;
  std::map<std::pair<int, int>, Slot> slots_;
  mutable std::mutex mutex_;  // guards slots_ (release_output may run on another thread)
  double loss_sum_host_ = 0;  // the losses computed on the CPU
  torch::Tensor loss_sum_;    // the others: float64, on their device; undefined: none yet
};

}  // namespace hp::pipeline
