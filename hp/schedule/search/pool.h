// hp/schedule/search/pool.h: the candidate pool of the one schedule search
// (search.h): each candidate simulated and kept when it fits the memory limit
// and beats the best of its placement under the search's objective; and the
// work bound counted in candidates. Internal to hp/schedule.
#pragma once

#include <algorithm>
#include <string>

#include "hp/schedule/schedule.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule::detail {

// A search's candidate budget (NOTE [Budget of the memory search] in
// search.cpp): take() says whether one more candidate of `each` units fits;
// the first always does. Counts what it refused, for the note.
class WorkBound {
 public:
  WorkBound(long long total, long long each) : left_(total), each_(std::max(each, 1LL)) {}
  bool take() {
    if (taken_ > 0 && left_ < each_) {
      ++refused_;
      return false;
    }
    left_ -= each_;
    ++taken_;
    return true;
  }
  std::string why_short() const {
    return refused_ ? " (the search's work bound left candidates out: NOTE [Budget of the memory "
                      "search])"
                    : "";
  }
  void note(const std::string& who, std::string* out) const {
    if (!refused_ || !out) return;
    *out += (out->empty() ? "" : "; ") + who + ": " + std::to_string(taken_) + " of " +
            std::to_string(taken_ + refused_) + "+ candidates within the work bound";
  }

 private:
  long long left_, each_;
  int taken_ = 0, refused_ = 0;
};

/// Where a candidate runs; the pool keeps the best of each, since the local
/// search improves one schedule of each placement.
enum class Placement { Loop, V, Other };

/// One stage per rank (Loop), the V (rank r holds stages r and 2p-1-r, one
/// route), or any other cut.
Placement placement_of(const Schedule& s);

/// What the objectives compare.
struct Score {
  double makespan = 0, span = 0, mem = 0;
};

/// Whether `a` beats `b` under `objective`. Span: the longest span, ties
/// (1e-9 of a's span) broken by less peak memory. StepTime: the makespan,
/// then the longest span, then peak memory (ties within 1e-9 of b's). Equal
/// scores: false, so the candidate offered first wins.
bool better(Objective objective, const Score& a, const Score& b);

/// The candidates of one search.
class CandidatePool {
 public:
  /// `costs` describe the candidates' own cut, or, with `carry_over`, a
  /// p-stage cut carried over to each candidate's (costs_for_cut, budget.h).
  CandidatePool(Objective objective, const CostModel& costs, bool carry_over, double limit)
      : objective_(objective), costs_(costs), carry_over_(carry_over), limit_(limit) {}

  /// Simulates `s` under its costs; kept as the best of its placement when
  /// its peak memory fits the limit and it beats that placement's best. A
  /// cut the costs cannot describe or an order that deadlocks under them is
  /// no candidate (dropped, not counted).
  void consider(Schedule s, const std::string& from);

  struct Slot {
    bool have = false;
    Score score;
    Schedule s;
    std::string from;  ///< what the candidate came from ("v-min", "zb-auto", ...)
  };
  Slot& slot(Placement p) {
    return p == Placement::Loop ? loop_ : p == Placement::V ? vee_ : other_;
  }
  bool have() const { return loop_.have || vee_.have || other_.have; }

  /// The costs a candidate is simulated under.
  CostModel costs_of(const Schedule& s) const;
  Objective objective() const { return objective_; }
  double limit() const { return limit_; }

  int candidates() const { return candidates_; }  ///< simulated
  int fitting() const { return fitting_; }        ///< of those, within the limit
  long long work() const { return work_; }        ///< simulated actions, plus add_work()'s
  void add_work(long long w) { work_ += w; }

 private:
  Objective objective_;
  CostModel costs_;
  bool carry_over_;
  double limit_;
  Slot loop_, vee_, other_;
  int candidates_ = 0, fitting_ = 0;
  long long work_ = 0;
};

/// The number of actions of a schedule (what simulating it costs).
long long action_count(const Schedule& s);

}  // namespace hp::schedule::detail
