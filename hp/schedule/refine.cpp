// hp/schedule/refine.cpp: the local search of refine(): a flat, allocation-free
// evaluation of per-rank orders (times, spans, peak memory, deadlock) and the
// moves that close idle gaps on the longest ranks.
#include "hp/schedule/refine.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace hp::schedule {

// NOTE [Deterministic search]
// Every rank of a training run builds its own copy of the schedule, so a
// search must return the same lists on every rank and every machine: budgets
// are counted in simulated actions, never in seconds, and every choice is made
// in a fixed order with ties broken by position. A wall-clock limit would let
// a busy rank stop earlier than the others and run a different schedule.

namespace {

constexpr double kEps = 1e-9;

// One compute action of the schedule, with its inputs resolved to action ids.
struct Node {
  Op op = Op::F;
  int rank = 0;
  double cost = 0;
  double dmem = 0;                  // change of the rank's activation memory
  int dep[2] = {-1, -1};            // actions whose output this one reads
  double hop[2] = {0, 0};           // transfer latency after each dep
  int local_dep = -1;               // the same (stage, mb)'s earlier op on this rank (F->I->W)
  int consumer_rank[2] = {-1, -1};  // ranks to wake when this one ends
  bool first_f_candidate = false;
};

struct Score {
  double max_span = 0;
  double sum_span = 0;
  bool better_than(const Score& o) const {
    const double tol = kEps * std::max(1.0, o.max_span);
    if (max_span < o.max_span - tol) return true;
    if (max_span > o.max_span + tol) return false;
    return sum_span < o.sum_span - tol;
  }
};

class Search {
 public:
  Search(const Schedule& s, const CostModel& c, const RefineOptions& o)
      : s_(s), limit_(o.mem_limit), budget_(o.max_work) {
    const int S = s.num_stages, m = s.num_microbatches;
    p_ = s.num_ranks;
    auto key = [m](int st, int mb) { return static_cast<size_t>(st) * m + mb; };
    std::vector<int> f_id(static_cast<size_t>(S) * m, -1), i_id(f_id), w_id(f_id);
    order_.assign(p_, {});
    for (int r = 0; r < p_; ++r)
      for (const Action& a : s.actions[r]) {
        Node n;
        n.op = a.op;
        n.rank = r;
        n.cost = c.cost(s, a);
        const double mb_mem = c.stage_mem_b_of(s, a.stage), mw_mem = c.stage_mem_w_of(s, a.stage);
        const int id = static_cast<int>(nodes_.size());
        if (a.op == Op::F) {
          n.dmem = mb_mem;
          f_id[key(a.stage, a.microbatch)] = id;
        } else if (a.op == Op::I) {
          n.dmem = mw_mem - mb_mem;
          i_id[key(a.stage, a.microbatch)] = id;
        } else {
          n.dmem = -mw_mem;
          w_id[key(a.stage, a.microbatch)] = id;
        }
        nodes_.push_back(n);
        stage_.push_back(a.stage);
        mb_.push_back(a.microbatch);
        order_[r].push_back(id);
      }
    for (size_t id = 0; id < nodes_.size(); ++id) {
      Node& n = nodes_[id];
      const int st = stage_[id], mb = mb_[id];
      if (n.op == Op::F) {
        n.first_f_candidate = true;
        const int prev = s.prev_stage(st, mb);
        if (prev >= 0) {
          n.dep[0] = f_id[key(prev, mb)];
          n.hop[0] = c.boundary_cost(s, prev, st);
        }
      } else if (n.op == Op::I) {
        n.dep[0] = n.local_dep = f_id[key(st, mb)];
        const int next = s.next_stage(st, mb);
        if (next >= 0) {
          n.dep[1] = i_id[key(next, mb)];
          n.hop[1] = c.boundary_cost(s, st, next);
        }
      } else {
        n.dep[0] = n.local_dep = i_id[key(st, mb)];
      }
      for (int d = 0; d < 2; ++d) {
        const int src = n.dep[d];
        if (src < 0) continue;
        Node& from = nodes_[src];
        int slot = from.consumer_rank[0] < 0 ? 0 : 1;
        from.consumer_rank[slot] = n.rank;
      }
    }
    for (const Node& n : nodes_)
      busy_total_ += n.cost;
    end_.assign(nodes_.size(), -1.0);
    span_.assign(p_, 0.0);
    peak_.assign(p_, 0.0);
  }

