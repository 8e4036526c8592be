// hp/schedule/zb_auto.cpp: the greedy zero-bubble heuristic (time-ordered list
// scheduling with split backward and a memory limit) and the zb-auto search.
#include "hp/schedule/zb_auto.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "hp/schedule/generators.h"

namespace hp::schedule {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;
}  // namespace

// NOTE [Greedy heuristic and time order]
// Ranks are advanced in order of their current time: the rank with the
// smallest clock T decides next. Every op not yet placed starts at or after T,
// so every input arriving at or before T is already known when the rank
// decides. A rank with nothing to do jumps to its next known arrival or to the
// earliest moment another rank could deliver something (its clock + the
// cheapest op + comm), which is always later than T: the loop terminates.
Schedule greedy_zero_bubble(int p, int m, const CostModel& costs, const HeuristicParams& hp) {
  costs.check();
  if (static_cast<int>(hp.warmup.size()) != p || static_cast<int>(hp.max_inflight.size()) != p)
    throw std::invalid_argument(
        "greedy_zero_bubble: warmup and max_inflight need one entry per rank");
  Schedule s = make_loop_layout(p, p, m);
  s.name = "zb-greedy";
  std::vector<double> fc(p), ic(p), wc(p), mb(p), mw(p);
  double min_cost = kInf;
  for (int r = 0; r < p; ++r) {
    fc[r] = costs.stage_cost(s, Op::F, r);
    ic[r] = costs.stage_cost(s, Op::I, r);
    wc[r] = costs.stage_cost(s, Op::W, r);
    mb[r] = costs.stage_mem_b_of(s, r);
    mw[r] = costs.stage_mem_w_of(s, r);
    min_cost = std::min({min_cost, fc[r], ic[r], wc[r]});
    if (mb[r] > hp.mem_limit + kEps)
      throw std::invalid_argument("memory limit " + std::to_string(hp.mem_limit) +
                                  " cannot hold one microbatch on rank " + std::to_string(r) +
                                  " (mem_b " + std::to_string(mb[r]) + "); raise --mem-limit");
  }
  std::vector<std::vector<double>> f_arr(p, std::vector<double>(m, kInf));
  std::vector<std::vector<double>> g_arr(p, std::vector<double>(m, kInf));
  for (int k = 0; k < m; ++k)
    f_arr[0][k] = 0.0;
  std::vector<double> t(p, 0.0), mem(p, 0.0);
  std::vector<int> nf(p, 0), ni(p, 0), nw(p, 0);
  int unfinished = p;
  auto finished = [&](int r) { return nw[r] == m; };

  while (unfinished > 0) {
    int r = -1;
    for (int q = 0; q < p; ++q)
      if (!finished(q) && (r < 0 || t[q] < t[r])) r = q;
    const double T = t[r];
    const bool f_mem_ok =
        nf[r] < m && mem[r] + mb[r] <= hp.mem_limit + kEps && nf[r] - nw[r] < hp.max_inflight[r];
    const bool f_ok = f_mem_ok && f_arr[r][nf[r]] <= T + kEps;
    const bool i_ok = ni[r] < nf[r] && g_arr[r][ni[r]] <= T + kEps;
    const bool w_ok = nw[r] < ni[r];
    Op choice;
    bool act = true;
    if (f_ok && nf[r] - ni[r] < hp.warmup[r]) {
      choice = Op::F;
    } else if (i_ok) {
      choice = Op::I;
    } else if (f_ok) {
      choice = Op::F;
    } else {
      // Nothing on the critical path is ready: W fills the gap, unless an
      // input is known to arrive very soon (w_wait) or there is no W.
      double next = kInf;
      if (f_mem_ok && f_arr[r][nf[r]] > T) next = std::min(next, f_arr[r][nf[r]]);
      if (ni[r] < nf[r] && g_arr[r][ni[r]] > T) next = std::min(next, g_arr[r][ni[r]]);
      if (w_ok && !(next - T < hp.w_wait * wc[r])) {
        choice = Op::W;
      } else {
        act = false;
        double bound = kInf;
        for (int q = 0; q < p; ++q)
          if (q != r && !finished(q)) bound = std::min(bound, t[q] + min_cost + costs.comm);
        double target = std::min(next, bound);
        if (!(target < kInf)) {
          if (w_ok) {
            choice = Op::W;
            act = true;
          } else {
            throw std::invalid_argument(
                "zero-bubble heuristic is stuck on rank " + std::to_string(r) + " (memory limit " +
                std::to_string(hp.mem_limit) + " too small to make progress)");
          }
        } else {
          t[r] = std::max(target, T + kEps);
        }
      }
    }
    if (!act) continue;
    double end = 0.0;
    switch (choice) {
      case Op::F: {
        int k = nf[r]++;
        end = T + fc[r];
        mem[r] += mb[r];
        s.actions[r].push_back(Action::make(Op::F, r, k));
        if (r + 1 < p)
          f_arr[r + 1][k] = end + costs.comm;
        else
          g_arr[r][k] = end;
        break;
      }
      case Op::I: {
        int k = ni[r]++;
        end = T + ic[r];
        mem[r] -= mb[r] - mw[r];
        s.actions[r].push_back(Action::make(Op::I, r, k));
        if (r > 0) g_arr[r - 1][k] = end + costs.comm;
        break;
      }
      default: {
        int k = nw[r]++;
        end = T + wc[r];
        mem[r] -= mw[r];
        s.actions[r].push_back(Action::make(Op::W, r, k));
        if (nw[r] == m) --unfinished;
        break;
      }
    }
    t[r] = end;
  }
  return s;
}

