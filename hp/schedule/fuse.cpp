// hp/schedule/fuse.cpp: fuse_pairs, the overlapped variants of a schedule
// (NOTE [Pairs in interleaved 1F1B and ZB-V]).
#include "hp/schedule/fuse.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "hp/schedule/lower.h"
#include "hp/schedule/progress.h"

namespace hp::schedule {

// NOTE [Pairs in interleaved 1F1B and ZB-V]
// interleaved-1f1b-fb and zbv-fb are interleaved-1f1b and zbv with some of
// each rank's adjacent forward and backward run as one FB pair (DualPipe's
// "F&B overlap": the executor interleaves the halves at their waits, NOTE
// [Overlapped pairs] in hp/pipeline/overlap.cpp). Each rank keeps its order;
// a pair only puts two neighbours in one action. The rule, fuse_pairs():
// - a candidate is an F next to a B or an I of another microbatch on one
//   rank (the F first or second), which exists only between a rank's first
//   backward and its last forward: the steady state. A backward of the same
//   microbatch always reads that F's output (every route passes the F's
//   stage before the backward's), so it never pairs with it;
// - the candidates are walked as an event simulation under the build costs
//   runs them, in order of start time, pairs run as overlapped; a candidate
//   becomes a pair when its second action's input is there by the time the
//   first would start (pairing then makes no half wait for the other);
//   pairing only what is ready keeps the schedule free of deadlock under
//   validate's rule (a pair starts once both inputs are there, its outputs
//   leave at its end): the simulation that chose the pairs is one such run;
// - the overlapped simulation of the result (SimOptions::overlap_pairs,
//   NOTE [An overlapped pair in the simulator] in simulate.cpp) is then
//   checked against the base's: while it is slower, the pair whose removal
//   shortens it most of those tried is split again, in order, and if it
//   stays slower all are; then every remaining candidate is tried one at a
//   time and kept when the makespan does not grow. So at the costs it was
//   built for the variant is never slower than its base (at others it may
//   be), and it is faster where pairs let one half fill the other's wait
//   for a transfer (the tests show both). A bound on simulated work
//   (kFuseWork) stops the trying early on big schedules.
// An I paired with an F becomes the pair's B half: the fused backward, so
// its W is dropped from the list (the executor with `defer_wgrad` runs the
// half as I and queues the W itself, NOTE [Weight gradients in the waits]
// in hp/pipeline/overlap.cpp). zbv-fb gives up ZB-V's placement of those
// W's: the schedule no longer puts them into its bubbles, the cost model
// counts each paired backward as I + W, so the input gradient leaves a W
// later than ZB-V's I sends it, and an executor without defer_wgrad holds
// the W's activations no longer but computes it before the gradient is
// sent. The pairs kept are where that costs nothing at the build costs;
// in the tests' sizes zbv-fb then only ties zbv (its makespan is bound by
// the I's that a pair makes wait a W longer), where interleaved-1f1b-fb
// with transfers is faster than interleaved-1f1b.

namespace {

bool is_backward(Op op) {
  return op == Op::B || op == Op::I;
}

// One pair, by positions in the base rank's list: x runs first there, y
// next (W's of paired I's skipped); w is the position of y's or x's W when
// the backward is an I, else -1.
struct Pair {
  int rank = 0;
  size_t x = 0, y = 0;
  long w = -1;
};

struct Fuser {
  const Schedule& s;
  const CostModel& costs;
  long long work_left;
  std::vector<std::vector<long>> w_pos;  // [rank][position of an I] -> its W's position

  Fuser(const Schedule& base, const CostModel& c, long long work)
      : s(base), costs(c), work_left(work) {
    std::vector<long> w_of(static_cast<size_t>(s.num_stages) * s.num_microbatches, -1);
    for (const auto& row : s.actions)
      for (size_t i = 0; i < row.size(); ++i)
        if (row[i].op == Op::W) w_of[key(row[i])] = long(i);
    w_pos.resize(s.num_ranks);
    for (int r = 0; r < s.num_ranks; ++r) {
      w_pos[r].assign(s.actions[r].size(), -1);
      for (size_t i = 0; i < s.actions[r].size(); ++i)
        if (s.actions[r][i].op == Op::I) w_pos[r][i] = w_of[key(s.actions[r][i])];
    }
  }
  size_t key(const Action& a) const { return size_t(a.stage) * s.num_microbatches + a.microbatch; }

  // x and y may pair: one F, one backward, other microbatches.
  static bool pairable(const Action& x, const Action& y) {
    const bool kinds = (x.op == Op::F && is_backward(y.op)) || (y.op == Op::F && is_backward(x.op));
    return kinds && x.microbatch != y.microbatch;
  }
  Pair make_pair(int r, size_t x, size_t y) const {
    const size_t g = is_backward(s.actions[r][x].op) ? x : y;
    return Pair{r, x, y, w_pos[r][g]};
  }
  static Action fused(const Action& x, const Action& y) {
    const Action& f = x.op == Op::F ? x : y;
    const Action& g = x.op == Op::F ? y : x;
    return Action::overlap(f.stage, f.microbatch, g.stage, g.microbatch);
  }