  // True when every input of `id` exists (the schedule is complete); refine
  // gives up on schedules it cannot resolve.
  bool complete() const {
    for (const Node& n : nodes_)
      if (n.op != Op::F && n.dep[0] < 0) return false;
    for (size_t id = 0; id < nodes_.size(); ++id) {
      const Node& n = nodes_[id];
      if (n.op == Op::F && s_.prev_stage(stage_[id], mb_[id]) >= 0 && n.dep[0] < 0) return false;
      if (n.op == Op::I && s_.next_stage(stage_[id], mb_[id]) >= 0 && n.dep[1] < 0) return false;
    }
    return true;
  }

  // Simulates the current orders; false on a deadlock or a memory overflow.
  bool evaluate(Score& score) {
    budget_ -= static_cast<long long>(nodes_.size());
    ++evaluations_;
    std::fill(end_.begin(), end_.end(), -1.0);
    pc_.assign(p_, 0);
    std::vector<double>& free_at = free_at_;
    free_at.assign(p_, 0.0);
    first_.assign(p_, -1.0);
    mem_.assign(p_, 0.0);
    std::fill(peak_.begin(), peak_.end(), 0.0);
    work_.clear();
    queued_.assign(p_, 1);
    for (int r = p_ - 1; r >= 0; --r)
      work_.push_back(r);
    size_t done = 0;
    while (!work_.empty()) {
      const int r = work_.back();
      work_.pop_back();
      queued_[r] = 0;
      const auto& row = order_[r];
      while (pc_[r] < row.size()) {
        const int id = row[pc_[r]];
        const Node& n = nodes_[id];
        double ready = 0.0;
        bool blocked = false;
        for (int d = 0; d < 2; ++d) {
          if (n.dep[d] < 0) continue;
          const double e = end_[n.dep[d]];
          if (e < 0) {
            blocked = true;
            break;
          }
          ready = std::max(ready, e + n.hop[d]);
        }
        if (blocked) break;
        const double start = std::max(ready, free_at[r]);
        const double end = start + n.cost;
        end_[id] = end;
        free_at[r] = end;
        if (first_[r] < 0 && n.op == Op::F) first_[r] = start;
        mem_[r] += n.dmem;
        if (mem_[r] > peak_[r]) peak_[r] = mem_[r];
        for (int q : n.consumer_rank)
          if (q >= 0 && q != r && !queued_[q]) {
            queued_[q] = 1;
            work_.push_back(q);
          }
        ++pc_[r];
        ++done;
      }
    }
    if (done != nodes_.size()) return false;
    score = Score{};
    for (int r = 0; r < p_; ++r) {
      if (peak_[r] > limit_ + 1e-9 * std::max(1.0, limit_)) return false;
      span_[r] = first_[r] < 0 ? 0.0 : free_at[r] - first_[r];
      score.max_span = std::max(score.max_span, span_[r]);
      score.sum_span += span_[r];
    }
    return true;
  }

  bool movable(int a, int b) const {
    // a and b are neighbours on one rank; may their order be swapped?
    if (a == b) return false;
    const Node& x = nodes_[a];
    const Node& y = nodes_[b];
    if (stage_[a] == stage_[b] && mb_[a] == mb_[b]) return false;  // F -> I -> W of one pair
    if (x.op == y.op && stage_[a] == stage_[b]) return false;      // keep microbatch order
    return true;
  }

  // Moves row[from] to position `to` (shifting the ones between) if every
  // action it passes may be swapped with it; returns false without change
  // otherwise.
  bool move(int r, int from, int to) {
    auto& row = order_[r];
    if (from == to || from < 0 || to < 0 || from >= static_cast<int>(row.size()) ||
        to >= static_cast<int>(row.size()))
      return false;
    const int id = row[from];
    if (to < from) {
      for (int k = to; k < from; ++k)
        if (!movable(row[k], id)) return false;
      std::rotate(row.begin() + to, row.begin() + from, row.begin() + from + 1);
    } else {
      for (int k = from + 1; k <= to; ++k)
        if (!movable(id, row[k])) return false;
      std::rotate(row.begin() + from, row.begin() + from + 1, row.begin() + to + 1);
    }
    return true;
  }
  void undo(int r, int from, int to) {
    // inverse of move(r, from, to)
    auto& row = order_[r];
    if (to < from)
      std::rotate(row.begin() + to, row.begin() + to + 1, row.begin() + from + 1);
    else
      std::rotate(row.begin() + from, row.begin() + to, row.begin() + to + 1);
  }

  // Tries one move; keeps it when it improves `best`.
  bool attempt(int r, int from, int to, Score& best) {
    if (budget_ <= 0) return false;
    if (!move(r, from, to)) return false;
    Score sc;
    if (evaluate(sc) && sc.better_than(best)) {
      best = sc;
      ++improvements_;
      return true;
    }
    undo(r, from, to);
    return false;
  }

