// hp/schedule/budget.cpp: the memory-budget search `auto` over both
// placements, the smallest feasible limit, costs of other cuts, and the
// ranking behind `hp schedule recommend`.
#include "hp/schedule/budget.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "hp/schedule/generators.h"
#include "hp/schedule/refine.h"
#include "hp/schedule/vshape.h"
#include "hp/schedule/zb_auto.h"

namespace hp::schedule {

// NOTE [Costs of other cuts]
// A stage cost file (cost_file.h) measures a p-stage cut: one entry per rank.
// A schedule that cuts the model into q p chunks (interleaved: q = v; the V:
// q = 2) is given 1/q of a loop stage's F, I, W and memory per chunk, the
// chunks of loop stage j being q j .. q j + q - 1, and loop stage j's comm and
// send on every boundary after them (an activation of the same width crosses
// it). The first and last chunks really carry more (embedding, head, loss);
// hp/train's profile splits those better from a measured model, this room
// only has the p numbers. DualPipe's mirrored copies cost what the chunk they
// copy costs.

// NOTE [Budget of the memory search]
// budget_search() spends a budget counted in simulated actions, never in
// seconds (NOTE [Deterministic search]): every candidate costs its action
// count to simulate, a heuristic run the same, and the local search gets what
// is left (at least a quarter of the budget), split between the best
// candidate on one stage per rank and the best on the V. The default, 6
// million actions, keeps every search at p <= 16, m <= 8p under a second on
// this machine (tested: BudgetSearch.UnderItsTimeBudget); the search stops
// at its budget and returns the best found so far.
// The budget once gated only the heuristics, after every fixed schedule had
// been built: at the sizes the one size rule admits with many ranks (p =
// 4096, m = 1 to 22; p = 1024, m = 2 to 45) building V-ZB's block alone took
// 50 s and `hp schedule show auto`, `tune` and `recommend` ran for minutes.
// Now every candidate is tried only while its estimated work
// (estimated_work(), v_block_work(): the squeeze of a V block grows with p m
// times its row of about 12 p + 6 m slots) fits what is left, zb-auto and zbv
// inside the search get what is left as their own bound (SearchOptions), and
// recommend() gives its generators one budget in the same units. Naive and
// the V's naive, the two smallest-memory schedules, are always tried, so a
// limit that any schedule meets is met. What the bound left out is named
// (BudgetStats::left_out; the CLI prints it), as the promise "never slower
// than a fitting fixed schedule" holds only for a search that ran whole.

namespace {

constexpr double kTol = 1e-9;

int chunks_per_rank(const Schedule& s) {
  if (s.num_chunks % s.num_ranks != 0)
    throw std::invalid_argument(
        "costs for schedule '" + s.name + "': " + std::to_string(s.num_chunks) +
        " chunks do not divide over " + std::to_string(s.num_ranks) + " ranks");
  return s.num_chunks / s.num_ranks;
}

struct Key {
  double makespan = 0, span = 0, mem = 0;
  bool better_than(const Key& o) const {
    const double t = kTol * std::max(1.0, o.makespan);
    if (makespan < o.makespan - t) return true;
    if (makespan > o.makespan + t) return false;
    if (span < o.span - t) return true;
    if (span > o.span + t) return false;
    return mem < o.mem - kTol * std::max(1.0, o.mem);
  }
};

// The V's naive schedule: one microbatch at a time down and up the V, fused
// backwards: a rank holds both of its stages' activations of one microbatch.
Schedule v_naive(int p, int m) {
  Schedule s = make_v_layout(p, m);
  s.name = "v-naive";
  for (int r = 0; r < p; ++r)
    for (int k = 0; k < m; ++k) {
      const int dn = r, up = 2 * p - 1 - r;
      s.actions[r].push_back(Action::make(Op::F, dn, k));
      s.actions[r].push_back(Action::make(Op::F, up, k));
      s.actions[r].push_back(Action::make(Op::B, up, k));
      s.actions[r].push_back(Action::make(Op::B, dn, k));
    }
  return s;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

int action_count(const Schedule& s) {
  int n = 0;
  for (const auto& a : s.actions)
    n += static_cast<int>(a.size());
  return n;
}

// The candidates of one search: keeps the best fitting one overall and the
// best fitting one per placement (1 chunk per rank / the V) for the local
// search.
class Pool {
 public:
  Pool(const CostModel& costs, double limit, BudgetStats* stats)
      : costs_(costs), limit_(limit), stats_(stats) {}

  void consider(Schedule s, const std::string& from) {
    CostModel c;
    SimResult r;
    try {
      c = costs_for_cut(costs_, s);
      SimOptions quiet;
      quiet.record_timeline = false;
      r = simulate(s, c, quiet);
    } catch (const std::exception&) {
      return;  // a cut these costs cannot describe, or an order that deadlocks: not a candidate
    }
    work_ += action_count(s);
    ++stats_->candidates;
    if (r.max_peak_memory > limit_ + kTol * std::max(1.0, limit_)) return;
    ++stats_->fitting;
    const Key k{r.makespan, r.span, r.max_peak_memory};
    const bool v = s.num_stages == 2 * s.num_ranks && s.num_chunks == s.num_stages &&
                   s.routes.size() == 1 && s.stage_rank == make_v_layout(s.num_ranks, 1).stage_rank;
    Slot& slot = s.num_stages == s.num_ranks ? loop_ : v ? vee_ : other_;
    if (!slot.have || k.better_than(slot.key)) {
      slot.have = true;
      slot.key = k;
      slot.s = std::move(s);
      slot.from = from;
    }
  }

  long long work() const { return work_; }
  void add_work(long long w) { work_ += w; }

  struct Slot {
    bool have = false;
    Key key;
    Schedule s;
    std::string from;
  };
  Slot loop_, vee_, other_;

 private:
  const CostModel& costs_;
  double limit_;
  BudgetStats* stats_;
  long long work_ = 0;
};

}  // namespace

CostModel costs_per_rank(const CostModel& costs, int p) {
  if (!costs.per_stage()) return costs;
  if (p < 1) throw std::invalid_argument("per-stage costs: needs p >= 1");
  size_t n = 0;
  for (const auto* v : {&costs.stage_f, &costs.stage_b, &costs.stage_w, &costs.stage_mem_b,
                        &costs.stage_mem_w, &costs.stage_comm, &costs.stage_send})
    n = std::max(n, v->size());
  auto check = [&](const std::vector<double>& v, const char* what) {
    if (!v.empty() && (v.size() != n || n % static_cast<size_t>(p) != 0))
      throw std::invalid_argument(std::string("per-stage costs: ") + what + " has " +
                                  std::to_string(v.size()) + " entries; a p-stage cut needs p=" +
                                  std::to_string(p) + " (or a multiple of p, every vector alike)");
  };
  check(costs.stage_f, "stage_f");
  check(costs.stage_b, "stage_b");
  check(costs.stage_w, "stage_w");
  check(costs.stage_mem_b, "stage_mem_b");
  check(costs.stage_mem_w, "stage_mem_w");
  check(costs.stage_comm, "stage_comm");
  check(costs.stage_send, "stage_send");
  const int q = static_cast<int>(n) / p;
  if (q == 1) return costs;
  CostModel c = costs;
  auto fold = [&](const std::vector<double>& v, std::vector<double>& out, bool sum) {
    if (v.empty()) return;
    out.assign(p, 0.0);
    for (int j = 0; j < p; ++j)
      for (int i = 0; i < q; ++i)
        out[j] = sum ? out[j] + v[j * q + i] : v[j * q + i];  // else: the group's last
  };
  fold(costs.stage_f, c.stage_f, true);
  fold(costs.stage_b, c.stage_b, true);
  fold(costs.stage_w, c.stage_w, true);
  fold(costs.stage_mem_b, c.stage_mem_b, true);
  fold(costs.stage_mem_w, c.stage_mem_w, true);
  fold(costs.stage_comm, c.stage_comm, false);
  fold(costs.stage_send, c.stage_send, false);
  return c;
}

CostModel costs_for_cut(const CostModel& given, const Schedule& s) {
  if (!given.per_stage()) return given;
  const int p = s.num_ranks;
  const CostModel costs = costs_per_rank(given, p);
  const int q = chunks_per_rank(s);
  if (q == 1 && s.num_stages == p) return costs;
  CostModel c = costs;
  const int S = s.num_stages;
  auto split = [&](const std::vector<double>& v, std::vector<double>& out, double div) {
    if (v.empty()) return;
    out.assign(S, 0.0);
    for (int st = 0; st < S; ++st)
      out[st] = v[s.stage_chunk[st] / q] / div;
  };
  split(costs.stage_f, c.stage_f, q);
  split(costs.stage_b, c.stage_b, q);
  split(costs.stage_w, c.stage_w, q);
  split(costs.stage_mem_b, c.stage_mem_b, q);
  split(costs.stage_mem_w, c.stage_mem_w, q);
  split(costs.stage_comm, c.stage_comm, 1);
  split(costs.stage_send, c.stage_send, 1);
  return c;
}

double smallest_feasible_memory(int p, int m, const CostModel& costs) {
  if (p < 1 || m < 1)
    throw std::invalid_argument("memory bound: needs p >= 1 and m >= 1 (got p=" +
                                std::to_string(p) + ", m=" + std::to_string(m) + ")");
  SimOptions quiet;
  quiet.record_timeline = false;
  double best = 1e300;
  for (const Schedule& s : {build("naive", p, 1), v_naive(p, 1)})
    best = std::min(best, simulate(s, costs_for_cut(costs, s), quiet).max_peak_memory);
  return best;
}

long long estimated_work(const std::string& n, int p, int m, int chunks) {
  const long long loop = 2 * 3LL * p * m, vee = 2 * 6LL * p * m;  // built and simulated
  if (n == "zb-auto" || n == "zbv") {
    const SearchOptions d;
    return d.candidate_work + d.refine_work;
  }
  if (n == "auto") return BudgetOptions{}.max_work + 2 * vee;
  if (n == "v-min") return v_block_work(v_block_offsets(VBlock::Min, p), p, m);
  if (n == "v-half") return v_block_work(v_block_offsets(VBlock::Half, p), p, m);
  if (n == "v-zb") return v_block_work(v_block_offsets(VBlock::ZB, p), p, m);
  if (n.rfind("interleaved", 0) == 0) return loop * std::max(1, chunks);
  if (n == "dualpipe" || n == "dualpipev") return vee;
  if (n == "zb-h1" || n == "zb-h2") return 2 * loop;  // the list scheduler: O(log p) a decision
  return loop;
}

namespace {
// zbv_handmade's work: at least 2p - 1 microbatches' loop on every rank.
long long handmade_v_work(int p, int m) {
  return 2 * 6LL * p * m + 6LL * p * std::max(2 * p - 1, m) / 64;
}
}  // namespace

Schedule budget_search(int p, int m, const CostModel& given, double mem_limit,
                       const BudgetOptions& options, BudgetStats* stats_out) {
  if (p < 1 || m < 1)
    throw std::invalid_argument("schedule 'auto': needs p >= 1 and m >= 1 (got p=" +
                                std::to_string(p) + ", m=" + std::to_string(m) + ")");
  given.check();
  const CostModel costs = costs_per_rank(given, p);
  const Schedule loop_layout = make_loop_layout(p, p, m);
  const Schedule v_layout = make_v_layout(p, m);
  const CostModel loop_costs = costs_for_cut(costs, loop_layout);
  const CostModel v_costs = costs_for_cut(costs, v_layout);
  loop_costs.check(p);
  v_costs.check(2 * p);
  double one_f1b = 0;
  for (int r = 0; r < p; ++r)
    one_f1b = std::max(one_f1b, loop_costs.stage_mem_b_of(loop_layout, r));
  one_f1b *= p;
  const double limit = mem_limit > 0 ? mem_limit : one_f1b;
  const double floor = smallest_feasible_memory(p, m, costs);
  if (limit < floor - kTol * std::max(1.0, floor))
    throw std::invalid_argument("schedule 'auto': memory limit " + num(limit) +
                                " is below the smallest any schedule reaches (" + num(floor) +
                                ": one microbatch at a time); raise --mem-limit to at least " +
                                num(floor));
  BudgetStats local;
  BudgetStats& stats = stats_out ? *stats_out : local;
  stats = BudgetStats{};
  Pool pool(costs, limit, &stats);
  const long long budget = std::max<long long>(options.max_work, 1);
  const long long per_schedule = 3LL * p * m;  // actions of one F/I/W schedule

  // A candidate whose estimated work no longer fits is left out and named
  // (NOTE [Budget of the memory search]); what was spent on the fixed ones
  // beyond their simulation (a V block's squeeze) counts too.
  long long extra = 0;
  auto afford = [&](long long est, const std::string& name) {
    if (pool.work() + extra + est <= budget) return true;
    stats.left_out.push_back(name);
    return false;
  };

  // 1. Every fixed schedule (they set the bar the search must meet).
  for (const std::string& n : names()) {
    if (n == "zb-auto" || n == "zbv" || n == "auto") continue;
    const long long est = estimated_work(n, p, m);
    if (n != "naive" && !afford(est, n)) continue;
    try {
      pool.consider(build(n, p, m), n);
      extra += std::max(0LL, est - 2 * 3LL * p * m);
    } catch (const std::invalid_argument&) {
      // its constraints are not met at this p, m
    }
  }
  if (afford(handmade_v_work(p, m), "zbv (hand-made)")) {
    pool.consider(zbv_handmade(p, m), "zbv (hand-made)");
    extra += handmade_v_work(p, m) - 2 * 6LL * p * m;
  }
  pool.consider(v_naive(p, m), "v-naive");
  auto left = [&] { return std::max(0LL, budget - pool.work() - extra); };

  // 2. The heuristics that take the limit: the Zero Bubble paper's (loop), the
  // V sweep, the memory-capped V list scheduler.
  SearchOptions no_refine;
  no_refine.refine_work = 0;
  std::string cut;
  no_refine.cut_note = &cut;
  if (pool.work() + extra < budget) {
    no_refine.candidate_work = left();
    try {
      pool.consider(zb_auto(p, m, loop_costs, limit, no_refine), "zb-auto");
    } catch (const std::invalid_argument&) {
    }
    pool.add_work(std::min(50 * per_schedule, std::max(left(), 2 * per_schedule)));
  } else {
    stats.left_out.push_back("zb-auto");
  }
  if (pool.work() + extra < budget) {
    no_refine.candidate_work = left();
    try {
      pool.consider(zbv_auto(p, m, v_costs, limit, no_refine), "zbv");
    } catch (const std::invalid_argument&) {
    }
    pool.add_work(std::min(9 * 2 * per_schedule, std::max(left(), 2 * per_schedule)));
  } else {
    stats.left_out.push_back("zbv");
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
  if (!pool.loop_.have && !pool.vee_.have && !pool.other_.have)
    throw std::invalid_argument("schedule 'auto': no schedule found within memory limit " +
                                num(limit) + " (the smallest any schedule reaches is " +
                                num(floor) + "); raise --mem-limit");

  // 3. Local search on the best of each placement, with what is left.
  const long long refine_left = std::max(budget - pool.work() - extra, budget / 4);
  std::string winner;
  Schedule best;
  Key best_key;
  bool have = false;
  auto take = [&](Pool::Slot& slot, long long work) {
    if (!slot.have) return;
    Schedule s = slot.s;
    const CostModel c = costs_for_cut(costs, s);
    if (work > 0) {
      RefineOptions ro;
      ro.mem_limit = limit;
      ro.max_work = work;
      RefineStats rs;
      Schedule r = refine(s, c, ro, &rs);
      SimOptions quiet;
      quiet.record_timeline = false;
      const SimResult sr = simulate(r, c, quiet);
      const Key k{sr.makespan, sr.span, sr.max_peak_memory};
      if (!slot.key.better_than(k)) {  // the local search shortens the span; keep it unless slower
        s = std::move(r);
        slot.key = k;
      }
      stats.work += std::min(work, static_cast<long long>(rs.evaluations) * action_count(s));
    }
    if (!have || slot.key.better_than(best_key)) {
      have = true;
      best = std::move(s);
      best_key = slot.key;
      winner = slot.from;
      stats.span_before = slot.key.span;
    }
  };
  const bool both = pool.loop_.have && pool.vee_.have;
  take(pool.loop_, both ? refine_left / 2 : refine_left);
  take(pool.vee_, both ? refine_left - refine_left / 2 : refine_left);
  take(pool.other_, 0);
  stats.work += pool.work();
  stats.winner = winner;
  stats.span_after = best_key.span;
  best.name = "auto";
  return best;
}

std::vector<Recommendation> recommend(int p, int m, const CostModel& given, double mem_limit,
                                      std::vector<std::pair<std::string, std::string>>* skipped,
                                      long long max_work) {
  const CostModel costs = costs_per_rank(given, p);
  const Schedule loop_layout = make_loop_layout(p, p, m);
  double one_f1b = 0;
  const CostModel loop_costs = costs_for_cut(costs, loop_layout);
  for (int r = 0; r < p; ++r)
    one_f1b = std::max(one_f1b, loop_costs.stage_mem_b_of(loop_layout, r));
  const double limit = mem_limit > 0 ? mem_limit : p * one_f1b;
  std::vector<Recommendation> rows;
  // One budget for every generator (NOTE [Budget of the memory search]): the
  // fixed ones first as listed, each while its estimate fits; the searches
  // get at most their defaults, at least a share of what is left.
  long long left = std::max<long long>(max_work, 1);
  for (const std::string& n : names()) {
    long long est = estimated_work(n, p, m, 2);
    long long search_work = 0;  // 0: the search's own defaults, as `hp schedule show` runs it
    const long long vee = 2 * 6LL * p * m;  // one V candidate, built and simulated
    if (n == "zb-auto" || n == "zbv") {
      // Where all its candidates fit its own bound and what is left, the
      // search runs as it would alone; else it gets half of what is left (at
      // least one candidate), split with its local search.
      const long long whole = n == "zb-auto" ? 47 * 2 * 3LL * p * m : 9 * vee;
      if (whole <= SearchOptions{}.candidate_work && whole <= left) {
        est = whole;
      } else {
        est = std::max(left / 2, vee);
        search_work = 2 * est;
      }
    } else if (n == "auto") {
      if (est > left) {
        search_work = std::max(left - 2 * vee, vee);
        est = search_work + 2 * vee;
      }
    }
    if (n != "naive" && est > left) {
      if (skipped)
        skipped->emplace_back(n, "left out: building it at p=" + std::to_string(p) +
                                     " m=" + std::to_string(m) +
                                     " would pass recommend's work "
                                     "bound (NOTE [Budget of the memory search])");
      continue;
    }
    left -= est;
    try {
      BuildOptions o;
      o.chunks = 2;
      o.mem_limit = limit;
      o.search_work = search_work;
      std::string cut;
      o.search_note = &cut;
      o.costs = n == "zbv" ? costs_for_cut(costs, make_v_layout(p, m)) : loop_costs;
      if (n == "auto") o.costs = costs;
      Recommendation row;
      row.name = n;
      row.schedule = build(n, p, m, o);
      SimOptions quiet;
      quiet.record_timeline = false;
      row.result = simulate(row.schedule, costs_for_cut(costs, row.schedule), quiet);
      row.fits = row.result.max_peak_memory <= limit + kTol * std::max(1.0, limit);
      rows.push_back(std::move(row));
      if (!cut.empty() && skipped)
        skipped->emplace_back(
            n, "ranked, but its search was cut short by the work bound (" + cut + ")");
    } catch (const std::invalid_argument& e) {
      if (skipped) skipped->emplace_back(n, e.what());
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Recommendation& a, const Recommendation& b) {
    if (a.fits != b.fits) return a.fits;
    const Key ka{a.result.makespan, a.result.span, a.result.max_peak_memory};
    const Key kb{b.result.makespan, b.result.span, b.result.max_peak_memory};
    return ka.better_than(kb);
  });
  return rows;
}

}  // namespace hp::schedule
