// The candidates of the schedule searches (zb_auto.cpp, v_sweep.cpp): a work
// budget in candidates, the best one kept, and the V sweep's candidates.
#pragma once

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule::detail {

// A search's candidate budget (NOTE [Budget of the memory search] in
// budget.cpp): take() says whether one more candidate of `each` units fits;
// the first always does. Counts what it refused, for the note.
class Budget {
 public:
  Budget(long long total, long long each) : left_(total), each_(std::max(each, 1LL)) {}
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

// Keeps the candidate with the smallest longest-rank span within the memory
// limit (ties: smaller peak memory); the first one wins exact ties.
class Best {
 public:
  Best(const CostModel& costs, double limit) : costs_(costs), limit_(limit) {}
  void consider(Schedule cand) {
    SimOptions quiet;
    quiet.record_timeline = false;
    SimResult r;
    try {
      r = simulate(cand, costs_, quiet);
    } catch (const std::runtime_error&) {
      return;  // a heuristic's order that deadlocks under these costs: not a candidate
    }
    if (r.max_peak_memory > limit_ + 1e-9 * std::max(1.0, limit_)) return;
    const double tol = 1e-9 * std::max(1.0, r.span);
    if (!have_ || r.span < span_ - tol ||
        (r.span < span_ + tol && r.max_peak_memory < mem_ - tol)) {
      best_ = std::move(cand);
      span_ = r.span;
      mem_ = r.max_peak_memory;
      have_ = true;
    }
  }
  bool have() const { return have_; }
  Schedule& schedule() { return best_; }

 private:
  const CostModel& costs_;
  double limit_;
  Schedule best_;
  double span_ = std::numeric_limits<double>::infinity(),
         mem_ = std::numeric_limits<double>::infinity();
  bool have_ = false;
};

/// The V sweep with both weight-gradient switches, each run twice, every
/// result offered to `best` (NOTE [V sweep] in v_sweep.cpp).
void consider_v_sweeps(int p, int m, const CostModel& costs, double limit, Best& best,
                       Budget& work);

}  // namespace hp::schedule::detail
