// hp/schedule/search/loop_heuristics.cpp: the heuristics on the loop
// placement: time-ordered list scheduling and the Zero Bubble paper's stage
// sweep.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "hp/schedule/search/heuristics.h"
#include "hp/schedule/search/time_order.h"

namespace hp::schedule {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;
}  // namespace

// NOTE [Greedy heuristic and time order]
// Ranks are advanced in order of their current time: the rank with the
// smallest clock T decides next. Every op not yet placed starts at or after T,
// so every input arriving at or before T is already known when the rank
// decides. Inputs come only from the neighbours (r - 1 and r + 1, on the loop
// and on the V alike), so a rank with nothing to do decides again at its next
// known arrival or at the earliest a neighbour could deliver something: the
// earliest that neighbour can act (the end of its op; while it waits, its own
// next known arrival) plus the cheapest op and transfer; a neighbour that
// could act sooner, or an input that arrives, pulls it in again; with nothing
// known it sleeps until then (detail::RankClocks, time_order.h). When every
// rank left sleeps, the heuristic is stuck and says so. Three faults of the
// earlier form, which bounded a waiting rank by every other rank's clock:
// `tune`, `recommend` and `memory-table` never finished when costs spanned
// about 1e15 (F 1e12 on one stage, 1e-3 on the others), as idle ranks
// leapfrogged one another in steps of the cheapest op across a 1e12 wait,
// about 1e15 decisions; the step "at least T + 1e-9" is no step at all once T
// is past about 1e7 (a double's spacing there is larger), so a rank could
// wait at the same T forever (now: at least the next double after T); and at
// p = 4096 ranks every rank waited once per rank ahead of it in the fill, p^2
// waits of O(p) each (now: a few waits per op, each O(log p)).
Schedule greedy_zero_bubble(int p, int m, const CostModel& costs, const HeuristicParams& hp) {
  costs.check(p);
  if (static_cast<int>(hp.warmup.size()) != p || static_cast<int>(hp.max_inflight.size()) != p)
    throw std::invalid_argument(
        "greedy_zero_bubble: warmup and max_inflight need one entry per rank");
  Schedule s = make_loop_layout(p, p, m);
  s.name = "zb-greedy";
  std::vector<double> fc(p), ic(p), wc(p), mb(p), mw(p), comm(p, 0.0);
  double min_cost = kInf, min_comm = kInf;
  for (int r = 0; r < p; ++r) {
    if (r + 1 < p) {
      comm[r] = costs.boundary_cost(s, r, r + 1);
      min_comm = std::min(min_comm, comm[r]);
    }
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
  std::vector<double> mem(p, 0.0);
  std::vector<int> nf(p, 0), ni(p, 0), nw(p, 0);
  detail::RankClocks clocks(p, min_cost + (p > 1 ? min_comm : 0.0));

  for (int r = clocks.next(); r >= 0; r = clocks.next()) {
    const double T = clocks.clock(r);
    if (!(T < kInf))
      throw std::invalid_argument("zero-bubble heuristic is stuck on rank " + std::to_string(r) +
                                  " (memory limit " + std::to_string(hp.mem_limit) +
                                  " too small to make progress)");
    const bool f_mem_ok =
        nf[r] < m && mem[r] + mb[r] <= hp.mem_limit + kEps && nf[r] - nw[r] < hp.max_inflight[r];
    const bool f_ok = f_mem_ok && f_arr[r][nf[r]] <= T + kEps;
    const bool i_ok = ni[r] < nf[r] && g_arr[r][ni[r]] <= T + kEps;
    const bool w_ok = nw[r] < ni[r];
    Op choice = Op::W;
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
      if (!w_ok || next - T < hp.w_wait * wc[r]) {
        clocks.waited(r, next);
        continue;
      }
    }
    double end = 0.0;
    switch (choice) {
      case Op::F: {
        int k = nf[r]++;
        end = T + fc[r];
        mem[r] += mb[r];
        s.actions[r].push_back(Action::make(Op::F, r, k));
        if (r + 1 < p) {
          f_arr[r + 1][k] = end + comm[r];
          clocks.delivered(r + 1, end + comm[r]);
        } else {
          g_arr[r][k] = end;
        }
        break;
      }
      case Op::I: {
        int k = ni[r]++;
        end = T + ic[r];
        mem[r] -= mb[r] - mw[r];
        s.actions[r].push_back(Action::make(Op::I, r, k));
        if (r > 0) {
          g_arr[r - 1][k] = end + comm[r - 1];
          clocks.delivered(r - 1, end + comm[r - 1]);
        }
        break;
      }
      default: {
        int k = nw[r]++;
        end = T + wc[r];
        mem[r] -= mw[r];
        s.actions[r].push_back(Action::make(Op::W, r, k));
        break;
      }
    }
    clocks.acted(r, end);
    if (nw[r] == m) clocks.finished(r);
  }
  return s;
}

