// A step's measured events from every rank of a pipeline's group, as one
// timeline on its rank 0: what the report fits its costs to and what the
// run's choice of deferred W's simulates (NOTE [The deferred W's chosen in
// the run] in pipeline.cpp).
#pragma once

#include <string>

#include "hp/distributed/comm.h"
#include "hp/pipeline/executor.h"
#include "hp/schedule/timeline.h"

namespace hp::pipeline {

/// Every rank's events of `last` (their nodes too, NOTE [A chunk's own
/// waits] in step_timer.h) on rank 0 of `comm`, as one timeline of
/// comm.world_size() ranks titled `title`; elsewhere the timeline has no
/// events. Collective over `comm`; the rows travel on `device` (a group
/// over NCCL carries CUDA tensors only).
schedule::Timeline gather_step_timeline(const StepStats& last, distributed::Comm& comm,
                                        const std::string& title,
                                        const torch::Device& device = torch::kCPU);

}  // namespace hp::pipeline
