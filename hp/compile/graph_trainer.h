// `GraphTrainer`: graph mode's training loop. Lazily captures the train step,
// runs the PassPipeline (FSDP shards the live model), replays the graph each
// step, accumulates gradients by FQN and steps a built-in Adam.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hp/compile/capture.h"
#include "hp/compile/graph.h"
#include "hp/compile/pass_config.h"
#include "hp/compile/passes.h"

namespace hp::compile {

/// The built-in optimizers: Adam (torch::optim::Adam's update; with
/// weight_decay, torch::optim::AdamW's decoupled decay) or plain SGD
/// (torch::optim::SGD without momentum), and gradient clipping.
struct OptimizerConfig {
  double lr = 1e-3;
  /// Clip the global gradient norm (over all ranks' shards) to this; 0: off.
  double grad_clip = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  /// Adam: decoupled (AdamW: p *= 1 - lr * weight_decay before the update);
  /// SGD: added to the gradient (g + weight_decay * p), as torch::optim::SGD.
  double weight_decay = 0.0;
  /// false: Adam/AdamW; true: SGD.
  bool sgd = false;
};

/// Trains `model` by replaying the captured graph of `train_fn`.
class GraphTrainer {
 public:
  /// `comm` is the FSDP / data-parallel group (null: one process).
  GraphTrainer(std::shared_ptr<torch::nn::Module> model, TrainFn train_fn, PassConfig config = {},
               std::optional<PassPlan> plan = std::nullopt, OptimizerConfig optimizer = {},
               std::shared_ptr<hp::distributed::Comm> comm = nullptr);

  /// Captures the train step on this batch's shapes and runs the passes
  /// (FSDP shards the live model here). Called by the first train_step.
  void compile(const at::Tensor& input, const at::Tensor& label);
  bool compiled() const { return compiled_; }
  /// The transformed graph (after compile()).
  const Graph& graph() const;
  /// The passes compile() ran, by name.
  std::vector<std::string> pass_names() const { return pass_names_; }
  /// FQNs whose live parameter is now this rank's shard.
  const std::vector<std::string>& sharded_parameters() const { return sharded_; }

  /// Replays the graph on one batch and adds the gradients into the live
  /// parameters' .grad (by FQN; a shared parameter once). Returns this rank's loss.
  double train_step(const at::Tensor& input, const at::Tensor& label);
  /// Clips (if configured), steps Adam (or SGD) on every parameter with a
  /// gradient, then clears the gradients.
  void optimizer_step();
  /// Clears every parameter's .grad.
  void zero_grad();
  /// Records a ReplayTrace of every following train_step (off by default).
  void record_trace(bool on) { record_trace_ = on; }
  /// The trace of the last train_step (empty unless record_trace(true)).
  const ReplayTrace& last_trace() const { return trace_; }
  /// For each batch (at most `max_steps`, < 0: all): train_step then
  /// optimizer_step; calls log_fn(step, loss) every `log_interval` steps.
  /// Returns the losses.
  std::vector<double> train(const std::vector<std::pair<at::Tensor, at::Tensor>>& data,
                            int64_t max_steps = -1, int64_t log_interval = 0,
                            const std::function<void(int64_t, double)>& log_fn = {});

 private:
  struct AdamState {
    int64_t step = 0;
    at::Tensor exp_avg, exp_avg_sq;
  };
  std::shared_ptr<torch::nn::Module> model_;
  TrainFn train_fn_;
  PassConfig config_;
  std::optional<PassPlan> plan_;
  OptimizerConfig optimizer_;
  std::shared_ptr<hp::distributed::Comm> comm_;
  bool compiled_ = false;
  bool record_trace_ = false;
  ReplayTrace trace_;
  Graph graph_;
  std::vector<std::string> pass_names_;
  std::vector<std::string> sharded_;
  std::unordered_map<const c10::TensorImpl*, AdamState> adam_;
};

}  // namespace hp::compile
