// hp/schedule/search/search.cpp: the one schedule search (its presets
// zb-auto, zbv-auto and auto) and the span bound of the loop placement.
#include "hp/schedule/search/search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include "hp/schedule/budget.h"
#include "hp/schedule/fuse.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/refine.h"
#include "hp/schedule/search/heuristics.h"
#include "hp/schedule/search/pool.h"
#include "hp/schedule/vshape.h"

namespace hp::schedule {

// NOTE [Budget of the memory search]
// A search spends a budget counted in simulated actions, never in seconds
// (NOTE [Deterministic search]): every candidate costs its action count to
// simulate, a heuristic run the same. zb-auto and zbv-auto count their
// candidates against SearchOptions::candidate_work (each at an estimate of
// its work; the first always runs) and give the local search its own bound.
// auto counts what it spent, and its local search gets what is left (at
// least a quarter of the budget), split between the best candidate on one
// stage per rank and the best on the V. auto's default, 6 million actions,
// keeps every search at p <= 16, m <= 8p under a second on this machine
// (tested: BudgetSearch.UnderItsTimeBudget); the search stops at its budget
// and returns the best found so far.
// The budget once gated only the heuristics, after every fixed schedule had
// been built: at the sizes the one size rule admits with many ranks (p =
// 4096, m = 1 to 22; p = 1024, m = 2 to 45) building V-ZB's block alone took
// 50 s and `hp schedule show auto`, `tune` (now `recommend --search`) and
// `recommend` ran for minutes. Now every candidate is tried only while its
// estimated work (estimated_work(), v_block_work(): the squeeze of a V block
// grows with p m times its row of about 12 p + 6 m slots) fits what is left,
// zb-auto and zbv-auto inside auto get what is left as their own bound, and
// recommend() gives its generators one budget in the same units. Naive and
// the V's naive, the two smallest-memory schedules, are always tried, so a
// limit that any schedule meets is met. What the bound left out is named
// (SearchStats::left_out; the CLI prints it), as the promise "never slower
// than a fitting fixed schedule" holds only for a search that ran whole.

namespace {

using detail::CandidatePool;
using detail::Placement;
using detail::WorkBound;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

double max_stage_mem_b(const Schedule& layout, const CostModel& c) {
  double v = 0;
  for (int st = 0; st < layout.num_stages; ++st)
    v = std::max(v, c.stage_mem_b_of(layout, st));
  return v;
}

// What a preset settled before its candidates: the costs its pool simulates
// under, the limit, and the smallest memory a schedule needs (for messages).
struct Setup {
  CostModel costs;  // zb-auto, zbv-auto: as given; auto: folded to p entries
  double limit = 0;
  double floor = 0;  // auto: smallest_feasible_memory; else one microbatch's mem_b
};

// zb-auto's candidates: the stage sweep over its switches, the hand-made
// schedules, the time-ordered heuristic over warmup depths and W policies.
void loop_candidates(int p, int m, const Setup& su, CandidatePool& pool, WorkBound& work) {
  const CostModel& costs = su.costs;
  const double limit = su.limit, one = su.floor;
  for (int bits = 0; bits < 8; ++bits) {
    if (!work.take()) break;
    SweepParams sp;
    sp.mem_limit = limit;
    sp.warmup_overrun = bits & 1;
    sp.hold_back_f = bits & 2;
    sp.fill_small_gaps = !(bits & 4);
    try {
      pool.consider(sweep_zero_bubble(p, m, costs, sp), "zb-sweep");
    } catch (const std::invalid_argument&) {
      // this setting does not fit the limit; others may
    }
  }
  for (const char* n : {"zb-h1", "zb-h2", "1f1b"})
    if (work.take()) pool.consider(build(n, p, m), n);
  // The time-ordered heuristic over warmup depths (a * (p - r) + b, capped by
  // memory) and W policies.
  const int mem_cap = static_cast<int>(std::floor(limit / std::max(one, 1e-12) + kEps));
  for (double a : {1.0, 1.5, 2.0, 3.0}) {
    for (int b : {-1, 0, 1}) {
      for (double w_wait : {0.0, 0.5, 1.0}) {
        if (!work.take()) break;
        HeuristicParams hp;
        hp.mem_limit = limit;
        hp.w_wait = w_wait;
        for (int r = 0; r < p; ++r) {
          int w = static_cast<int>(std::lround(a * (p - r))) + b;
          w = std::max(1, std::min({w, m, std::max(mem_cap, 1)}));
          hp.warmup.push_back(w);
          hp.max_inflight.push_back(m);
        }
        try {
          pool.consider(greedy_zero_bubble(p, m, costs, hp), "zb-greedy");
        } catch (const std::invalid_argument&) {
          // this setting cannot run under the limit; others may
        }
      }
    }
  }
}

// zbv-auto's candidates: the hand-made ZB-V, then the V sweep with both
// weight-gradient switches, each run twice (NOTE [V sweep]).
void v_candidates(int p, int m, const Setup& su, CandidatePool& pool, WorkBound& work) {
  work.take();  // the hand-made order: at least 2p - 1 microbatches' loop per rank
  pool.consider(zbv(p, m), "zbv");
  for (bool fill_b : {true, false}) {
    for (bool fill_f : {true, false}) {
      if (!work.take() || !work.take()) return;  // two runs
      VSweepParams vp;
      vp.mem_limit = su.limit;
      vp.fill_f = fill_f;
      vp.fill_b = fill_b;
      for (Schedule& s : sweep_v(p, m, su.costs, vp))
        pool.consider(std::move(s), "v-sweep");
    }
  }
}

// auto's candidates, each tried only while its estimated work fits what is
// left of `budget` (NOTE [Budget of the memory search]); what the bound left
// out is named in `stats.left_out`. Returns the work spent beyond the pool's
// simulations (a V block's squeeze, the hand-made ZB-V's loop).
long long auto_candidates(int p, int m, const Setup& su, CandidatePool& pool, long long budget,
                          SearchStats& stats) {
  const CostModel& costs = su.costs;
  const double limit = su.limit;
  const CostModel loop_costs = costs_for_cut(costs, make_loop_layout(p, p, m));
  const CostModel v_costs = costs_for_cut(costs, make_v_layout(p, m));
  const long long per_schedule = 3LL * p * m;  // actions of one F/I/W schedule
  long long extra = 0;
  auto afford = [&](long long est, const std::string& name) {
    if (pool.work() + extra + est <= budget) return true;
    stats.left_out.push_back(name);
    return false;
  };

  // 1. Every fixed schedule (they set the bar the search must meet); the
  // hand-made ZB-V and the V's naive after the others.
  for (const std::string& n : names()) {
    if (n == "zb-auto" || n == "zbv-auto" || n == "auto" || n == "zbv") continue;
    if (is_fb_variant(n)) continue;  // they tie their base at best here (fuse.h)
    const long long est = estimated_work(n, p, m);
    if (n != "naive" && !afford(est, n)) continue;
    try {
      pool.consider(build(n, p, m), n);
      extra += std::max(0LL, est - 2 * per_schedule);
    } catch (const std::invalid_argument&) {
      // its constraints are not met at this p, m
    }
  }
  const long long zbv_work = estimated_work("zbv", p, m);
  if (afford(zbv_work, "zbv")) {
    pool.consider(zbv(p, m), "zbv");
    extra += zbv_work - 2 * 2 * per_schedule;
  }
  pool.consider(v_naive(p, m), "v-naive");
  auto left = [&] { return std::max(0LL, budget - pool.work() - extra); };

  // 2. The heuristics that take the limit: zb-auto's and zbv-auto's
  // candidates (their winners, without local search), the memory-capped V
  // list scheduler.
  SearchOptions no_refine;
  no_refine.refine_work = 0;
  std::string cut;
  no_refine.cut_note = &cut;
  struct Nested {
    Preset preset;
    const CostModel& costs;
    long long spent_at_most;
  };
  for (const Nested& nested : {Nested{Preset::ZbAuto, loop_costs, 50 * per_schedule},
                               Nested{Preset::ZbvAuto, v_costs, 9 * 2 * per_schedule}}) {
    const char* name = preset_name(nested.preset);
    if (pool.work() + extra >= budget) {
      stats.left_out.push_back(name);
      continue;
    }
    no_refine.candidate_work = left();
    try {
      pool.consider(search(nested.preset, p, m, nested.costs, limit, no_refine), name);
    } catch (const std::invalid_argument&) {
    }
    pool.add_work(std::min(nested.spent_at_most, std::max(left(), 2 * per_schedule)));
  }
  if (!cut.empty()) stats.left_out.push_back("part of " + cut);
  int skipped_runs = 0;
  for (double a : {0.25, 1.0 / 3, 0.5, 2.0 / 3, 0.75, 1.0}) {
    for (int b : {0, 1}) {
      if (pool.work() + extra >= budget) {
        ++skipped_runs;
        continue;
      }
      VGreedyParams vp;
      vp.mem_limit = limit;
      for (int r = 0; r < p; ++r)
        vp.warmup.push_back(
            std::max(1, std::min(m, static_cast<int>(std::lround(a * (2 * p - 1 - r))) + b)));
      try {
        pool.consider(greedy_v(p, m, v_costs, vp), "v-greedy");
      } catch (const std::invalid_argument&) {
      }
      pool.add_work(4 * per_schedule);  // built (O(log p) a decision) and simulated
    }
  }
  if (skipped_runs) stats.left_out.push_back(std::to_string(skipped_runs) + " x v-greedy");
  // More blocks of the family between V-Min's lifespan and V-ZB's (each a
  // full-throughput steady state at its own memory), and V-Min's block
  // stretched to longer periods for limits below V-Min's (NOTE [Stretched
  // blocks]).
  struct Shape {
    int a, b, u, period;
  };
  for (const Shape& sh :
       {Shape{1, 1, 2, 6}, Shape{2, 2, 2, 6}, Shape{3, 3, 1, 6}, Shape{4, 1, 2, 6},
        Shape{1, 1, 1, 7}, Shape{1, 1, 1, 8}, Shape{1, 1, 1, 9}, Shape{1, 1, 1, 10},
        Shape{1, 1, 1, 12}, Shape{1, 1, 1, 15}, Shape{1, 1, 1, 18}, Shape{1, 1, 1, 24}}) {
    const std::string name = "v-block " + std::to_string(sh.a) + "," + std::to_string(sh.b) + "," +
                             std::to_string(sh.u) + "/" + std::to_string(sh.period);
    try {
      const auto block = v_block_family(p, sh.a, sh.b, sh.u, sh.period);
      const long long est = v_block_work(block, p, m, sh.period);
      if (!afford(est, name)) continue;
      pool.consider(schedule_from_v_block(block, p, m, name, sh.period), name);
      extra += std::max(0LL, est - 2 * per_schedule);
    } catch (const std::invalid_argument&) {
    }
    pool.add_work(2 * per_schedule);
  }
  // The V blocks as priorities of the same list scheduler, capped at the limit
  // (NOTE [Blocks as priorities]).
  struct Prio {
    VBlock kind;
    int window;
  };
  for (const Prio& pr : {Prio{VBlock::Min, 1 << 30}, Prio{VBlock::Half, 1 << 30},
                         Prio{VBlock::ZB, 1 << 30}, Prio{VBlock::Min, 6}, Prio{VBlock::Min, 12},
                         Prio{VBlock::Half, 6}, Prio{VBlock::Half, 12}}) {
    if (pool.work() + extra >= budget) {
      stats.left_out.push_back("capped v-block priority run");
      continue;
    }
    VGreedyParams vp;
    vp.mem_limit = limit;
    vp.priority = v_block_offsets(pr.kind, p);
    vp.window = pr.window;
    try {
      pool.consider(greedy_v(p, m, v_costs, vp), "v-block priorities, capped");
    } catch (const std::invalid_argument&) {
      // a window that blocks every rank under this limit: no candidate
    }
    pool.add_work(4 * per_schedule);
  }
  return extra;
}

// The costs, limit and floor of a preset, its inputs checked; throws when the
// limit is below what the preset can meet.
Setup setup(Preset preset, int p, int m, const CostModel& given, double mem_limit) {
  Setup su;
  const std::string name = preset_name(preset);
  if (preset == Preset::Auto) {
    given.check();
    su.costs = costs_per_rank(given, p);
    const Schedule loop_layout = make_loop_layout(p, p, m);
    const CostModel loop_costs = costs_for_cut(su.costs, loop_layout);
    const CostModel v_costs = costs_for_cut(su.costs, make_v_layout(p, m));
    loop_costs.check(p);
    v_costs.check(2 * p);
    const double one_f1b = p * max_stage_mem_b(loop_layout, loop_costs);
    su.limit = mem_limit > 0 ? mem_limit : one_f1b;
    su.floor = smallest_feasible_memory(p, m, su.costs);
    if (su.limit < su.floor - kEps * std::max(1.0, su.floor))
      throw std::invalid_argument("schedule 'auto': memory limit " + num(su.limit) +
                                  " is below the smallest any schedule reaches (" + num(su.floor) +
                                  ": one microbatch at a time); raise --mem-limit to at least " +
                                  num(su.floor));
    return su;
  }
  const bool loop = preset == Preset::ZbAuto;
  given.check(loop ? p : 2 * p);
  su.costs = given;
  su.floor = max_stage_mem_b(loop ? make_loop_layout(p, p, m) : make_v_layout(p, m), given);
  su.limit = mem_limit > 0 ? mem_limit : 2.0 * p * su.floor;
  if (loop && su.floor > su.limit + kEps)
    throw std::invalid_argument("schedule '" + name + "': memory limit " +
                                std::to_string(su.limit) +
                                " is below one microbatch's activations (mem_b " +
                                std::to_string(su.floor) + "); raise --mem-limit");
  return su;
}

// "9 x v-block, zb-auto": runs of one kind counted.
std::string left_out_line(const std::vector<std::string>& left_out) {
  std::string left;
  auto kind_of = [](const std::string& n) {
    return n.rfind("v-block ", 0) == 0 ? std::string("v-block") : n;
  };
  for (size_t i = 0; i < left_out.size();) {
    const std::string kind = kind_of(left_out[i]);
    size_t j = i;
    while (j < left_out.size() && kind_of(left_out[j]) == kind)
      ++j;
    left += (left.empty() ? "" : ", ") +
            (j - i > 1 ? std::to_string(j - i) + " x " + kind : left_out[i]);
    i = j;
  }
  return left;
}

}  // namespace

const char* preset_name(Preset preset) {
  switch (preset) {
    case Preset::ZbAuto:
      return "zb-auto";
    case Preset::ZbvAuto:
      return "zbv-auto";
    default:
      return "auto";
  }
}

Schedule search(Preset preset, int p, int m, const CostModel& given, double mem_limit,
                const SearchOptions& options, SearchStats* stats_out) {
  const std::string name = preset_name(preset);
  if (p < 1 || m < 1)
    throw std::invalid_argument("schedule '" + name + "': needs p >= 1 and m >= 1 (got p=" +
                                std::to_string(p) + ", m=" + std::to_string(m) + ")");
  const Setup su = setup(preset, p, m, given, mem_limit);
  SearchStats local;
  SearchStats& stats = stats_out ? *stats_out : local;
  stats = SearchStats{};
  const bool whole = preset == Preset::Auto;  // both placements, step time
  const Objective objective = whole ? Objective::StepTime : Objective::Span;
  CandidatePool pool(objective, su.costs, /*carry_over=*/whole, su.limit);
  long long budget = options.candidate_work >= 0 ? options.candidate_work
                     : whole                     ? kAutoWork
                                                 : kCandidateWork;
  long long extra = 0;  // auto: work spent beyond the pool's simulations
  if (whole) {
    budget = std::max<long long>(budget, 1);
    extra = auto_candidates(p, m, su, pool, budget, stats);
    if (!pool.have())
      throw std::invalid_argument("schedule 'auto': no schedule found within memory limit " +
                                  num(su.limit) + " (the smallest any schedule reaches is " +
                                  num(su.floor) + "); raise --mem-limit");
    if (options.cut_note && !stats.left_out.empty())
      *options.cut_note += (options.cut_note->empty() ? "" : "; ") +
                           std::string("auto: the work bound left out ") +
                           left_out_line(stats.left_out);
  } else {
    const bool loop = preset == Preset::ZbAuto;
    // Each candidate is built and simulated, about twice its actions.
    WorkBound work(budget, 2LL * (loop ? 3 : 6) * p * m);
    if (loop)
      loop_candidates(p, m, su, pool, work);
    else
      v_candidates(p, m, su, pool, work);
    if (!pool.have()) {
      if (loop)
        throw std::invalid_argument("schedule '" + name +
                                    "': no schedule found within memory limit " +
                                    std::to_string(su.limit) + "; raise --mem-limit (1F1B needs " +
                                    std::to_string(p * su.floor) + ")" + work.why_short());
      throw std::invalid_argument(
          "schedule '" + name + "': no V schedule found within memory limit " +
          std::to_string(su.limit) + "; raise --mem-limit (the hand-made ZB-V needs about " +
          std::to_string(2.0 * p * su.floor) + ")" + work.why_short());
    }
    work.note(name, options.cut_note);
  }

  // The local search on the best of each placement (the others as they are).
  const long long refine_work = options.refine_work >= 0 ? options.refine_work
                                : whole ? std::max(budget - pool.work() - extra, budget / 4)
                                        : kRefineWork;
  Schedule best;
  detail::Score best_score;
  bool have = false;
  auto take = [&](CandidatePool::Slot& slot, long long work) {
    if (!slot.have) return;
    Schedule s = slot.s;
    const double span_before = slot.score.span;
    if (work > 0) {
      const CostModel c = pool.costs_of(s);
      RefineOptions ro;
      ro.mem_limit = su.limit;
      ro.max_work = work;
      RefineStats rs;
      Schedule r = refine(s, c, ro, &rs);
      SimOptions quiet;
      quiet.record_timeline = false;
      const SimResult sr = simulate(r, c, quiet);
      const detail::Score k{sr.makespan, sr.span, sr.max_peak_memory};
      // The local search shortens the span: kept, unless slower in step time
      // where that is the objective.
      if (objective == Objective::Span || !detail::better(objective, slot.score, k)) {
        s = std::move(r);
        slot.score = k;
      }
      stats.work +=
          std::min(work, static_cast<long long>(rs.evaluations) * detail::action_count(s));
    }
    if (!have || detail::better(objective, slot.score, best_score)) {
      have = true;
      best = std::move(s);
      best_score = slot.score;
      stats.winner = slot.from;
      stats.span_before = span_before;
    }
  };
  CandidatePool::Slot& loop = pool.slot(Placement::Loop);
  CandidatePool::Slot& vee = pool.slot(Placement::V);
  const bool both = loop.have && vee.have;
  take(loop, both ? refine_work / 2 : refine_work);
  take(vee, both ? refine_work - refine_work / 2 : refine_work);
  take(pool.slot(Placement::Other), 0);
  stats.candidates = pool.candidates();
  stats.fitting = pool.fitting();
  stats.work += pool.work();
  stats.span_after = best_score.span;
  best.name = name;
  return best;
}

Schedule zb_auto(int p, int m, const CostModel& costs, double mem_limit,
                 const SearchOptions& options) {
  return search(Preset::ZbAuto, p, m, costs, mem_limit, options);
}

Schedule zbv_auto(int p, int m, const CostModel& costs, double mem_limit,
                  const SearchOptions& options) {
  return search(Preset::ZbvAuto, p, m, costs, mem_limit, options);
}

Schedule auto_search(int p, int m, const CostModel& costs, double mem_limit,
                     const SearchOptions& options, SearchStats* stats) {
  return search(Preset::Auto, p, m, costs, mem_limit, options, stats);
}

// NOTE [Rank 0 bound]
// Rank 0 runs every microbatch's first forward and its last weight gradient.
// Warmup: its first I cannot start before microbatch 0 has gone down the
// pipeline and its gradient has come back, T1 = sum F + sum of the other
// stages' I + every transfer twice, after its first F; until then rank 0 can
// only run forwards (no W exists yet), at most k = limit / mem_b of them (and
// m), so it idles at least T1 - k F. Tail: after its last forward ends, the
// last microbatch still has to go down and back and rank 0 then runs its I and
// W: chain = the other stages' F and I + transfers + I + W of stage 0. The work
// left to rank 0 by then is the I and W of the a microbatches in flight and
// the W of d microbatches past their I, with a mem_b + d mem_w within the
// limit, at most max(a (I + W) + d W); the rest of the chain is idle. The two
// idle stretches do not overlap when m > k (the last forward follows the first
// I); otherwise only the larger counts. Span >= rank 0's work + both, and >=
// every rank's work. Under the Zero Bubble paper's inputs this bound equals the
// paper's ZB-1p (and ours) on every row of its Table 5.
double span_lower_bound(int p, int m, const CostModel& costs, double mem_limit) {
  if (p < 1 || m < 1) throw std::invalid_argument("span_lower_bound: needs p >= 1 and m >= 1");
  costs.check(p);
  const Schedule s = make_loop_layout(p, p, m);
  auto F = [&](int j) { return costs.stage_cost(s, Op::F, j); };
  auto I = [&](int j) { return costs.stage_cost(s, Op::I, j); };
  auto W = [&](int j) { return costs.stage_cost(s, Op::W, j); };
  double busy_max = 0, down_back = 0, comm2 = 0;
  for (int j = 0; j < p; ++j) {
    busy_max = std::max(busy_max, m * (F(j) + I(j) + W(j)));
    if (j > 0) down_back += F(j) + I(j);
    if (j + 1 < p) comm2 += 2 * costs.boundary_cost(s, j, j + 1);
  }
  const double mb = costs.stage_mem_b_of(s, 0), mw = costs.stage_mem_w_of(s, 0);
  const double limit = mem_limit > 0 ? mem_limit : kInf;
  const int cap = mb > 0 ? static_cast<int>(std::min<double>(m, std::floor(limit / mb + kEps))) : m;
  const int k = std::max(1, cap);
  const double warm = std::max(0.0, F(0) + down_back + comm2 - k * F(0));
  double left = 0;  // most work rank 0 can still have after its last forward
  for (int a = 1; a <= k; ++a) {
    double room = limit - a * mb;
    int d = m - a;
    if (mw > 0) d = std::min<int>(d, static_cast<int>(std::floor(std::max(0.0, room) / mw + kEps)));
    left = std::max(left, a * (I(0) + W(0)) + d * W(0));
  }
  const double chain = down_back + comm2 + I(0) + W(0);
  const double tail = std::max(0.0, chain - left);
  const double idle = m > k ? warm + tail : std::max(warm, tail);
  return std::max(busy_max, m * (F(0) + I(0) + W(0)) + idle);
}

}  // namespace hp::schedule
