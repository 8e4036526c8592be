// hp/schedule/budget.cpp: costs of other cuts, the smallest feasible limit,
// the work estimates of the generators, and the ranking behind `hp schedule
// recommend`.
#include "hp/schedule/budget.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "hp/schedule/fuse.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/search/pool.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/vshape.h"

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

namespace {

constexpr double kTol = 1e-9;

int chunks_per_rank(const Schedule& s) {
  if (s.num_chunks % s.num_ranks != 0)
    throw std::invalid_argument(
        "costs for schedule '" + s.name + "': " + std::to_string(s.num_chunks) +
        " chunks do not divide over " + std::to_string(s.num_ranks) + " ranks");
  return s.num_chunks / s.num_ranks;
}

}  // namespace

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
  // The overlapped variants: their base, then fuse_pairs' simulations (at
  // most kFuseWork, a few dozen of the base's in the tests' sizes).
  if (is_fb_variant(n)) {
    const long long base = estimated_work(n.substr(0, n.size() - 3), p, m, chunks);
    return base + std::min<long long>(kFuseWork, 32 * base);
  }
  const long long loop = 2 * 3LL * p * m, vee = 2 * 6LL * p * m;  // built and simulated
  if (n == "zb-auto" || n == "zbv-auto") return kCandidateWork + kRefineWork;
  if (n == "auto") return kAutoWork + 2 * vee;
  // The hand-made ZB-V: at least 2p - 1 microbatches' loop on every rank.
  if (n == "zbv") return vee + 6LL * p * std::max(2 * p - 1, m) / 64;
  if (n == "v-min") return v_block_work(v_block_offsets(VBlock::Min, p), p, m);
  if (n == "v-half") return v_block_work(v_block_offsets(VBlock::Half, p), p, m);
  if (n == "v-zb") return v_block_work(v_block_offsets(VBlock::ZB, p), p, m);
  if (n.rfind("interleaved", 0) == 0) return loop * std::max(1, chunks);
  if (n == "dualpipe" || n == "dualpipev") return vee;
  if (n == "zb-h1" || n == "zb-h2") return 2 * loop;  // the list scheduler: O(log p) a decision
  return loop;
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
    if (is_fb_variant(n)) {
      if (skipped)
        skipped->emplace_back(n,
                              "left out: its pairs pay off only when run overlapped "
                              "(hp schedule show " +
                                  n + " --fb-overlap)");
      continue;
    }
    long long est = estimated_work(n, p, m, 2);
    long long search_work = 0;  // 0: the search's own defaults, as `hp schedule show` runs it
    const long long vee = 2 * 6LL * p * m;  // one V candidate, built and simulated
    if (n == "zb-auto" || n == "zbv-auto") {
      // Where all its candidates fit its own bound and what is left, the
      // search runs as it would alone; else it gets half of what is left (at
      // least one candidate), split with its local search.
      const long long whole = n == "zb-auto" ? 47 * 2 * 3LL * p * m : 9 * vee;
      if (whole <= kCandidateWork && whole <= left) {
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
      o.costs = n == "zbv-auto" ? costs_for_cut(costs, make_v_layout(p, m)) : loop_costs;
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
    return detail::better(Objective::StepTime,
                          {a.result.makespan, a.result.span, a.result.max_peak_memory},
                          {b.result.makespan, b.result.span, b.result.max_peak_memory});
  });
  return rows;
}

}  // namespace hp::schedule
