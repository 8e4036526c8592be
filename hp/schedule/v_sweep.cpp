// The ZB-V paper's V sweep (NOTE [V sweep]), one source of the searches'
// candidates (search_candidates.h).
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <stdexcept>
#include <vector>

#include "hp/schedule/generators.h"
#include "hp/schedule/search_candidates.h"
#include "hp/schedule/time_order.h"

namespace hp::schedule::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = 1e-9;

// NOTE [V sweep]
// The ZB-V paper's heuristic for the V placement, which sizes the warmup by
// the first microbatch's round trip, transfers included. Rank r holds the
// down stage r and the up stage 2p-1-r. Warmup: a forward down the V for
// microbatch 0; then, from the bottom rank up, rank r runs extra down
// forwards (each also given to the ranks above it, which feed it) while they
// end before the up forward of microbatch 0 reaches it and the memory of its
// remaining warmup fits; then the up forward. Then every rank catches up with
// the rank above (as many forwards, more up forwards). Then 2m rounds: each
// rank runs one input gradient (the up stage's unless the down stage is
// behind and its input is there; down ranks bottom up first, then up ranks
// top down), then at most one forward (up when its input is there, else
// down); weight gradients fill the wait for an input, free memory, and
// bridge a wait that would make this rank the idlest. A second pass with
// every rank allowed the idle the first pass gave the idlest one keeps the
// better result.
class VSweep {
 public:
  struct Failed {};  // an input the rules expected is missing: skip this setting

  VSweep(int p, int m, const CostModel& c, double limit, bool fill_f, bool fill_b)
      : p_(p), m_(m), limit_(limit), fill_f_(fill_f), fill_b_(fill_b), c_(c) {}

  Schedule run(std::vector<double>* idle_out, const std::vector<double>& approved) {
    s_ = make_v_layout(p_, m_);
    const int S = 2 * p_;
    f_end_.assign(static_cast<size_t>(S) * m_, -1.0);
    i_end_.assign(static_cast<size_t>(S) * m_, -1.0);
    nf_.assign(S, 0), ni_.assign(S, 0);
    clock_.assign(p_, 0.0), mem_.assign(p_, 0.0), idle_.assign(p_, 0.0);
    started_.assign(p_, 0);
    pending_w_.assign(p_, {});
    approved_ = approved;
    max_approved_ = approved.empty() ? -1.0 : *std::max_element(approved.begin(), approved.end());
    warmup();
    for (int round = 0; round < 2 * m_; ++round) {
      backward_round();
      forward_round();
    }
    for (int r = 0; r < p_; ++r)
      while (!pending_w_[r].empty())
        place_w(r);
    *idle_out = idle_;
    s_.name = "zbv-sweep";
    return std::move(s_);
  }

 private:
  int dn(int r) const { return r; }
  int up(int r) const { return 2 * p_ - 1 - r; }
  double& f_end(int st, int k) { return f_end_[static_cast<size_t>(st) * m_ + k]; }
  double& i_end(int st, int k) { return i_end_[static_cast<size_t>(st) * m_ + k]; }
  bool over(double mem) const { return mem > limit_ + kEps * std::max(1.0, limit_); }
  double allowance(int r) const {
    double v = *std::max_element(idle_.begin(), idle_.end());
    if (!approved_.empty()) v = std::max(v, max_approved_ - approved_[r]);
    return v - idle_[r];
  }
  double comm(int upstream, int downstream) const {
    return c_.boundary_cost(s_, upstream, downstream);
  }

  void start_op(int r, double start, double cost) {
    if (started_[r]) idle_[r] += start - clock_[r];
    started_[r] = 1;
    clock_[r] = start + cost;
  }

  void place_f(int r, int st) {
    if (nf_[st] >= m_) throw Failed{};
    const int k = nf_[st]++;
    double start = clock_[r];
    if (st > 0) {
      const double e = f_end(st - 1, k);
      if (e < 0) throw Failed{};
      start = std::max(start, e + comm(st - 1, st));
    }
    if (over(mem_[r] + c_.stage_mem_b_of(s_, st))) throw Failed{};
    start_op(r, start, c_.stage_cost(s_, Op::F, st));
    f_end(st, k) = clock_[r];
    mem_[r] += c_.stage_mem_b_of(s_, st);
    s_.actions[r].push_back(Action::make(Op::F, st, k));
  }

  void place_i(int r, int st) {
    if (ni_[st] >= m_ || ni_[st] >= nf_[st]) throw Failed{};
    const int k = ni_[st]++;
    double start = clock_[r];
    if (st + 1 < 2 * p_) {
      const double e = i_end(st + 1, k);
      if (e < 0) throw Failed{};
      start = std::max(start, e + comm(st, st + 1));
    }
    const double dmem = c_.stage_mem_w_of(s_, st) - c_.stage_mem_b_of(s_, st);
    if (over(mem_[r] + dmem)) throw Failed{};
    start_op(r, start, c_.stage_cost(s_, Op::I, st));
    i_end(st, k) = clock_[r];
    mem_[r] += dmem;
    s_.actions[r].push_back(Action::make(Op::I, st, k));
    pending_w_[r].push_back({st, k});
  }

  void place_w(int r) {
    const auto [st, k] = pending_w_[r].front();
    pending_w_[r].pop_front();
    start_op(r, clock_[r], c_.stage_cost(s_, Op::W, st));
    mem_[r] -= c_.stage_mem_w_of(s_, st);
    s_.actions[r].push_back(Action::make(Op::W, st, k));
  }

  double next_w_cost(int r) const { return c_.stage_cost(s_, Op::W, pending_w_[r].front().first); }

