// Costs from the real device: one stage's F, I, W (and a fused B), the
// transfer of one activation and the activation memory, measured where the
// stage runs; and each schedule's step predicted from them at a target p and
// m by hp/schedule's simulator, beside the Zero Bubble paper's Table 5.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hp/models/models.h"
#include "hp/pipeline/stage.h"
#include "hp/schedule/paper.h"
#include "hp/schedule/simulate.h"

namespace hp::train {

/// One stage's measured costs per microbatch: seconds (medians over the
/// repeats) and bytes.
struct StageCosts {
  double f = 0;  ///< forward, including building its GradFunction (as the pipeline's F does)
  double i = 0;  ///< input gradient (dx, GradFunction::compute_input_grad)
  double w = 0;  ///< weight gradient (dw, GradFunction::compute_weight_grad)
  double b = 0;  ///< one fused backward of the same stage (dx and dw in one engine call)
  /// Activation bytes one microbatch holds from its F until its I (its sent
  /// output excluded: the pipeline frees it after the send); -1: not measured.
  int64_t mem_b = -1;
  /// Bytes it still holds from its I until its W (dx excluded: it is sent); -1: not measured.
  int64_t mem_w = -1;
};

/// One stage to measure: what it computes, on what, and what roots its backward.
struct StageSample {
  pipeline::StageModule module;
  torch::Tensor input;           ///< on the device to measure on
  bool input_needs_grad = true;  ///< false for a first stage (its input is data)
  /// The last stage's loss (output -> one-element tensor). Unset: the
  /// backward is rooted at the output, with gradient `grad_output`.
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  torch::Tensor grad_output;
};

/// How `measure_stage` runs.
struct MeasureOptions {
  int warmup = 2;   ///< untimed runs first
  int repeats = 5;  ///< timed runs; each cost is their median
  /// Bytes allocated on the sample's device now (for mem_b and mem_w). Unset:
  /// the CPU tracking allocator (hp/core/memory.h) when the sample is on the
  /// CPU and the tracker is installed; not measured otherwise.
  std::function<int64_t()> memory_allocated;
  bool measure_memory = true;  ///< false: mem_b and mem_w stay -1
};

/// Times F, I, W and a fused B of `sample` on its input's device, with the
/// step timer of that device (events on the current stream on a GPU; NOTE
/// [Timing on the device]), and measures the activation memory F leaves to I
/// and I leaves to W. Weight gradients accumulate into the parameters' .grad
/// (cleared before each run and after the last). Python's
/// hyperparallel.profile.measure_stage calls it.
StageCosts measure_stage(const StageSample& sample, const MeasureOptions& options = {});

/// What the simulator predicts for one schedule.
struct SchedulePrediction {
  std::string schedule;
  bool ok = false;
  std::string error;  ///< why it was not built (its constraints on p and m)
  int num_stages = 0;
  double step_seconds = 0;  ///< the simulated step (makespan), in the costs' unit
  double bubble_rate = 0;   ///< NOTE [Bubble rate] in hp/schedule/simulate.h
  double peak_memory = 0;   ///< the largest rank's peak activation memory, in mem_b's unit
};

/// Every schedule `profile_model` predicts by default: all generators but the
/// naive one and aliases.
std::vector<std::string> default_prediction_schedules();

/// Simulates each of `names` at `p` ranks and `m` microbatches under
/// `costs`: the scalar f, b, w, mem_b, mem_w and comm describe one rank's
/// share of the model (a middle chunk of p; NOTE [Cost units]); per-stage
/// vectors, when set, hold p entries (stages measured for a cut into p
/// chunks) and are carried over to schedules that cut the model into more
/// stages (NOTE [Per-stage costs of other cuts] in profile.cpp). zb-auto and
/// zbv-auto search under these costs (default memory limits). A schedule that
/// cannot be built at this p and m gets ok = false and the reason.
std::vector<SchedulePrediction> predict_schedules(const schedule::CostModel& costs, int p, int m,
                                                  const std::vector<std::string>& names);

/// The rows of the Zero Bubble paper's Table 5 at `p` and `m` (none when the
/// paper has no such row).
std::vector<schedule::PaperRow> paper_rows(int p, int m);

/// The cost model of a pipeline of `p` stages from stages measured on one
/// device: `first` for stage 0, `last` for stage p-1 and `middle` for the
/// others, `comm` seconds per transfer. The scalars are the middle stage's
/// (one rank's share of the model); memory in bytes when measured, else
/// mem_b = 1 and mem_w = 0.5 (units of mem_b).
schedule::CostModel stage_cost_model(const StageCosts& first, const StageCosts& middle,
                                     const StageCosts& last, double comm, int p);

/// What `hp profile` measures and predicts (the reference models of hp/models).
struct ProfileConfig {
  models::ModelSpec model;      ///< the whole model; cut into p chunks
  int64_t microbatch_size = 4;  ///< rows per microbatch
  int p = 8;                    ///< target pipeline ranks
  int m = 24;                   ///< target microbatches per step
  std::string device = "auto";  ///< cpu, cuda (cuda:0) or auto
  int warmup = 2;
  int repeats = 5;
  uint64_t seed = 0;
  /// Seconds per transfer of one activation; < 0: measured here (two
  /// threads over Gloo, through host memory from a device).
  double comm = -1;
  std::vector<std::string> schedules;  ///< empty: default_prediction_schedules()
};

/// What `profile_model` found.
struct ProfileResult {
  std::string device;                ///< where it measured
  std::vector<int> chunks;           ///< the chunks of p measured: first, a middle one, last
  std::vector<StageCosts> measured;  ///< one per entry of `chunks`
  double comm = 0;                   ///< seconds per transfer
  bool comm_measured = false;        ///< false when given
  schedule::CostModel costs;         ///< what the predictions ran on (stage_cost_model)
  std::vector<SchedulePrediction> predictions;
  std::vector<schedule::PaperRow> paper;              ///< Table 5 at this p and m
  std::vector<SchedulePrediction> paper_predictions;  ///< 1f1b, zb-h1, zb-h2, zb-auto here
  int64_t items_per_step = 0;                         ///< tokens (gpt) or samples (mlp)
};

/// Measures the first, a middle and the last of the model's p chunks on the
/// configured device, the transfer of one activation, and predicts each
/// schedule's step at p and m. Throws std::invalid_argument on a bad config
/// (saying what to change), including --device cuda without a GPU.
ProfileResult profile_model(const ProfileConfig& config);

/// The report `hp profile` prints: measured costs, predictions sorted by step
/// time, and the paper's Table 5 rows at this p and m beside ours.
std::string profile_text(const ProfileConfig& config, const ProfileResult& result);

}  // namespace hp::train