  // One round: for the ranks from the longest span down, each idle gap is
  // attacked by the moves below, and each W that delays the op after it is
  // tried later; the first move that helps is kept.
  bool improve_once(Score& best) {
    // Times of the current best order (the last evaluation may be a rejected one).
    Score now;
    if (!evaluate(now)) return false;
    std::vector<int> ranks(p_);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return span_[a] > span_[b]; });
    const std::vector<double> ends = end_;
    for (int r : ranks) {
      const auto row = order_[r];  // copy: moves below change order_[r]
      const int n = static_cast<int>(row.size());
      double prev_end = -1;
      for (int k = 0; k < n; ++k) {
        const int id = row[k];
        const double start = ends[id] - nodes_[id].cost;
        const bool gap = prev_end >= 0 && start > prev_end + kEps * std::max(1.0, start);
        prev_end = ends[id];
        // (d) a W that holds up the op after it goes later.
        if (nodes_[id].op == Op::W && k + 1 < n && nodes_[row[k + 1]].op != Op::W) {
          const double next_start = ends[row[k + 1]] - nodes_[row[k + 1]].cost;
          if (next_start <= ends[id] + kEps * std::max(1.0, next_start))
            for (int fwd = 1; fwd <= 2 && k + fwd < n; ++fwd)
              if (attempt(r, k, k + fwd, best)) return true;
        }
        if (!gap) continue;
        // (a) a later W of this rank fills the gap.
        for (int j = k + 1; j < n && j <= k + 24; ++j)
          if (nodes_[row[j]].op == Op::W && attempt(r, j, k, best)) return true;
        // (b) the awaited input is produced earlier on its own rank.
        for (int d = 0; d < 2; ++d) {
          const int src = nodes_[id].dep[d];
          if (src < 0) continue;
          if (std::abs(ends[src] + nodes_[id].hop[d] - start) > kEps * std::max(1.0, start))
            continue;
          const int q = nodes_[src].rank;
          const auto& qrow = order_[q];
          const int pos = static_cast<int>(std::find(qrow.begin(), qrow.end(), src) - qrow.begin());
          for (int back = 1; back <= 3 && pos - back >= 0; ++back)
            if (attempt(q, pos, pos - back, best)) return true;
        }
        // (c) the waiting action goes later, the next one fills the gap.
        for (int fwd = 1; fwd <= 2 && k + fwd < n; ++fwd)
          if (attempt(r, k, k + fwd, best)) return true;
        if (budget_ <= 0) return false;
      }
    }
    return false;
  }

  Schedule result() const {
    Schedule out = s_;
    for (int r = 0; r < p_; ++r) {
      out.actions[r].clear();
      for (int id : order_[r])
        out.actions[r].push_back(Action::make(nodes_[id].op, stage_[id], mb_[id]));
    }
    return out;
  }

  long long budget() const { return budget_; }
  // True when no rank idles inside its span: nothing left to gain.
  bool perfect(const Score& sc) const {
    return sc.sum_span <= busy_total_ + kEps * std::max(1.0, busy_total_);
  }
  int evaluations_ = 0;
  int improvements_ = 0;

 private:
  const Schedule& s_;
  double limit_;
  long long budget_;
  int p_ = 0;
  std::vector<Node> nodes_;
  double busy_total_ = 0;
  std::vector<int> stage_, mb_;
  std::vector<std::vector<int>> order_;
  std::vector<double> end_, span_, peak_, free_at_, first_, mem_;
  std::vector<size_t> pc_;
  std::vector<int> work_;
  std::vector<char> queued_;
};

bool refinable(const Schedule& s) {
  if (s.lowered) return false;
  for (const auto& row : s.actions)
    for (const Action& a : row)
      if (a.op != Op::F && a.op != Op::I && a.op != Op::W) return false;
  return true;
}

}  // namespace

Schedule refine(const Schedule& s, const CostModel& costs, const RefineOptions& opts,
                RefineStats* stats) {
  costs.check(s.num_stages);
  if (stats) *stats = RefineStats{};
  if (!refinable(s)) return s;
  Search search(s, costs, opts);
  if (!search.complete()) return s;
  Score best;
  if (!search.evaluate(best)) return s;  // deadlocked or over the limit already
  const double before = best.max_span;
  while (search.budget() > 0 && !search.perfect(best) && search.improve_once(best)) {
  }
  if (stats) {
    stats->evaluations = search.evaluations_;
    stats->improvements = search.improvements_;
    stats->span_before = before;
    stats->span_after = best.max_span;
  }
  Schedule out = search.result();
  return out;
}

}  // namespace hp::schedule
