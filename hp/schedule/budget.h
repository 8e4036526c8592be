// hp/schedule/budget.h: what the memory budget of a search and a ranking
// needs: per-stage costs carried over to other cuts, the smallest limit any
// schedule can meet, the generators' work estimates, and the ranking `hp
// schedule recommend` prints. The search `auto` itself: search/search.h.
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

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

/// The V's naive schedule: one microbatch at a time down and up the V, fused
/// backwards (a rank holds both of its stages' activations of one microbatch):
/// the smallest memory on the V.
Schedule v_naive(int ranks, int microbatches);

/// One row of recommend().
struct Recommendation {
  std::string name;   ///< generator name ("auto" for the search)
  Schedule schedule;  ///< compute-only
  SimResult result;   ///< under costs_for_cut(costs, schedule), no timeline
  bool fits = false;  ///< max_peak_memory within the limit
};

/// Every generator of names() (the searches included, at `mem_limit`) built for
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
/// simulated actions (NOTE [Budget of the memory search] in search/search.cpp);
/// for the searches (zb-auto, zbv-auto, auto), their bounds.
long long estimated_work(const std::string& name, int ranks, int microbatches, int chunks = 2);

}  // namespace hp::schedule
