// hp/schedule/budget.h: schedules at any memory budget: the search `auto`
// (the best schedule under a per-rank memory limit, on one stage per rank or
// on the V), the smallest limit any schedule can meet, per-stage costs carried
// over to other cuts, and the ranking `hp schedule recommend` prints.
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// Options of budget_search().
struct BudgetOptions {
  /// Work budget of the whole search in simulated actions (NOTE [Budget of
  /// the memory search]); deterministic (NOTE [Deterministic search]).
  long long max_work = 6'000'000;
};

/// What budget_search() did (for tests, benchmarks and `--json`).
struct BudgetStats {
  std::string winner;      ///< the candidate the result came from ("v-min", "zb-auto", ...)
  int candidates = 0;      ///< candidates simulated
  int fitting = 0;         ///< of those, within the limit
  long long work = 0;      ///< simulated actions spent
  double span_before = 0;  ///< the winner's longest span before the local search
  double span_after = 0;   ///< ... and after it
  /// Candidates the work budget left out (empty: the search ran whole; then
  /// the result is never slower than a fitting fixed schedule).
  std::vector<std::string> left_out;
};

/// Per-stage costs of a cut into q p stages (q >= 1, every vector of the same
/// length) folded into a p-stage cut: loop stage j sums the F, I, W and memory
/// of stages q j .. q j + q - 1 and takes the last one's comm and send.
/// Without per-stage vectors, `costs` itself. Throws std::invalid_argument
/// naming the vector when the lengths differ or are not a multiple of p.
CostModel costs_per_rank(const CostModel& costs, int ranks);

/// The costs of a schedule of any cut from costs of a p-stage cut
/// (NOTE [Costs of other cuts]): without per-stage vectors, `costs` itself
/// (simulate() scales by p / num_chunks); with them (p entries, one per rank of
/// a loop cut), a schedule with q chunks per rank gets per-stage vectors of its
/// num_stages entries: stage s computes chunk c, 1/q of loop stage c / q's F,
/// I, W and memory, and that stage's comm and send. Costs of another cut are
/// folded first (costs_per_rank). Throws std::invalid_argument when the
/// vectors' lengths are not a multiple of p or the chunks do not divide
/// evenly over the ranks.
CostModel costs_for_cut(const CostModel& costs, const Schedule& s);

/// The smallest per-rank activation memory any schedule of p ranks reaches
/// under `costs` (a p-stage cut, as costs_for_cut): one microbatch at a time
/// (naive) on one stage per rank, or on the V (both stages of a rank), the
/// smaller.
double smallest_feasible_memory(int ranks, int microbatches, const CostModel& costs);

/// The memory-budget search `auto`: the schedule with the shortest step time
/// (makespan; ties: the longest span, then peak memory) whose peak activation
/// memory on every rank stays within `mem_limit` (0: p mem_b, 1F1B's). The
/// candidates: every fixed generator (1F1B, ZB-H1, ZB-H2, V-Min, V-Half,
/// V-ZB, the hand-made ZB-V, interleaved, DualPipe(V), GPipe, naive) that
/// fits; zb-auto's heuristics and the V sweep of zbv at this limit; V-Min's
/// block stretched to longer periods; the memory-capped V list scheduler
/// (greedy_v) over a grid of warmup depths and with the V blocks as priorities;
/// then local search (refine()) on the best of one stage per rank and the
/// best on the V. Never slower than a fitting fixed schedule under the same
/// costs. `costs` describe a p-stage cut, or one folded into it
/// (costs_per_rank); the result's costs are costs_for_cut(costs, result). Each
/// candidate is tried only while its estimated work fits what is left of
/// `options.max_work` (naive and the V's naive, the floors, always are), so the
/// search ends in seconds at every size the one size rule admits; what the
/// bound left out is named in `stats->left_out`. Throws
/// std::invalid_argument naming smallest_feasible_memory() when the limit is below it.
Schedule budget_search(int ranks, int microbatches, const CostModel& costs, double mem_limit = 0,
                       const BudgetOptions& options = {}, BudgetStats* stats = nullptr);

/// One row of recommend().
struct Recommendation {
  std::string name;   ///< generator name ("auto" for the search)
  Schedule schedule;  ///< compute-only
  SimResult result;   ///< under costs_for_cut(costs, schedule), no timeline
  bool fits = false;  ///< max_peak_memory within the limit
};

/// Every generator of names() (the search included, at `mem_limit`) built for
/// p ranks and m microbatches, simulated under `costs` (a p-stage cut), sorted
/// fitting first, then by step time (makespan), then by the longest span.
/// Generators whose constraints are not met are left out and named in
/// `skipped` (name: reason), and so are those whose estimated work no longer
/// fits `max_work` (simulated actions; the searches get what is left), the
/// reason saying so. `mem_limit` 0 means p mem_b.
std::vector<Recommendation> recommend(int ranks, int microbatches, const CostModel& costs,
                                      double mem_limit,
                                      std::vector<std::pair<std::string, std::string>>* skipped,
                                      long long max_work = 60'000'000);

/// The estimated work of build(name, p, m) and of simulating its result, in
/// simulated actions (NOTE [Budget of the memory search]); for the searches
/// (zb-auto, zbv, auto), their bounds.
long long estimated_work(const std::string& name, int ranks, int microbatches, int chunks = 2);

}  // namespace hp::schedule
