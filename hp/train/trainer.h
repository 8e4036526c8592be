// The training driver: a TrainConfig (config.h) turns into a schedule, model
// chunks and a Pipeline per rank, an optimizer, metrics, traces and
// checkpoints; plus the single-process reference the pipeline must equal.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "hp/distributed/comm.h"
#include "hp/train/config.h"

namespace hp::train {

/// Runs the pipeline on this process's rank of `comm` (comm's world size must
/// equal config.nproc). Rank 0 prints progress and writes the report, trace
/// and summary.
TrainResult run_rank(const TrainConfig& config, std::shared_ptr<distributed::Comm> comm);

/// The same training in one process with plain torch::autograd: the whole
/// model, the same microbatches, gradient accumulation, the same optimizer.
TrainResult train_reference(const TrainConfig& config);

}  // namespace hp::train
