// hp/schedule/refine.h: local search over the per-rank order of a compute-only
// F/I/W schedule (any placement) that shortens the longest rank's span under a
// memory limit, and the fast evaluation it is built on.
#pragma once

#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// Options of refine().
struct RefineOptions {
  double mem_limit = 1e300;  ///< per-rank activation memory limit the result must keep
  /// Work budget in simulated actions (each evaluation of a candidate order
  /// costs the schedule's action count). Deterministic: the same inputs give
  /// the same schedule on every machine (NOTE [Deterministic search]).
  long long max_work = 20'000'000;
};

/// What refine() did.
struct RefineStats {
  int evaluations = 0;     ///< candidate orders simulated
  int improvements = 0;    ///< moves kept
  double span_before = 0;  ///< longest rank span of the input
  double span_after = 0;   ///< longest rank span of the result
};

/// Local search: repeatedly moves one action of one rank (a W into an idle
/// gap, a swap of neighbours, the producer of an awaited input earlier on its
/// rank) and keeps a move when the longest rank span (the Zero Bubble paper's
/// cost; ties: the sum of spans) gets smaller, no rank's peak memory exceeds
/// `mem_limit`, and the lists stay deadlock-free. Never returns a worse
/// schedule than its input. Only compute-only schedules of F, I and W are
/// refined; any other schedule (B, FB, SEND/RECV) is returned unchanged.
Schedule refine(const Schedule& s, const CostModel& costs, const RefineOptions& opts = {},
                RefineStats* stats = nullptr);

}  // namespace hp::schedule