  // Weight gradients in the wait for an input that arrives at `arrival`
  // (negative: unknown yet, no fill); `bridge` allows one more W over a gap
  // that would make this rank the idlest.
  void fill_wait(int r, double arrival, bool bridge) {
    if (arrival < 0) return;
    while (!pending_w_[r].empty() && arrival >= clock_[r] + next_w_cost(r))
      place_w(r);
    if (!pending_w_[r].empty() && arrival - clock_[r] > allowance(r) && bridge) place_w(r);
  }

  void warmup() {
    for (int r = 0; r < p_; ++r)
      place_f(r, dn(r));
    for (int r = p_ - 1; r >= 0; --r) {
      if (r + 1 < p_) {
        const int from = up(r) - 1;  // the up stage before this rank's, on rank r + 1
        const double arrival = f_end(from, 0) + comm(from, up(r));
        const double reserve = (2.0 + 2.0 * r) * c_.stage_mem_b_of(s_, dn(r));
        while (!over(mem_[r] + reserve) && clock_[r] + c_.stage_cost(s_, Op::F, dn(r)) <= arrival &&
               nf_[dn(r)] < m_ - r)
          for (int q = 0; q <= r; ++q)
            place_f(q, dn(q));
      }
      place_f(r, up(r));
    }
    // Each rank catches up with the one above: as many forwards in all, and
    // more up forwards while the rank above has some to give.
    int leg = 0;
    for (int r = 1; r < p_; ++r) {
      auto total = [&](int q) { return nf_[dn(q)] + nf_[up(q)]; };
      while (total(r) < total(r - 1) || (nf_[up(r)] <= nf_[up(r - 1)] && nf_[up(r - 1)] < m_)) {
        for (int q = p_ - 1; q >= r; --q) {
          const int st = leg == 0 ? dn(q) : up(q);
          if (nf_[st] < m_) place_f(q, st);
        }
        leg = 1 - leg;
      }
    }
  }

  void backward_round() {
    for (int r = 0; r < p_; ++r)
      while (!pending_w_[r].empty() &&
             over(mem_[r] + c_.stage_mem_w_of(s_, up(r)) - c_.stage_mem_b_of(s_, up(r))))
        place_w(r);
    std::vector<int> down_ranks, up_ranks;
    for (int r = 0; r < p_; ++r) {
      bool down = false;
      if (ni_[dn(r)] >= ni_[up(r)]) {
        down = false;
      } else if (r == p_ - 1) {
        down = true;
      } else {
        down = i_end(dn(r) + 1, ni_[dn(r)]) >= 0 || ni_[up(r)] >= m_;
      }
      (down ? down_ranks : up_ranks).push_back(r);
    }
    for (auto it = down_ranks.rbegin(); it != down_ranks.rend(); ++it) {
      const int r = *it;
      const double arrival =
          r + 1 < p_ ? arrival_of(i_end(dn(r) + 1, ni_[dn(r)]), dn(r), dn(r) + 1) : -1.0;
      fill_wait(r, arrival, fill_b_);
      place_i(r, dn(r));
    }
    for (int r : up_ranks) {
      const double arrival =
          r > 0 ? arrival_of(i_end(up(r) + 1, ni_[up(r)]), up(r), up(r) + 1) : -1.0;
      fill_wait(r, arrival, true);
      place_i(r, up(r));
    }
  }

  double arrival_of(double end, int upstream, int downstream) const {
    return end < 0 ? -1.0 : end + comm(upstream, downstream);
  }

  void forward_round() {
    for (int r = 0; r < p_; ++r) {
      if (nf_[up(r)] >= m_) continue;
      int st = -1;
      if (nf_[up(r)] >= nf_[dn(r)]) {
        st = dn(r);
      } else if (r == p_ - 1) {
        st = up(r);
      } else if (f_end(up(r) - 1, nf_[up(r)]) >= 0) {
        st = up(r);
      } else if (nf_[dn(r)] < m_ && (r == 0 || f_end(dn(r) - 1, nf_[dn(r)]) >= 0)) {
        st = dn(r);
      }
      if (st < 0) continue;
      while (over(mem_[r] + c_.stage_mem_b_of(s_, st))) {
        if (pending_w_[r].empty()) throw Failed{};
        place_w(r);
      }
      const int from = st - 1;
      const bool has_input = st > 0 && s_.stage_rank[from] != r;
      const double arrival = has_input ? arrival_of(f_end(from, nf_[st]), from, st) : -1.0;
      fill_wait(r, arrival, fill_f_);
      place_f(r, st);
    }
  }

  int p_, m_;
  double limit_;
  bool fill_f_, fill_b_;
  const CostModel& c_;
  Schedule s_;
  std::vector<double> f_end_, i_end_;
  std::vector<int> nf_, ni_;
  std::vector<double> clock_, mem_, idle_;
  std::vector<char> started_;
  std::vector<std::deque<std::pair<int, int>>> pending_w_;
  std::vector<double> approved_;
  double max_approved_ = -1;
};

}  // namespace

// The V sweep with both W switches, each run twice (NOTE [V sweep]).
void consider_v_sweeps(int p, int m, const CostModel& costs, double limit, Best& best,
                       Budget& work) {
  for (bool fill_b : {true, false}) {
    for (bool fill_f : {true, false}) {
      if (!work.take() || !work.take()) return;  // two runs
      try {
        VSweep v(p, m, costs, limit, fill_f, fill_b);
        std::vector<double> idle, idle2;
        Schedule first = v.run(&idle, {});
        best.consider(first);
        Schedule second = v.run(&idle2, idle);
        best.consider(second);
      } catch (const VSweep::Failed&) {
        // these switches do not fit the limit or the costs; others may
      }
    }
  }
}

}  // namespace hp::schedule::detail
