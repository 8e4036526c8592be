// The activation memory of each stage, measured once before the first step,
// and the simulator's prediction of each rank's peak from it (NOTE [Memory
// measured against predicted] in stage_memory.cpp).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/pipeline.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"
#include "hp/train/config.h"

namespace hp::train {

/// Values measured per stage, stage-major: mem_b, mem_w, tF, tI, tW, tB.
constexpr int kStageMemFields = 6;

/// Every stage's kStageMemFields values in bytes, measured on this rank's
/// stages of `pipe` and summed over `comm` (each stage lives on one rank of
/// the pipeline), a stage after the first receiving random `received`
/// messages; empty where nothing is measured (a device, --recompute, no
/// memory tracker). Collective over `comm` when it measures.
std::vector<double> measure_stage_bytes(const TrainConfig& config, const schedule::Schedule& sched,
                                        int rank, pipeline::Pipeline& pipe,
                                        const pipeline::LossFn& loss_fn,
                                        const std::function<torch::Tensor(int)>& input_fn,
                                        const pipeline::Layout& received,
                                        const torch::Device& device, distributed::Comm& comm);

/// The stage costs' mem_b and mem_w from the measured bytes (before the
/// simulation that predicts with them).
void set_stage_memory(schedule::CostModel& costs, const std::vector<double>& stage_bytes);

/// Each rank's predicted peak (the simulator's, and with the transients)
/// and one microbatch's activations, into `result`.
void predict_rank_memory(const schedule::Schedule& sched, const std::vector<double>& stage_bytes,
                         const schedule::SimResult& sim, TrainResult& result);

}  // namespace hp::train
