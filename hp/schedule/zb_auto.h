// hp/schedule/zb_auto.h: the zero-bubble heuristics (a time-ordered list
// scheduler and the Zero Bubble paper's stage sweep) and the searches built on
// them: zb-auto (loop placement) and the cost-aware ZB-V.
#pragma once

#include <string>
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

/// Options of zb_auto() and zbv_auto() beyond costs and memory.
struct SearchOptions {
  /// Work budget of the local search (refine.h) in simulated actions; 0 turns
  /// the local search off. Deterministic (NOTE [Deterministic search]).
  long long refine_work = 20'000'000;
  /// Work budget of the candidates (heuristic runs, each built and simulated)
  /// in simulated actions: at every size the one size rule admits the search
  /// ends in seconds (NOTE [Budget of the memory search] in budget.cpp). The
  /// first candidate always runs.
  long long candidate_work = 20'000'000;
  /// When set and the budget left candidates out, a line saying so is
  /// appended here (for the CLI's output).
  std::string* cut_note = nullptr;
};

/// zb-auto: the smallest-span schedule (the Zero Bubble paper's cost: the
/// longest rank's first-F-to-last-op time) on loop placement within
/// `mem_limit` (0 = 2 p mem_b, the paper's ZB-2p), among the stage sweep over
/// its eight switch settings, the time-ordered heuristic over a grid of
/// warmup depths and W policies, and the hand-made ZB-H1, ZB-H2 and 1F1B,
/// then improved by local search (refine()). Ties: smaller peak memory.
/// Honours per-stage costs, memory and comm (one entry per rank). Never worse
/// than the paper's heuristic under the same inputs.
Schedule zb_auto(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0,
                 const SearchOptions& options = {});

/// A lower bound on the longest rank's span (first F to last op) of every
/// loop-placement F/I/W schedule of p ranks and m microbatches whose peak
/// activation memory stays within `mem_limit`, under `costs` (per-stage
/// values honoured; NOTE [Rank 0 bound]). zb-auto's result is at least this;
/// where they meet, no schedule is better.
double span_lower_bound(int ranks, int microbatches, const CostModel& costs, double mem_limit);

/// ZB-V that covers transfer time: V placement (rank r holds stages r and
/// 2p-1-r), the smallest span within `mem_limit` (0 = p mem_b, 1F1B's memory)
/// among the hand-made ZB-V order and a V heuristic that runs as many
/// warmup forwards as the first gradient's round trip (transfers included)
/// leaves room for, then refined by local search. Per-stage vectors, when
/// given, have 2p entries (one per virtual stage).
Schedule zbv_auto(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0,
                  const SearchOptions& options = {});

}  // namespace hp::schedule
