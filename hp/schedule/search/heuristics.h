// hp/schedule/search/heuristics.h: the four list heuristics the schedule
// searches (search.h) run: on the loop placement the time-ordered list
// scheduler and the Zero Bubble paper's stage sweep; on the V the ZB-V paper's
// V sweep and the memory-capped list scheduler. Each builds one schedule from
// its settings under costs and a memory limit; the searches try many settings.
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/vshape.h"

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

/// Settings of the stage sweep (the Zero Bubble paper's heuristic, its
/// Section 3.1): three switches the paper searches over.
struct SweepParams {
  double mem_limit = 1e300;  ///< per-rank activation memory limit
  /// Warmup: also run a forward that ends after the first input gradient
  /// arrives (a shorter gap before the first I, at the cost of delaying it).
  bool warmup_overrun = false;
  /// A stage two or more forwards ahead of the next one skips its forward in
  /// a round when that would leave the next stage waiting less than the
  /// largest idle so far.
  bool hold_back_f = false;
  /// Fill an idle gap shorter than a W with a W even when the gap would not
  /// make this stage the idlest.
  bool fill_small_gaps = true;
};

/// The stage sweep: microbatch by microbatch, each round gives every stage
/// (top down) at most one more forward, never more than the stage above it
/// has, then every stage (bottom up) the input gradient of the round's
/// microbatch; weight gradients are placed to free memory or to fill the
/// wait for an input. Warmup: as many forwards per stage as fit before the
/// first input gradient arrives, within the memory limit. Loop placement, one
/// stage per rank, per-stage costs, memory and comm honoured. Throws
/// std::invalid_argument when the memory limit cannot hold the warmup.
Schedule sweep_zero_bubble(int ranks, int microbatches, const CostModel& costs,
                           const SweepParams& params);

/// Settings of one run of the V sweep (the ZB-V paper's heuristic for the V
/// placement, NOTE [V sweep] in v_heuristics.cpp): two switches of when a
/// weight gradient bridges a wait.
struct VSweepParams {
  double mem_limit = 1e300;  ///< per-rank activation memory limit
  /// Before a forward, a W may bridge a wait that would make this rank the idlest.
  bool fill_f = true;
  /// Before a down stage's input gradient, the same.
  bool fill_b = true;
};

/// The V sweep: a warmup sized by the first microbatch's round trip
/// (transfers included), then rounds of one input gradient and one forward
/// per rank, W's filling waits; then a second pass that allows every rank
/// the idle the first gave the idlest one. Returns the first pass and, when
/// it ran, the second (empty: these settings do not fit the limit or the
/// costs). V placement; per-stage vectors of `costs`, when set, have 2p
/// entries.
std::vector<Schedule> sweep_v(int ranks, int microbatches, const CostModel& costs,
                              const VSweepParams& params);

/// Settings of one run of greedy_v (V placement, split backward).
///
/// At each moment the free rank with the earliest clock picks, in this order:
/// the up stage's F when its input is there (it completes the V turn); an I
/// whose input is there (the up stage's first); a down F while fewer than
/// `warmup[r]` microbatches are between their down F and their down I; a
/// deferred W; else it waits. A down F (a microbatch entering the rank) is
/// admitted only when the rank's memory can also hold that microbatch's up F
/// within `mem_limit` (NOTE [Admission on the V]); W's run early when memory
/// is short.
struct VGreedyParams {
  std::vector<int> warmup;   ///< [p] microbatches a rank may hold between down F and down I
  double mem_limit = 1e300;  ///< per-rank activation memory limit
  /// When set (one entry per rank), the rules above give way to a block's
  /// order: of the F's and I's whose inputs are there (a down F also needs
  /// admission), the one whose slot in the repeated block (offset + 6 k) is
  /// the earliest runs; W's fill the rest. The block's order adapted to the
  /// costs and capped to the limit (NOTE [Blocks as priorities]).
  std::vector<BlockOffsets> priority;
  /// With `priority`: an op may run only while its slot is at most `window`
  /// slots after the earliest slot among the rank's next ops that memory
  /// allows, ready or not (0: the block's order; large: any ready op).
  int window = 1 << 30;
};

/// The memory-capped list scheduler on the V placement (above). Per-stage
/// vectors of `costs`, when set, have 2p entries. Throws
/// std::invalid_argument naming the bound when `mem_limit` cannot hold one
/// microbatch on a rank (both of its stages).
Schedule greedy_v(int ranks, int microbatches, const CostModel& costs, const VGreedyParams& params);

}  // namespace hp::schedule