  // The base with the pairs whose `on` is set.
  Schedule apply(const std::vector<Pair>& pairs, const std::vector<char>& on) const {
    Schedule out = s;
    std::vector<std::vector<int>> role(s.num_ranks);  // 0 as is, 1 pair's x, 2 dropped
    std::vector<std::vector<size_t>> partner(s.num_ranks);
    for (int r = 0; r < s.num_ranks; ++r) {
      role[r].assign(s.actions[r].size(), 0);
      partner[r].assign(s.actions[r].size(), 0);
    }
    for (size_t k = 0; k < pairs.size(); ++k) {
      if (!on[k]) continue;
      const Pair& q = pairs[k];
      role[q.rank][q.x] = 1;
      partner[q.rank][q.x] = q.y;
      role[q.rank][q.y] = 2;
      if (q.w >= 0) role[q.rank][q.w] = 2;
    }
    for (int r = 0; r < s.num_ranks; ++r) {
      auto& row = out.actions[r];
      row.clear();
      for (size_t i = 0; i < s.actions[r].size(); ++i) {
        if (role[r][i] == 2) continue;
        const Action& a = s.actions[r][i];
        row.push_back(role[r][i] == 1 ? fused(a, s.actions[r][partner[r][i]]) : a);
      }
    }
    return out;
  }

  // The overlapped makespan, or a negative number when the schedule cannot
  // run or the work bound is spent.
  double makespan(const Schedule& t) {
    long long n = 0;
    for (const auto& row : t.actions)
      n += static_cast<long long>(row.size());
    if (n > work_left) return -1;
    work_left -= n;
    SimOptions o;
    o.overlap_pairs = true;
    o.choose_leads = true;  // NOTE [The half that leads]
    o.record_timeline = false;
    try {
      return simulate(t, costs, o).makespan;
    } catch (const std::runtime_error&) {
      return -1;
    }
  }

