// Pipeline: one rank's whole pipeline, built once from a schedule, the
// pipeline's group, the rank's model chunks and a loss. It owns what every
// caller used to assemble itself (point-to-point choice, device staging, the
// stages, the executor, the data-parallel reducer, replica sums, the loss's
// reduction); `hp train` and the Python package's Runtime call it.
#pragma once

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/data_parallel.h"
#include "hp/pipeline/executor.h"
#include "hp/pipeline/stage.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::pipeline {

/// One model chunk as a rank holds it: its forward, its parameters and, for
/// each parameter, a name the same on every rank that holds the same tensor
/// (a DualPipe mirror, a tied head). Unnamed parameters are named by chunk
/// and position, so a chunk held by several ranks is a replica of itself.
struct ChunkModule {
  /// One tensor in, one out; or, where `forward_message` is set, a message
  /// (NOTE [Messages between stages] in message.h).
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<Message(const Message&)> forward_message;
  std::vector<torch::Tensor> parameters;
  std::vector<std::string> names;  ///< empty, or one per parameter
  /// The parameters data parallelism averages (NOTE [Gradient reduction in
  /// the cool-down]); unset: all of them. Parameters another owner reduces
  /// (FSDP2's) are left out here.
  std::optional<std::vector<torch::Tensor>> dp_parameters;
  /// Parameters sharded over the data-parallel group by expert parallelism
  /// (each rank holds other experts): never averaged over `dp`, their
  /// gradients divided by its size instead (NOTE [Expert gradients]).
  std::vector<torch::Tensor> expert_parameters;
};

/// Everything a Pipeline can be told besides its parts. Each option has one
/// spelling in C++, Python (`hyperparallel.pipeline.Pipeline`) and the CLI.
struct PipelineOptions {
  /// Where the stages compute; receive buffers are made there.
  torch::Device device = torch::kCPU;
  /// dtype of one-tensor activations and gradients (where `layout` is unset)
  torch::Dtype dtype = torch::kFloat32;
  /// Point-to-point between the pipeline's ranks (NOTE [Choosing the
  /// point-to-point] in hp/distributed/shm_p2p.cpp): "group", "shm", "auto".
  std::string p2p = "auto";
  /// Where the ranks of the pipeline's group tell each other of a failed
  /// step (distributed::with_failure_store; NOTE [A failed step reaches the
  /// peers] in hp/distributed/comm.h): a store every rank of the group
  /// shares, with keys of this Pipeline alone (a PrefixStore). Null: a peer
  /// of a failed rank that lives on learns of it over the shared-memory
  /// rings only, and waits its timeout over the group's point-to-point.
  c10::intrusive_ptr<c10d::Store> failure_store;
  /// The data-parallel group across copies of this pipeline; null: none.
  std::shared_ptr<distributed::Comm> dp;
  /// Where the expert-parallel group is smaller than `dp`: the copies that
  /// hold the same experts (one per EP group). Each expert's gradient is
  /// summed over them before the division by `dp`'s size (NOTE [Expert
  /// gradients] in pipeline.cpp); null: the EP group is `dp`.
  std::shared_ptr<distributed::Comm> expert_dp;
  /// Further groups the step's loss (and extra sum) is averaged over, after
  /// `dp`: groups whose ranks computed other microbatches while another owner
  /// reduces their gradients (FSDP2's, NOTE [FSDP2 stages] in
  /// python/hyperparallel/pipeline/fsdp2.py).
  std::vector<std::shared_ptr<distributed::Comm>> loss_groups;
  /// Hooks around each (stage, microbatch)'s work, the caller's own.
  StageHooks hooks;
  /// Hooks around the whole step, for an owner of some weights (FSDP2's
  /// controls: NOTE [FSDP2 stages] in python/hyperparallel/pipeline/fsdp2.py):
  /// `before_step` before the first action; `after_step(true)` once the
  /// actions are done and the gradients are whole (averaged over `dp`,
  /// experts scaled, replicas summed), before the loss's reduction (FSDP2
  /// reduce-scatters there); `after_step(false)` when the
  /// step failed after `before_step` returned (what it throws then is
  /// dropped: the step's own error is the one raised).
  std::function<void()> before_step;
  std::function<void(bool ok)> after_step;
  /// Recompute sessions from I to W of each (stage, microbatch) (NOTE
  /// [Recompute in the pipeline] in pipeline.cpp); `prefetch_recompute` also
  /// recomputes a stage's last block while its output gradient is in flight.
  bool recompute_sessions = false;
  bool prefetch_recompute = false;
  int receive_lookahead = 0;                     ///< ExecutorOptions::receive_lookahead
  bool cache_cpu_memory = false;                 ///< ExecutorOptions::cache_cpu_memory
  bool fb_overlap = false;                       ///< ExecutorOptions::fb_overlap
  bool defer_wgrad = false;                      ///< ExecutorOptions::defer_wgrad (with fb_overlap)
  bool pair_first_ready = false;                 ///< ExecutorOptions::pair_first_ready
  int deferred_w_parts = 1;                      ///< ExecutorOptions::deferred_w_parts
  std::function<void(PairCall&)> pair_function;  ///< ExecutorOptions::pair_function
  /// The cost every pipeline transfer pays (distributed::with_link_model;
  /// CPU only). Where active, transfers take the group's own point-to-point
  /// ("auto" does not choose the rings, "shm" is refused): the rings would
  /// bypass it.
  distributed::LinkModel link;
  /// The input of microbatch `mb` of the running step (first stages only):
  /// one tensor, or where `input_message` is set, a message.
  std::function<torch::Tensor(int mb)> input;
  std::function<Message(int mb)> input_message;
  /// What stage `stage` outputs for microbatch `mb` (ExecutorOptions::layout);
  /// unset: one tensor of `activation_shape` and `dtype`; neither: messages
  /// describe themselves (NOTE [Messages that describe themselves] in frames.h).
  std::function<Layout(int stage, int mb)> layout;
  std::function<std::vector<int64_t>(int stage, int mb)> activation_shape;
  int64_t first_frame_bytes = 64 << 10;  ///< ExecutorOptions::first_frame_bytes
  /// This rank's share of a per-step sum reported beside the loss (e.g.
  /// auxiliary losses), read after the executor ran; summed over the group
  /// (and averaged over `dp`) with the loss, in the same collective.
  std::function<double()> extra_sum;
};