Schedule zb_auto(int p, int m, const CostModel& costs, double mem_limit) {
  costs.check();
  if (p < 1 || m < 1)
    throw std::invalid_argument("schedule 'zb-auto': needs p >= 1 and m >= 1 (got p=" +
                                std::to_string(p) + ", m=" + std::to_string(m) + ")");
  const double limit = mem_limit > 0 ? mem_limit : 2.0 * p * costs.mem_b;
  if (costs.mem_b > limit + kEps)
    throw std::invalid_argument("schedule 'zb-auto': memory limit " + std::to_string(limit) +
                                " is below one microbatch's activations (mem_b " +
                                std::to_string(costs.mem_b) + "); raise --mem-limit");
  SimOptions quiet;
  quiet.record_timeline = false;
  Schedule best;
  double best_bubble = kInf, best_mem = kInf;
  bool have = false;
  auto consider = [&](Schedule cand) {
    SimResult r = simulate(cand, costs, quiet);
    if (r.max_peak_memory > limit + 1e-6) return;
    double bubble = r.span - r.work;
    if (!have || bubble < best_bubble - 1e-9 ||
        (bubble < best_bubble + 1e-9 && r.max_peak_memory < best_mem - 1e-9)) {
      best = std::move(cand);
      best_bubble = bubble;
      best_mem = r.max_peak_memory;
      have = true;
    }
  };
  // Baselines: the hand-made schedules, when they fit.
  for (const char* n : {"zb-h1", "zb-h2", "1f1b"})
    consider(build(n, p, m));
  // The heuristic over warmup depths (a * (p - r) + b, capped by memory) and W policies.
  const int mem_cap = static_cast<int>(std::floor(limit / std::max(costs.mem_b, 1e-12) + kEps));
  for (double a : {1.0, 1.5, 2.0, 3.0}) {
    for (int b : {-1, 0, 1}) {
      for (double w_wait : {0.0, 0.5, 1.0}) {
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
          consider(greedy_zero_bubble(p, m, costs, hp));
        } catch (const std::invalid_argument&) {
          // this setting cannot run under the limit; others may
        }
      }
    }
  }
  if (!have)
    throw std::invalid_argument("schedule 'zb-auto': no schedule found within memory limit " +
                                std::to_string(limit) + "; raise --mem-limit (1F1B needs " +
                                std::to_string(p * costs.mem_b) + ")");
  best.name = "zb-auto";
  return best;
}

}  // namespace hp::schedule