  std::vector<Pair> ready_pairs() const;
};

// The event simulation of NOTE [Pairs in interleaved 1F1B and ZB-V]: ranks
// taken in order of their next start time, so every output that ends by a
// start has been produced when that start is decided.
std::vector<Pair> Fuser::ready_pairs() const {
  const int p = s.num_ranks;
  std::vector<Pair> pairs;
  Progress progress(s);
  auto transfer = [&](int a, int b) { return costs.boundary_cost(s, a, b); };
  std::vector<size_t> pc(p, 0);
  std::vector<double> free_at(p, 0.0);
  std::vector<std::vector<char>> dropped(p);
  for (int r = 0; r < p; ++r)
    dropped[r].assign(s.actions[r].size(), 0);
  auto next_kept = [&](int r, size_t i) {
    while (i < s.actions[r].size() && dropped[r][i])
      ++i;
    return i;
  };
  using Entry = std::tuple<double, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  std::vector<char> queued(p, 0);
  auto offer = [&](int r) {
    if (r < 0 || queued[r]) return;
    pc[r] = next_kept(r, pc[r]);
    if (pc[r] >= s.actions[r].size()) return;
    const double ready = progress.ready_at(s.actions[r][pc[r]], transfer);
    if (ready < 0) return;
    queued[r] = 1;
    queue.emplace(std::max(ready, free_at[r]), r);
  };
  for (int r = 0; r < p; ++r)
    offer(r);
  while (!queue.empty()) {
    const auto [start, r] = queue.top();
    queue.pop();
    queued[r] = 0;
    const auto& row = s.actions[r];
    Action done = row[pc[r]];
    double end = start + costs.cost(s, done);
    const size_t y = next_kept(r, pc[r] + 1);
    if (y < row.size() && pairable(row[pc[r]], row[y])) {
      const double y_ready = progress.ready_at(row[y], transfer);
      if (y_ready >= 0 && y_ready <= start) {
        const Pair q = make_pair(r, pc[r], y);
        if (q.w >= 0) dropped[r][q.w] = 1;
        pairs.push_back(q);
        done = fused(row[pc[r]], row[y]);
        // Both inputs are there at `start`: F, then the fused backward.
        const double df = costs.stage_cost(s, Op::F, done.stage);
        end = start + df + costs.stage_cost(s, Op::B, done.stage2);
        progress.finish(Action::make(Op::F, done.stage, done.microbatch), start + df);
        progress.finish(Action::make(Op::B, done.stage2, done.microbatch2), end);
        pc[r] = y;
      }
    }
    if (done.op != Op::FB) progress.finish(done, end);
    free_at[r] = end + costs.send_cost(s, done);
    ++pc[r];
    std::vector<int> wake{r};
    auto add = [&](int st) {
      if (st >= 0) wake.push_back(s.stage_rank[st]);
    };
    if (done.op == Op::F || done.op == Op::FB) add(s.next_stage(done.stage, done.microbatch));
    if (is_backward(done.op)) add(s.prev_stage(done.stage, done.microbatch));
    if (done.op == Op::FB) add(s.prev_stage(done.stage2, done.microbatch2));
    for (int q : wake)
      offer(q);
  }
  for (int r = 0; r < p; ++r)
    if (next_kept(r, pc[r]) < s.actions[r].size())
      throw std::logic_error("fuse_pairs: schedule '" + s.name + "' cannot run");
  return pairs;
}

}  // namespace

bool is_fb_variant(const std::string& name) {
  const std::string tail = "-fb";
  return name.size() > tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

Schedule fuse_pairs(const Schedule& s, const CostModel& costs, long long work) {
  if (s.lowered) throw std::invalid_argument("fuse_pairs: needs a compute-only schedule");
  Fuser fz(s, costs, work > 0 ? work : kFuseWork);
  std::vector<Pair> pairs = fz.ready_pairs();
  std::vector<char> on(pairs.size(), 1);
  const double base = fz.makespan(s);
  const double tol = 1e-9 * std::max(1.0, base);
  double best = base < 0 ? -1 : fz.makespan(fz.apply(pairs, on));
  // Split pairs while slower than the base.
  while (best >= 0 && best > base + tol) {
    long pick = -1;
    double pick_t = best;
    for (size_t k = 0; k < pairs.size(); ++k) {
      if (!on[k]) continue;
      on[k] = 0;
      const double t = fz.makespan(fz.apply(pairs, on));
      on[k] = 1;
      if (t < 0) break;  // out of work
      if (t < pick_t - tol) {
        pick = long(k);
        pick_t = t;
        if (t <= base + tol) break;
      }
    }
    if (pick < 0) break;
    on[pick] = 0;
    best = pick_t;
  }
  if (best < 0 || best > base + tol) {
    std::fill(on.begin(), on.end(), 0);
    best = base;
  }
  // Then every other candidate, one at a time, kept when no slower.
  if (best >= 0) {
    std::vector<std::vector<char>> used(s.num_ranks);
    for (int r = 0; r < s.num_ranks; ++r)
      used[r].assign(s.actions[r].size(), 0);
    for (size_t k = 0; k < pairs.size(); ++k)
      if (on[k]) {
        used[pairs[k].rank][pairs[k].x] = used[pairs[k].rank][pairs[k].y] = 1;
        if (pairs[k].w >= 0) used[pairs[k].rank][pairs[k].w] = 1;
      }
    bool out_of_work = false;
    for (int r = 0; r < s.num_ranks && !out_of_work; ++r) {
      const auto& row = s.actions[r];
      for (size_t x = 0; x < row.size() && !out_of_work; ++x) {
        if (used[r][x] || row[x].op == Op::W) continue;
        size_t y = x + 1;
        while (y < row.size() && (used[r][y] || row[y].op == Op::W))
          ++y;
        if (y >= row.size() || !Fuser::pairable(row[x], row[y])) continue;
        pairs.push_back(fz.make_pair(r, x, y));
        on.push_back(1);
        const double t = fz.makespan(fz.apply(pairs, on));
        if (t >= 0 && t <= best + tol) {
          best = std::min(best, t);
          used[r][x] = used[r][y] = 1;
          if (pairs.back().w >= 0) used[r][pairs.back().w] = 1;
        } else {
          out_of_work = t < 0 && fz.work_left <= 0;
          pairs.pop_back();
          on.pop_back();
        }
      }
    }
  }
  Schedule out = order_pairs(fz.apply(pairs, on), costs);
  out.name = s.name + "-fb";
  validate(out);
  return out;
}

// NOTE [The half that leads]
// The executor's runner fixes the order of a pair's halves by code, not by
// arrival (NOTE [Overlapped pairs] in hp/pipeline/overlap.cpp: expert
// all-to-alls, FSDP's gathers and a tensor-parallel group's reductions inside
// the halves must be posted in one order by every peer). It starts with the
// lead: an F-led pair whose B's gradient is there while the F's activation is
// still on the wire has the rank idle until the activation comes (NOTE [An
// overlapped pair in the simulator] in simulate.cpp). So the lead is part of
// the schedule, like the order of its actions, and every rank of a run reads
// the same one. order_pairs chooses it in one overlapped simulation: at each
// pair, the lead under which the pair ends first at those costs, the F on a
// tie. The generators' pairs lead with F (DualPipe's own order); fuse_pairs'
// variants and a run with the overlap on (hp train --fb-overlap, Pipeline's
// fb_overlap) order their pairs under the costs they have.
Schedule order_pairs(const Schedule& s, const CostModel& costs) {
  SimOptions o;
  o.overlap_pairs = true;
  o.choose_leads = true;
  o.record_timeline = false;
  const SimResult r = simulate(s, costs, o);
  Schedule out = s;
  for (auto& row : out.actions)
    for (auto& a : row)
      a.backward_first = false;
  for (const auto& [rank, i] : r.backward_leads)
    out.actions[rank][i].backward_first = true;
  return out;
}

}  // namespace hp::schedule