/// What one step of the whole pipeline did, as this rank sees it.
struct PipelineStep {
  double loss = 0.0;        ///< the step's loss: the mean over microbatches (and copies)
  double extra = 0.0;       ///< PipelineOptions::extra_sum over the ranks (and copies)
  StepStats stats;          ///< this rank's timings and executed actions
  double dp_exposed = 0.0;  ///< seconds the data-parallel reduction was not hidden
};

/// How Pipeline::choose_deferred_w decides (NOTE [The deferred W's chosen
/// in the run] in pipeline.cpp).
struct DeferredWAuto {
  /// The share by which deferred W's must shorten the predicted step.
  double gain = schedule::kDeferredWGain;
  /// The pairs' turns as `hp train --pair-turns` spells them ("fixed" from
  /// Python; "auto" takes them ready without deferred W's, fixed with).
  std::string pair_turns = "fixed";
  /// One pipeline transfer's seconds; below 0: measured by the call, between
  /// ranks 0 and 1 with a message of the step's largest.
  double comm_cost = -1.0;
  /// Called on rank 0 with the costs fitted to the step before they are
  /// simulated (hp train adds the stages' measured bytes).
  std::function<void(schedule::CostModel&)> adjust;
  /// Whether this rank's W's may recompute (a recomputing W would exchange
  /// wherever ready turns run it, so ready turns with one never defer);
  /// any rank's yes counts for the group. Unset:
  /// PipelineOptions::recompute_sessions.
  std::optional<bool> recomputes;
};

/// `p2p`'s spelling as the Comm layer's choice; std::invalid_argument for
/// anything but "group", "shm" and "auto".
distributed::PointToPoint parse_point_to_point(const std::string& p2p);

