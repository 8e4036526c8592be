// The one collective check a Pipeline makes when it is built (NOTE [Ranks
// agree on the pipeline] in agreement.cpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/schedule/schedule.h"

namespace hp::pipeline {

/// Every rank of `comm` says whether it could make its pipeline (`ok`), what
/// schedule and dtype it runs, whether its messages carry their layout (NOTE
/// [Messages that describe themselves] in frames.h), and `extra`: numbers the caller needs from
/// every rank (as many on each). A rank that failed returns (and rethrows its
/// own error afterwards); every other one throws here, naming the rank that
/// failed or differs. Returns every rank's `extra`, by rank. One all-gather.
std::vector<std::vector<int64_t>> agree_on_the_pipeline(distributed::Comm& comm,
                                                        const schedule::Schedule& schedule,
                                                        torch::Dtype dtype, bool layout_carried,
                                                        const torch::Device& device, int rank,
                                                        bool ok,
                                                        const std::vector<int64_t>& extra = {});

}  // namespace hp::pipeline
