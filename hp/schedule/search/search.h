// hp/schedule/search/search.h: the one schedule search and its presets.
// Candidates from the heuristics (heuristics.h) and the fixed generators go
// into one pool (pool.h) that keeps the best under the preset's objective and
// memory limit; the local search (refine.h) then improves the best of each
// placement. The presets: zb-auto (the Zero Bubble paper's search, one stage
// per rank), zbv-auto (the cost-aware ZB-V search, on the V) and auto (the
// best schedule under a memory limit, either placement).
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// What a search minimises among the candidates that fit its memory limit.
enum class Objective {
  /// The longest rank's span, first F to last op (the Zero Bubble paper's
  /// cost); ties: less peak memory.
  Span,
  /// The step time (makespan); ties: the longest span, then peak memory.
  StepTime,
};

/// The presets of search().
enum class Preset {
  /// "zb-auto": loop placement, Objective::Span, default limit 2 p mem_b (the
  /// paper's ZB-2p). Candidates: the stage sweep over its eight switch
  /// settings, the time-ordered heuristic over a grid of warmup depths and W
  /// policies, ZB-H1, ZB-H2 and 1F1B.
  ZbAuto,
  /// "zbv-auto": V placement, Objective::Span, default limit p mem_b (1F1B's
  /// memory). Candidates: the hand-made ZB-V and the V sweep (both W
  /// switches, two passes each), which sizes the warmup by the first
  /// gradient's round trip, transfers included.
  ZbvAuto,
  /// "auto": either placement, Objective::StepTime, default limit p mem_b.
  /// Candidates: every fixed generator, the results of zb-auto and zbv-auto at
  /// this limit (without their local search), the memory-capped V list
  /// scheduler over warmup depths and with the V blocks as priorities, and
  /// more blocks of the V family (NOTE [Budget of the memory search]).
  Auto,
};

/// The generator name of a preset: "zb-auto", "zbv-auto" or "auto".
const char* preset_name(Preset preset);

/// Default work bounds, in simulated actions (NOTE [Budget of the memory
/// search], NOTE [Deterministic search]).
inline constexpr long long kCandidateWork = 20'000'000;  ///< zb-auto, zbv-auto: candidates
inline constexpr long long kRefineWork = 20'000'000;     ///< zb-auto, zbv-auto: local search
inline constexpr long long kAutoWork = 6'000'000;        ///< auto: candidates

/// Options of search().
struct SearchOptions {
  /// Work bound of the candidates (each built and simulated) in simulated
  /// actions; the first candidate always runs. Negative: the preset's default
  /// (kCandidateWork; auto: kAutoWork). At every size the one size rule admits
  /// the search ends in seconds.
  long long candidate_work = -1;
  /// Work bound of the local search (refine.h); 0 turns it off. Negative: the
  /// preset's default (kRefineWork; auto: what the candidates left of
  /// candidate_work, at least a quarter of it), split between the best of one
  /// stage per rank and the best on the V when both exist.
  long long refine_work = -1;
  /// When set and the bound left candidates out, a line saying so is
  /// appended here (for the CLI's output).
  std::string* cut_note = nullptr;
};

/// What search() did (for tests, benchmarks and `--json`).
struct SearchStats {
  std::string winner;      ///< the candidate the result came from ("v-min", "zb-auto", ...)
  int candidates = 0;      ///< candidates simulated
  int fitting = 0;         ///< of those, within the limit
  long long work = 0;      ///< simulated actions spent
  double span_before = 0;  ///< the winner's longest span before the local search
  double span_after = 0;   ///< ... and after it
  /// Candidates auto's work bound left out (empty: the search ran whole; then
  /// its result is never slower than a fitting fixed schedule).
  std::vector<std::string> left_out;
};

/// The search, run as `preset` for p ranks and m microbatches under `costs`
/// within the per-rank activation memory limit `mem_limit` (0: the preset's
/// default). Deterministic (NOTE [Deterministic search]). Costs: zb-auto's and
/// zbv-auto's describe their own cut (per-stage vectors of p and 2p entries);
/// auto's a p-stage cut, or one folded into it (costs_per_rank, budget.h),
/// carried over to each candidate's cut (costs_for_cut), so its result's costs
/// are costs_for_cut(costs, result). Throws std::invalid_argument naming the
/// bound when the limit is below what the preset can meet (auto: below
/// smallest_feasible_memory(), budget.h).
Schedule search(Preset preset, int ranks, int microbatches, const CostModel& costs,
                double mem_limit = 0, const SearchOptions& options = {},
                SearchStats* stats = nullptr);

/// zb-auto: search(Preset::ZbAuto, ...). Never worse than the paper's
/// heuristic under the same inputs.
Schedule zb_auto(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0,
                 const SearchOptions& options = {});

/// zbv-auto: search(Preset::ZbvAuto, ...), the ZB-V that covers transfer time.
Schedule zbv_auto(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0,
                  const SearchOptions& options = {});

/// auto: search(Preset::Auto, ...). Never slower than a fixed schedule that
/// fits the limit under the same costs when the search ran whole
/// (`stats->left_out` empty).
Schedule auto_search(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0,
                     const SearchOptions& options = {}, SearchStats* stats = nullptr);

/// A lower bound on the longest rank's span (first F to last op) of every
/// loop-placement F/I/W schedule of p ranks and m microbatches whose peak
/// activation memory stays within `mem_limit`, under `costs` (per-stage
/// values honoured; NOTE [Rank 0 bound]). zb-auto's result is at least this;
/// where they meet, no schedule is better.
double span_lower_bound(int ranks, int microbatches, const CostModel& costs, double mem_limit);

}  // namespace hp::schedule