/// One rank's pipeline (see the file comment).
class Pipeline {
 public:
  /// `schedule` may be unlowered (it is lowered here) and is validated;
  /// `group` joins the pipeline's ranks (rank r of the schedule is rank r of
  /// the group); `chunks` holds one module for every chunk this rank's stages
  /// compute and no other. Construction is collective over `group`: the ranks
  /// agree on the pipeline (NOTE [Ranks agree on the pipeline]) and learn who
  /// holds each named parameter. Errors a caller can cause throw
  /// std::invalid_argument naming the rank and chunk.
  Pipeline(schedule::Schedule schedule, std::shared_ptr<distributed::Comm> group,
           std::map<int, ChunkModule> chunks, LossFn loss, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// One step: every action of this rank once, then the data-parallel
  /// average, replica sums and the loss over the group. Weight gradients
  /// accumulate into the parameters' .grad. After a step that threw, every
  /// later step throws (the microbatches are half done): make a new Pipeline.
  PipelineStep step();

  /// Replaces PipelineOptions::pair_function (between steps; unset: the
  /// built-in order). NOTE [A pair function] in overlap.cpp.
  void set_pair_function(std::function<void(PairCall&)> fn);

  /// Replaces PipelineOptions::defer_wgrad and pair_first_ready (between
  /// steps, alike on every rank: the peers of an expert-parallel group post
  /// their exchanges and reductions where the W's run). Throws
  /// std::invalid_argument where the options' checks would (defer_wgrad
  /// without fb_overlap; deferred_w_parts > 1 without both).
  void set_deferred_w(bool defer_wgrad, bool pair_first_ready);

  /// NOTE [The deferred W's chosen in the run] in pipeline.cpp: whether the
  /// pairs' W's defer from the next step, decided from `last` (this rank's
  /// stats of the step just run) by simulating the schedule with and without
  /// them under the costs fitted to it, and applied (set_deferred_w).
  /// Collective over the group and PipelineOptions::dp: every rank of every
  /// copy calls it after the same step and gets the answer of `dp`'s rank 0
  /// (copy 0 in hp train's mesh). Throws std::invalid_argument for a gain
  /// outside -1..1, before any communication. Without FB
  /// pairs or fb_overlap, or with defer_wgrad already on, nothing is
  /// simulated and the answer is "off" (step_with 0).
  schedule::DeferredWChoice choose_deferred_w(const StepStats& last, const DeferredWAuto& how = {});

  int rank() const { return rank_; }
  const schedule::Schedule& schedule() const { return sched_; }
  /// The pipeline's group as the executor uses it (point-to-point chosen).
  distributed::Comm& comm() { return *comm_; }
  std::shared_ptr<distributed::Comm> comm_ptr() const { return comm_; }
  /// The point-to-point's backend: "gloo+shm" over the rings, else the group's.
  std::string backend() const { return comm_->backend_name(); }
  /// Why p2p "auto" left the rings out; empty when it did not.
  const std::string& p2p_note() const { return p2p_note_; }
  /// Every named parameter of the whole pipeline and the ranks holding it.
  const std::map<std::string, std::set<int>>& holders() const { return holders_; }
  /// This rank's stages (their modules and per-microbatch state).
  PipelineStage& stages() { return *stage_; }
  /// True after a step that threw.
  bool broken() const { return !broken_reason_.empty(); }

 private:
  /// Throws std::invalid_argument where ready turns would post on a
  /// data-parallel group without lanes (made with fixed turns).
  void check_ready_turns(bool pair_first_ready) const;
  void learn_holders(const std::map<std::string, std::vector<torch::Tensor>>& local,
                     const std::vector<std::vector<int64_t>>& counts, distributed::Comm& group,
                     const torch::Device& on, std::exception_ptr failed);
  void sum_replica_gradients();
  void clear_recompute_sessions();
  void scale_expert_gradients();

  schedule::Schedule sched_;
  PipelineOptions options_;
  uint32_t number_ = 0;  ///< this Pipeline's number in the process (its recompute sessions')
  std::shared_ptr<distributed::Comm> comm_;
  int rank_ = 0;
  std::string p2p_note_;
  std::map<std::string, std::set<int>> holders_;
  /// Replicas: each named parameter held more than once (on this rank or
  /// elsewhere), its local tensors and its holders, in name order.
  struct Replica {
    std::vector<torch::Tensor> local;
    std::vector<int> ranks;
  };
  std::vector<Replica> replicas_;
  std::vector<torch::Tensor> experts_;  ///< every chunk's expert_parameters, once each
  std::unique_ptr<PipelineStage> stage_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<Executor> executor_;
  std::string broken_reason_;
};

}  // namespace hp::pipeline
