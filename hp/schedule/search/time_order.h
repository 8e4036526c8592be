// hp/schedule/search/time_order.h: the clocks of the time-ordered list schedulers
// (greedy_zero_bubble, greedy_v): which rank decides next, when a rank with
// nothing to do decides again, and who wakes it (NOTE [Greedy heuristic and
// time order] in loop_heuristics.cpp). Internal to hp/schedule.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>
#include <vector>

namespace hp::schedule::detail {

/// Per-rank clocks of a list scheduler whose ranks exchange inputs only with
/// their neighbours r - 1 and r + 1 (the loop and the V both). The rank with
/// the smallest clock decides next (ties: the lowest rank), in O(log p).
class RankClocks {
 public:
  static constexpr double kInf = std::numeric_limits<double>::infinity();

  /// `step`: the least time from one rank starting an op to its output
  /// reaching a neighbour (the cheapest op plus the cheapest transfer).
  RankClocks(int ranks, double step)
      : step_(step), t_(ranks, 0.0), can_act_(ranks, 0.0), waiting_(ranks, 0), done_(ranks, 0) {
    for (int r = 0; r < ranks; ++r)
      order_.insert({0.0, r});
  }

  /// The rank that decides next (its clock is the smallest), or -1 when every
  /// rank is done. Its clock is infinite when every rank left waits with
  /// nothing coming (the caller's stuck case).
  int next() const { return order_.empty() ? -1 : order_.begin()->second; }
  double clock(int r) const { return t_[r]; }

  /// Rank `r` ran an op that ends at `end`: its clock, and the earliest it can
  /// act again.
  void acted(int r, double end) {
    now_ = t_[r];
    waiting_[r] = 0;
    set_clock(r, end);
    set_can_act(r, end);
  }

  /// Rank `r` has nothing to do at its clock T; `arrival` is the earliest input
  /// it knows of after T (infinite: none). It decides again at that arrival or
  /// when a neighbour could first deliver something, at least the next double
  /// after T (a step of 1e-9 is no step once T is past about 1e7); with neither,
  /// it sleeps until a neighbour's change wakes it.
  void waited(int r, double arrival) {
    const double T = t_[r];
    now_ = T;
    double bound = kInf;
    for (int q : {r - 1, r + 1})
      if (q >= 0 && q < static_cast<int>(t_.size()) && !done_[q])
        bound = std::min(bound, can_act_[q] + step_);
    const double target = std::min(arrival, bound);
    waiting_[r] = 1;
    set_clock(r, target < kInf ? std::max(target, std::nextafter(T, kInf)) : kInf);
    set_can_act(r, arrival);
  }

  /// An input for rank `q` arrives at `at`: if it waits, it decides again by
  /// then (a busy rank decides when its op ends).
  void delivered(int q, double at) {
    if (done_[q]) return;
    pull(q, at);
    set_can_act(q, std::min(can_act_[q], std::max(at, t_[q])));
  }

  /// Rank `r` has run its last op: it decides nothing more.
  void finished(int r) {
    order_.erase({t_[r], r});
    done_[r] = 1;
  }

 private:
  void set_clock(int r, double v) {
    if (done_[r]) return;
    order_.erase({t_[r], r});
    t_[r] = v;
    order_.insert({v, r});
  }
  // A waiting rank decides again at `at` if that is sooner (never before the
  // latest decision).
  void pull(int q, double at) {
    const double when = std::max(at, now_);
    if (waiting_[q] && when < t_[q]) set_clock(q, when);
  }
  // A neighbour that waits decides again no later than `r` could deliver to
  // it (the bound waited() used may have shrunk).
  void set_can_act(int r, double v) {
    const bool sooner = v < can_act_[r];
    can_act_[r] = v;
    if (!sooner) return;
    for (int q : {r - 1, r + 1})
      if (q >= 0 && q < static_cast<int>(t_.size()) && !done_[q]) pull(q, v + step_);
  }

  double step_;
  double now_ = 0;  // the clock of the latest decision: nothing decides before it
  std::vector<double> t_, can_act_;
  std::vector<char> waiting_, done_;
  std::set<std::pair<double, int>> order_;
};

}  // namespace hp::schedule::detail
