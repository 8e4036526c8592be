// The one collective check a Pipeline makes when it is built (NOTE [Ranks
// agree on the pipeline] in agreement.cpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/schedule/schedule.h"

namespace hp::pipeline {

/// How a Pipeline's FB pairs run (its options fb_overlap, defer_wgrad,
/// pair_first_ready and deferred_w_parts), as one number to agree on.
int64_t pairs_word(bool fb_overlap, bool defer_wgrad, bool pair_first_ready, int w_parts);

/// Every rank of `comm` says whether it could make its pipeline (`ok`), what
/// schedule and dtype it runs, whether its messages carry their layout (NOTE
/// [Messages that describe themselves] in frames.h), how its pairs run
/// (`pairs`, pairs_word), and `extra`: numbers the caller needs from
/// every rank (as many on each). A rank that failed returns (and rethrows its
/// own error afterwards); every other one throws here, naming the rank that
/// failed or differs. Returns every rank's `extra`, by rank. One all-gather.
std::vector<std::vector<int64_t>> agree_on_the_pipeline(distributed::Comm& comm,
                                                        const schedule::Schedule& schedule,
                                                        torch::Dtype dtype, bool layout_carried,
                                                        int64_t pairs, const torch::Device& device,
                                                        int rank, bool ok,
                                                        const std::vector<int64_t>& extra = {});

}  // namespace hp::pipeline
