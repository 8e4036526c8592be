// hp/schedule/zb_auto.h: the zero-bubble list-scheduling heuristic (after the
// Zero Bubble paper) and the zb-auto search that runs it over many settings.
#pragma once

#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// Settings of one run of the greedy zero-bubble heuristic (loop placement,
/// one stage per rank, split backward I + W).
///
/// At each moment a free rank picks, in this order: F while fewer than
/// `warmup[r]` forwards are ahead of its I's; else a ready I; else F; else a
/// deferred W (to fill the gap) unless a known input arrives within `w_wait`
/// * W; else it waits. F never makes more than `max_inflight[r]`
/// microbatches in flight (F done, W not yet) nor pushes the rank's
/// activation memory above `mem_limit`.
struct HeuristicParams {
  std::vector<int> warmup;        ///< [p] forwards ahead of I before I is preferred
  std::vector<int> max_inflight;  ///< [p] cap on microbatches between their F and their W
  double mem_limit = 1e300;       ///< per-rank activation memory limit
  double w_wait = 0.0;            ///< wait instead of W if an input arrives within w_wait * W
};

/// Runs the heuristic under `costs` (its comm included). Throws
/// std::invalid_argument if the memory limit cannot hold one microbatch.
Schedule greedy_zero_bubble(int ranks, int microbatches, const CostModel& costs,
                            const HeuristicParams& params);

/// zb-auto: runs the heuristic over a grid of warmup depths and W policies
/// (plus the hand-made ZB-H1, ZB-H2 and 1F1B when they fit the memory limit),
/// simulates each under `costs` and returns the one with the smallest bubble
/// rate (ties: smaller peak memory) whose peak memory stays within
/// `mem_limit` (0 = 2 * p * mem_b).
Schedule zb_auto(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0);

}  // namespace hp::schedule
