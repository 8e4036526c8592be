// hp/schedule/search/pool.cpp: the candidate pool of the schedule search.
#include "hp/schedule/search/pool.h"

#include <exception>
#include <utility>

#include "hp/schedule/budget.h"

namespace hp::schedule::detail {

namespace {
constexpr double kTol = 1e-9;
}  // namespace

Placement placement_of(const Schedule& s) {
  if (s.num_stages == s.num_ranks) return Placement::Loop;
  const bool v = s.num_stages == 2 * s.num_ranks && s.num_chunks == s.num_stages &&
                 s.routes.size() == 1 && s.stage_rank == make_v_layout(s.num_ranks, 1).stage_rank;
  return v ? Placement::V : Placement::Other;
}

bool better(Objective objective, const Score& a, const Score& b) {
  if (objective == Objective::Span) {
    const double tol = kTol * std::max(1.0, a.span);
    return a.span < b.span - tol || (a.span < b.span + tol && a.mem < b.mem - tol);
  }
  const double t = kTol * std::max(1.0, b.makespan);
  if (a.makespan < b.makespan - t) return true;
  if (a.makespan > b.makespan + t) return false;
  if (a.span < b.span - t) return true;
  if (a.span > b.span + t) return false;
  return a.mem < b.mem - kTol * std::max(1.0, b.mem);
}

CostModel CandidatePool::costs_of(const Schedule& s) const {
  return carry_over_ ? costs_for_cut(costs_, s) : costs_;
}

void CandidatePool::consider(Schedule s, const std::string& from) {
  SimResult r;
  try {
    const CostModel c = costs_of(s);
    SimOptions quiet;
    quiet.record_timeline = false;
    r = simulate(s, c, quiet);
  } catch (const std::exception&) {
    return;  // a cut these costs cannot describe, or an order that deadlocks: not a candidate
  }
  work_ += action_count(s);
  ++candidates_;
  if (r.max_peak_memory > limit_ + kTol * std::max(1.0, limit_)) return;
  ++fitting_;
  const Score k{r.makespan, r.span, r.max_peak_memory};
  Slot& into = slot(placement_of(s));
  if (!into.have || better(objective_, k, into.score)) {
    into.have = true;
    into.score = k;
    into.s = std::move(s);
    into.from = from;
  }
}

long long action_count(const Schedule& s) {
  long long n = 0;
  for (const auto& a : s.actions)
    n += static_cast<long long>(a.size());
  return n;
}

}  // namespace hp::schedule::detail