namespace {

// NOTE [Stage sweep]
// The Zero Bubble paper's heuristic (Section 3.1), in rounds: round k gives
// each stage, top down, at most one more forward (a stage never has fewer
// forwards than the stage after it), then each stage, bottom up, the input
// gradient of microbatch k. Before an op that waits for an input, weight
// gradients fill the wait: every W that ends before the input arrives, and
// one more when the remaining gap would make this stage the idlest so far
// (or always, with fill_small_gaps). Weight gradients also run whenever the
// next op would pass the memory limit. Round 0 is the warmup: each stage runs
// as many forwards as end before the first input gradient reaches it (an
// estimate made bottom up), fewer than the stage above. Idle time is counted
// from a stage's first forward, as the paper's bubble rate counts it.
class Sweep {
 public:
  Sweep(int p, int m, const CostModel& c, const SweepParams& sp)
      : p_(p), m_(m), sp_(sp), s_(make_loop_layout(p, p, m)) {
    fc_.resize(p), ic_.resize(p), wc_.resize(p), mb_.resize(p), mw_.resize(p);
    comm_.assign(p, 0.0);
    for (int j = 0; j < p; ++j) {
      fc_[j] = c.stage_cost(s_, Op::F, j);
      ic_[j] = c.stage_cost(s_, Op::I, j);
      wc_[j] = c.stage_cost(s_, Op::W, j);
      mb_[j] = c.stage_mem_b_of(s_, j);
      mw_[j] = c.stage_mem_w_of(s_, j);
      if (j + 1 < p) comm_[j] = c.boundary_cost(s_, j, j + 1);
    }
    nf_.assign(p, 0), ni_.assign(p, 0), nw_.assign(p, 0);
    clock_.assign(p, 0.0), mem_.assign(p, 0.0), idle_.assign(p, 0.0);
    f_end_.assign(static_cast<size_t>(p) * m, 0.0);
    i_end_.assign(static_cast<size_t>(p) * m, 0.0);
  }

  Schedule run() {
    warmup();
    for (int k = 1; k < m_; ++k)
      round(k);
    for (int j = 0; j < p_; ++j)
      while (nw_[j] < m_)
        place(j, Op::W);
    s_.name = "zb-sweep";
    return std::move(s_);
  }

 private:
  double& f_end(int j, int k) { return f_end_[static_cast<size_t>(j) * m_ + k]; }
  double& i_end(int j, int k) { return i_end_[static_cast<size_t>(j) * m_ + k]; }
  double max_idle() const { return *std::max_element(idle_.begin(), idle_.end()); }
  bool over(double mem) const { return mem > sp_.mem_limit + kEps * std::max(1.0, sp_.mem_limit); }

  void place(int j, Op op) {
    double start = clock_[j];
    int k = 0;
    if (op == Op::F) {
      k = nf_[j]++;
      if (j > 0) start = std::max(start, f_end(j - 1, k) + comm_[j - 1]);
    } else if (op == Op::I) {
      k = ni_[j]++;
      if (j + 1 < p_) start = std::max(start, i_end(j + 1, k) + comm_[j]);
    } else {
      k = nw_[j]++;
    }
    if (op != Op::F || k > 0) idle_[j] += start - clock_[j];
    const double cost = op == Op::F ? fc_[j] : op == Op::I ? ic_[j] : wc_[j];
    clock_[j] = start + cost;
    if (op == Op::F) {
      f_end(j, k) = clock_[j];
      mem_[j] += mb_[j];
    } else if (op == Op::I) {
      i_end(j, k) = clock_[j];
      mem_[j] += mw_[j] - mb_[j];
    } else {
      mem_[j] -= mw_[j];
    }
    s_.actions[j].push_back(Action::make(op, j, k));
  }

  // Weight gradients until `need` more memory fits under the limit.
  void make_room(int j, double need) {
    while (over(mem_[j] + need)) {
      if (nw_[j] >= ni_[j])
        throw std::invalid_argument("stage sweep: memory limit " + std::to_string(sp_.mem_limit) +
                                    " too small on rank " + std::to_string(j) +
                                    "; raise --mem-limit");
      place(j, Op::W);
    }
  }

