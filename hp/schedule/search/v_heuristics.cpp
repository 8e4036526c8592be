// hp/schedule/search/v_heuristics.cpp: the heuristics on the V placement:
// the ZB-V paper's V sweep (NOTE [V sweep]) and the memory-capped list
// scheduler greedy_v.
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <stdexcept>
#include <vector>

#include "hp/schedule/search/heuristics.h"
#include "hp/schedule/search/time_order.h"

namespace hp::schedule {
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

std::vector<Schedule> sweep_v(int p, int m, const CostModel& costs, const VSweepParams& params) {
  std::vector<Schedule> out;
  try {
    VSweep v(p, m, costs, params.mem_limit, params.fill_f, params.fill_b);
    std::vector<double> idle, idle2;
    out.push_back(v.run(&idle, {}));
    out.push_back(v.run(&idle2, idle));
  } catch (const VSweep::Failed&) {
    // these switches do not fit the limit or the costs (a pass that ran is kept)
  }
  return out;
}

// NOTE [Admission on the V]
// A rank holds a microbatch's down-stage activations from its down F until
// its down I, which comes only after the microbatch went down the V, turned,
// came back up through this rank's up stage and went down again. If a rank
// let its memory fill with down forwards, the up forward it waits for could
// find no room, and nothing would ever free any: a deadlock. So a down F
// admits a microbatch only when the rank keeps room for one up forward after
// it (mem + mem_b(down) + mem_b(up) within the limit). After every admission
// one up F fits; up F's run in microbatch order, so the room goes to the
// oldest microbatch without its up F here, and every microbatch older than
// that one already holds its up activations and frees them with its I and W,
// which need no room (mem_w <= mem_b). By induction on age the oldest
// microbatch in flight can always take its next step: any limit that holds
// one microbatch on every rank (both stages) finishes. (Reserving room for
// every admitted microbatch's up F is safe too but left rank 0 with half the
// microbatches in flight: 23 % bubble where V-Min's block has 16 %.)
// NOTE [Blocks as priorities]
// A block's order run as a fixed list waits whenever its next op's input is
// late: under F != B or with transfers V-Min's tight block loses most of its
// advantage (p = 16, m = 128: bubble 7 % at unit costs, 37 % at F = 1.3, W =
// 0.7, comm 0.1). As priorities in the list scheduler, a rank runs the
// earliest-slot op that is ready instead, and the admission rule caps memory
// at any limit, so one block family covers every budget between V-Min's and
// 1F1B's memory and below V-Min's (down to one microbatch per rank). A
// `window` keeps a rank near the block's order (an op runs only within that
// many slots of the earliest next op that memory allows): at p = 8, m = 24,
// F = 1.3, W = 0.7, comm 0.1 under V-Min's memory, window 12 gives a bubble
// rate of 0.35, any ready op 0.41, the fixed order 0.40. A window can leave
// every rank waiting on an op it excludes; the stuck guard then refuses the
// run and the search goes on without it.
Schedule greedy_v(int p, int m, const CostModel& costs, const VGreedyParams& vp) {
  if (p < 1 || m < 1)
    throw std::invalid_argument("greedy V: needs p >= 1 and m >= 1 (got p=" + std::to_string(p) +
                                ", m=" + std::to_string(m) + ")");
  costs.check(2 * p);
  if (static_cast<int>(vp.warmup.size()) != p && vp.priority.empty())
    throw std::invalid_argument("greedy V: warmup needs one entry per rank");
  if (!vp.priority.empty() && static_cast<int>(vp.priority.size()) != p)
    throw std::invalid_argument("greedy V: the priority block needs one entry per rank");
  Schedule s = make_v_layout(p, m);
  s.name = "v-greedy";
  const int S = 2 * p;
  std::vector<double> fc(S), ic(S), wc(S), mb(S), mw(S), hop(S, 0.0);
  double min_cost = kInf, min_hop = kInf;
  for (int st = 0; st < S; ++st) {
    fc[st] = costs.stage_cost(s, Op::F, st);
    ic[st] = costs.stage_cost(s, Op::I, st);
    wc[st] = costs.stage_cost(s, Op::W, st);
    mb[st] = costs.stage_mem_b_of(s, st);
    mw[st] = costs.stage_mem_w_of(s, st);
    if (st + 1 < S) {
      hop[st] = costs.boundary_cost(s, st, st + 1);
      if (st != p - 1) min_hop = std::min(min_hop, hop[st]);
    }
    min_cost = std::min({min_cost, fc[st], ic[st], wc[st]});
  }
  if (!(min_hop < kInf)) min_hop = 0;
  const double slack = kEps * std::max(1.0, vp.mem_limit);
  for (int r = 0; r < p; ++r) {
    const double need = mb[r] + mb[S - 1 - r];
    if (need > vp.mem_limit + slack)
      throw std::invalid_argument("memory limit " + std::to_string(vp.mem_limit) +
                                  " cannot hold one microbatch on rank " + std::to_string(r) +
                                  " of the V (both of its stages: " + std::to_string(need) +
                                  "); raise --mem-limit");
  }
  std::vector<std::vector<double>> f_arr(S, std::vector<double>(m, kInf)), g_arr(f_arr);
  for (int k = 0; k < m; ++k)
    f_arr[0][k] = 0.0;
  std::vector<int> nf(S, 0), ni(S, 0);
  std::vector<double> mem(p, 0.0);
  std::vector<std::deque<std::pair<int, int>>> pend(p);
  std::vector<int> done(p, 0);  // W's run
  // NOTE [Greedy heuristic and time order] (loop_heuristics.cpp)
  detail::RankClocks clocks(p, min_cost + min_hop);
  long long waits = 0;  // consecutive decisions to wait: all ranks blocked means stuck
  for (int r = clocks.next(); r >= 0; r = clocks.next()) {
    const double T = clocks.clock(r);
    if (!(T < kInf))
      throw std::invalid_argument("greedy V: stuck on rank " + std::to_string(r) +
                                  " under memory limit " + std::to_string(vp.mem_limit) +
                                  "; raise --mem-limit");
    const int dn = r, up = S - 1 - r;
    const bool up_room = mem[r] + mb[up] <= vp.mem_limit + slack;
    const bool up_f = nf[up] < nf[dn] && f_arr[up][nf[up]] <= T + kEps && up_room;
    const bool dn_avail = nf[dn] < m && f_arr[dn][nf[dn]] <= T + kEps;
    const bool dn_room = mem[r] + mb[dn] + mb[up] <= vp.mem_limit + slack;
    const bool i_up = ni[up] < nf[up] && g_arr[up][ni[up]] <= T + kEps;
    const bool i_dn = ni[dn] < ni[up] && g_arr[dn][ni[dn]] <= T + kEps;
    const bool in_warmup = !vp.warmup.empty() && nf[dn] - ni[dn] < vp.warmup[r];
    int op = -1;  // 0 down F, 1 up F, 2 up I, 3 down I, 4 W
    if (!vp.priority.empty()) {
      const BlockOffsets& o = vp.priority[r];
      long long best = std::numeric_limits<long long>::max();
      long long first = best;  // the earliest slot among the next ops with room, ready or not
      if (nf[dn] < m && dn_room) first = std::min(first, o.f_down + 6LL * nf[dn]);
      if (nf[up] < nf[dn] && up_room) first = std::min(first, o.f_up + 6LL * nf[up]);
      if (ni[up] < nf[up]) first = std::min(first, o.i_up + 6LL * ni[up]);
      if (ni[dn] < ni[up]) first = std::min(first, o.i_down + 6LL * ni[dn]);
      auto offer = [&](bool ok, int which, int offset, int k) {
        const long long key = offset + 6LL * k;
        if (ok && key < best && key <= first + vp.window) {
          best = key;
          op = which;
        }
      };
      offer(dn_avail && dn_room, 0, o.f_down, nf[dn]);
      offer(up_f, 1, o.f_up, nf[up]);
      offer(i_up, 2, o.i_up, ni[up]);
      offer(i_dn, 3, o.i_down, ni[dn]);
      if (op < 0 && !pend[r].empty()) op = 4;
    } else if (up_f) {
      op = 1;
    } else if (dn_avail && dn_room && in_warmup) {
      op = 0;
    } else if (i_dn || i_up) {
      if (i_dn && i_up)
        op = g_arr[dn][ni[dn]] <= g_arr[up][ni[up]] ? 3 : 2;
      else
        op = i_dn ? 3 : 2;
    } else if (!pend[r].empty()) {
      op = 4;
    } else if (dn_avail && dn_room) {
      op = 0;
    }
    if (op < 0) {
      if (++waits > 64LL * p + 1024)
        throw std::invalid_argument("greedy V: no rank can proceed under memory limit " +
                                    std::to_string(vp.mem_limit) + "; raise --mem-limit");
      double next = kInf;
      if (nf[up] < nf[dn] && up_room) next = std::min(next, f_arr[up][nf[up]]);
      if (nf[dn] < m && dn_room) next = std::min(next, f_arr[dn][nf[dn]]);
      if (ni[up] < nf[up]) next = std::min(next, g_arr[up][ni[up]]);
      if (ni[dn] < ni[up]) next = std::min(next, g_arr[dn][ni[dn]]);
      if (next <= T + kEps) next = kInf;  // known but blocked (memory): wait for others
      clocks.waited(r, next);
      continue;
    }
    waits = 0;
    double end = T;
    if (op == 0) {
      const int k = nf[dn]++;
      end = T + fc[dn];
      mem[r] += mb[dn];
      s.actions[r].push_back(Action::make(Op::F, dn, k));
      f_arr[dn + 1][k] = end + hop[dn];  // dn + 1 is on rank r + 1, or the turn (free)
      if (r + 1 < p) clocks.delivered(r + 1, end + hop[dn]);
    } else if (op == 1) {
      const int k = nf[up]++;
      end = T + fc[up];
      mem[r] += mb[up];
      s.actions[r].push_back(Action::make(Op::F, up, k));
      if (up + 1 < S) {
        f_arr[up + 1][k] = end + hop[up];
        clocks.delivered(r - 1, end + hop[up]);  // stage up + 1 is on rank r - 1
      } else
        g_arr[up][k] = end;  // the loss: the last stage's own gradient
    } else if (op == 2 || op == 3) {
      const int st = op == 2 ? up : dn;
      const int k = ni[st]++;
      end = T + ic[st];
      mem[r] += mw[st] - mb[st];
      s.actions[r].push_back(Action::make(Op::I, st, k));
      pend[r].emplace_back(st, k);
      if (st > 0) {
        g_arr[st - 1][k] = end + hop[st - 1];
        if (st != p) clocks.delivered(st - 1 < p ? st - 1 : S - st, end + hop[st - 1]);
      }
    } else {
      const auto [st, k] = pend[r].front();
      pend[r].pop_front();
      end = T + wc[st];
      mem[r] -= mw[st];
      s.actions[r].push_back(Action::make(Op::W, st, k));
      ++done[r];
    }
    clocks.acted(r, end);
    if (done[r] == 2 * m) clocks.finished(r);
  }
  return s;
}

}  // namespace hp::schedule
