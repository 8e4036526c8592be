// `hp train --graph`: the main job through graph mode. Every rank holds the
// whole model, captured once as a forward+backward graph (hp/compile), with
// FSDP sharding its parameters over the ranks (data parallel: each rank takes
// its share of the step's microbatches as one batch).
#pragma once

#include <memory>

#include "hp/distributed/comm.h"
#include "hp/train/config.h"

namespace hp::train {

/// Trains config.model with GraphTrainer on this process's rank of `comm`
/// (world size == config.nproc; config.graph must be set). Rank r trains on
/// microbatches [r*k, (r+1)*k) of each step (k = microbatches / nproc) as one
/// batch; FSDP shards every parameter whose dim 0 divides by nproc (the others
/// stay replicated, their gradients all-reduced), unless config.shard is off
/// (plain data parallel). Equals train_reference with the same config.
/// Rank 0 prints progress and writes the report and trace.
TrainResult run_graph_rank(const TrainConfig& config, std::shared_ptr<distributed::Comm> comm);

}  // namespace hp::train