  // Weight gradients in the wait for an input arriving at `arrival`.
  void fill_wait(int j, double arrival) {
    while (nw_[j] < ni_[j] && clock_[j] + wc_[j] <= arrival)
      place(j, Op::W);
    if (nw_[j] < ni_[j] && clock_[j] < arrival) {
      const bool idlest = arrival - clock_[j] > max_idle() - idle_[j];
      if (idlest || sp_.fill_small_gaps) place(j, Op::W);
    }
  }

  void warmup() {
    for (int j = 0; j < p_; ++j)
      place(j, Op::F);
    std::vector<int> extra(p_, 0);
    double back = f_end(p_ - 1, 0) + ic_[p_ - 1];  // the last stage's first I ends
    for (int j = p_ - 2; j >= 0; --j) {
      const double arrival = back + comm_[j];
      double t = clock_[j], mem = mem_[j];
      while (nf_[j] + extra[j] < m_ && !over(mem + mb_[j])) {
        if (sp_.warmup_overrun ? t + fc_[j] > arrival : t >= arrival) break;
        mem += mb_[j];
        t += fc_[j];
        ++extra[j];
      }
      back = std::max(t, arrival) + ic_[j];
    }
    // A stage never runs more warmup forwards than the stage above it (it
    // could not get their inputs before that stage's first I), and fewer
    // unless it would take every microbatch.
    for (int j = 1; j < p_; ++j)
      while (extra[j] > 0 &&
             (extra[j] > extra[j - 1] || (extra[j] == extra[j - 1] && nf_[j] + extra[j] < m_)))
        --extra[j];
    for (int j = 0; j < p_; ++j)
      for (int e = 0; e < extra[j]; ++e)
        place(j, Op::F);
    for (int j = p_ - 1; j >= 0; --j)
      place(j, Op::I);
  }

  void round(int k) {
    std::vector<char> want(p_, 0);
    for (int j = 0; j < p_; ++j) {
      if (nf_[j] >= m_) continue;
      want[j] = 1;
      if (!sp_.hold_back_f || j + 1 >= p_ || nf_[j] < nf_[j + 1] + 2) continue;
      // The next stage is two forwards behind: run this F only if it (and the
      // W's it needs for memory) ends before the next stage could use it.
      const double next_ready = clock_[j + 1] + fc_[j + 1] + ic_[j + 1] + comm_[j];
      if (clock_[j] >= next_ready) {
        want[j] = 0;
        continue;
      }
      double w_time = 0, mem = mem_[j] + mb_[j];
      for (int n = nw_[j]; over(mem) && n < ni_[j]; ++n) {
        w_time += wc_[j];
        mem -= mw_[j];
      }
      if (clock_[j] + fc_[j] + w_time <= next_ready) continue;
      if (next_ready - clock_[j] <= max_idle() - idle_[j]) want[j] = 0;
    }
    for (int j = p_ - 2; j >= 0; --j)
      want[j] = std::min(want[j], want[j + 1]);
    for (int j = 0; j < p_; ++j) {
      if (!want[j]) continue;
      make_room(j, mb_[j]);
      if (j > 0) fill_wait(j, f_end(j - 1, nf_[j]) + comm_[j - 1]);
      place(j, Op::F);
    }
    for (int j = p_ - 1; j >= 0; --j) {
      make_room(j, mw_[j] - mb_[j]);
      if (j + 1 < p_) fill_wait(j, i_end(j + 1, k) + comm_[j]);
      if (j == 0 && nf_[0] == m_)
        while (nw_[0] < ni_[0])
          place(0, Op::W);
      place(j, Op::I);
    }
  }

  int p_, m_;
  SweepParams sp_;
  Schedule s_;
  std::vector<double> fc_, ic_, wc_, mb_, mw_, comm_;
  std::vector<int> nf_, ni_, nw_;
  std::vector<double> clock_, mem_, idle_, f_end_, i_end_;
};

}  // namespace

Schedule sweep_zero_bubble(int p, int m, const CostModel& costs, const SweepParams& params) {
  costs.check(p);
  if (p < 1 || m < 1)
    throw std::invalid_argument("stage sweep: needs p >= 1 and m >= 1 (got p=" + std::to_string(p) +
                                ", m=" + std::to_string(m) + ")");
  return Sweep(p, m, costs, params).run();
}

}  // namespace hp::schedule
