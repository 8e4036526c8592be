// `GraphTrainer`: graph mode's training loop. Lazily captures the train step,
// runs the PassPipeline (FSDP shards the live model), replays the graph each
// step, accumulates gradients by FQN and steps a LibTorch optimizer; `MeshContext`:
// the TP group and the FSDP group it runs on (seed 002 §5.1, §9).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hp/compile/capture.h"
#include "hp/compile/graph.h"
#include "hp/compile/pass_config.h"
#include "hp/compile/passes.h"

namespace hp::distributed {
class DeviceMesh;
}

namespace hp::compile {

/// The optimizer: a LibTorch one (`make`, any torch::optim::Optimizer), or
/// else one built from the fields below: torch::optim::AdamW (weight_decay
/// 0: Adam's update) or torch::optim::SGD; and gradient clipping, which the
/// trainer does itself over every shard (NOTE [Graph mode's optimizer]).
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
  /// Makes the optimizer over the live parameters (FSDP's shards among
  /// them); when set, the fields above other than grad_clip are not used.
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> make;
};

// NOTE [Graph mode on a mesh]
// A rank of a tp x dp mesh holds its TP shard of the model (made by the layer
// above; the TP collectives are operators inside its forward, NOTE [TP
// collectives as operators] in tp_ops.h) and sees its dp share of each batch.
// Graph mode adds the FSDP dimension only: FSDPPass shards the live TP shards
// over the rank's dp slice (the seed's group "fsdp": MeshContext::fsdp), never
// over the world, which would cut along the TP axis too. The trainer
//   * registers MeshContext::tp as the TP group `tp_group_name` (the name the
//     model's operators carry) for its lifetime, unless that name already
//     holds this Comm;
//   * fills PassConfig::fsdp_degree from the FSDP group (a given value must
//     match it) and PassConfig::tp_size from the TP group (a value other than
//     1 must match it); sequence_parallel and loss_parallel stay informational;
//   * counts the global gradient norm over both: FSDP shards summed over the
//     FSDP group, parameters split over TP (MeshContext::tp_sharded) summed
//     over the TP group, replicas once.
// Everything that can be wrong with the mesh is checked by the constructor,
// before any capture: dimensions other than TP and FSDP of size > 1 (graph
// mode has no pipeline), a missing dimension, config values that disagree,
// planned parameters whose dim 0 the FSDP degree does not divide.

/// The device mesh graph mode runs on: the group the model's TP operators
/// use and the group FSDP shards over. Default: one process, no TP.
struct MeshContext {
  /// This rank's TP group (null: no tensor parallelism).
  std::shared_ptr<hp::distributed::Comm> tp;
  /// This rank's FSDP / data-parallel group (null: one replica).
  std::shared_ptr<hp::distributed::Comm> fsdp;
  /// The name the model's hp::tp_copy / hp::tp_reduce calls carry; the
  /// trainer registers `tp` under it (hp/compile/tp_ops.h).
  std::string tp_group_name = "tp";
  /// FQNs of the parameters split over the TP group (the others are
  /// replicated on it): what the global gradient norm sums over `tp`.
  std::vector<std::string> tp_sharded;
  /// The mesh `tp` and `fsdp` come from (kept alive), when built from one.
  std::shared_ptr<hp::distributed::DeviceMesh> mesh;

  /// TP along `tp_dim` and FSDP along `fsdp_dim` of `mesh` ("" for either:
  /// none). Throws std::invalid_argument for a dimension the mesh lacks, the
  /// two naming the same dimension, or another dimension of size > 1.
  static MeshContext from_mesh(std::shared_ptr<hp::distributed::DeviceMesh> mesh,
                               const std::string& fsdp_dim = "dp", const std::string& tp_dim = "tp",
                               std::string tp_group_name = "tp");
  /// Sizes of the two groups (1 when absent).
  int64_t tp_size() const;
  int64_t fsdp_degree() const;
};

/// Trains `model` by replaying the captured graph of `train_fn`.
class GraphTrainer {
 public:
  /// `comm` is the FSDP / data-parallel group (null: one process).
  GraphTrainer(std::shared_ptr<torch::nn::Module> model, TrainFn train_fn, PassConfig config = {},
               std::optional<PassPlan> plan = std::nullopt, OptimizerConfig optimizer = {},
               std::shared_ptr<hp::distributed::Comm> comm = nullptr);
  /// On a mesh (NOTE [Graph mode on a mesh]): `model` is this rank's TP
  /// shard, FSDP shards over `mesh.fsdp`. Throws std::invalid_argument (bad
  /// mesh or config) before anything runs.
  GraphTrainer(std::shared_ptr<torch::nn::Module> model, TrainFn train_fn, PassConfig config,
               std::optional<PassPlan> plan, OptimizerConfig optimizer, MeshContext mesh);
  ~GraphTrainer();
  GraphTrainer(const GraphTrainer&) = delete;
  GraphTrainer& operator=(const GraphTrainer&) = delete;

  /// The PassConfig in use (fsdp_degree and tp_size filled from the mesh).
  const PassConfig& config() const { return config_; }
  /// The optimizer; null until the first optimizer_step that had gradients.
  torch::optim::Optimizer* optimizer() const { return optim_.get(); }
  /// The mesh context (the FSDP group is also the one given as `comm`).
  const MeshContext& mesh() const { return mesh_; }

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
  /// Clips (if configured), steps the optimizer (made at the first call,
  /// over the live parameters), then clears the gradients.
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
  std::shared_ptr<torch::nn::Module> model_;
  TrainFn train_fn_;
  PassConfig config_;
  std::optional<PassPlan> plan_;
  OptimizerConfig optimizer_;
  MeshContext mesh_;
  std::shared_ptr<hp::distributed::Comm> comm_;  // the FSDP group (mesh_.fsdp)
  bool registered_tp_ = false;
  bool compiled_ = false;
  bool record_trace_ = false;
  ReplayTrace trace_;
  Graph graph_;
  std::vector<std::string> pass_names_;
  std::vector<std::string> sharded_;
  std::unique_ptr<torch::optim::Optimizer> optim_;
};

}  // namespace hp::compile
