// hp/schedule/simulate.cpp: the event simulation of a schedule under a cost
// model (timings, bubble rate, idle time, peak memory, timeline).
#include "hp/schedule/simulate.h"

#include "hp/schedule/progress.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <set>
#include <stdexcept>
#include <tuple>

namespace hp::schedule {

namespace {
double pick(const std::vector<double>& v, int stage, const Schedule& s, double dflt) {
  if (static_cast<int>(v.size()) == s.num_stages) return v[stage];
  return dflt;
}
double scale(const Schedule& s) {
  return s.num_chunks > 0 ? static_cast<double>(s.num_ranks) / s.num_chunks : 1.0;
}
}  // namespace

void CostModel::check() const {
  auto pos = [](double v, const char* n) {
    if (!(v > 0) || !std::isfinite(v))
      throw std::invalid_argument(std::string("cost model: ") + n +
                                  " must be a positive finite number, got " + std::to_string(v));
  };
  auto nonneg = [](double v, const char* n) {
    if (!(v >= 0) || !std::isfinite(v))
      throw std::invalid_argument(std::string("cost model: ") + n +
                                  " must be a non-negative finite number, got " +
                                  std::to_string(v));
  };
  pos(f, "F");
  pos(b, "B (the input gradient I)");
  pos(w, "W");
  nonneg(comm, "comm");
  nonneg(mem_b, "mem_b");
  nonneg(mem_w, "mem_w");
  for (double v : stage_f)
    pos(v, "stage F");
  for (double v : stage_b)
    pos(v, "stage B");
  for (double v : stage_w)
    pos(v, "stage W");
  for (double v : stage_mem_b)
    nonneg(v, "stage mem_b");
  for (double v : stage_mem_w)
    nonneg(v, "stage mem_w");
  for (double v : stage_comm)
    nonneg(v, "stage comm");
  nonneg(send, "send");
  for (double v : stage_send)
    nonneg(v, "stage send");
  for (const InnerComm& c : stage_inner) {
    if (c.f_waits < 0 || c.i_waits < 0 || c.w_waits < 0)
      throw std::invalid_argument("cost model: stage_inner's wait counts must be non-negative");
    nonneg(c.f, "stage_inner f");
    nonneg(c.i, "stage_inner i");
    nonneg(c.w, "stage_inner w");
    auto shares = [&](const std::vector<double>& v, int waits, const char* n) {
      if (!v.empty() && v.size() != size_t(waits + 1))
        throw std::invalid_argument(std::string("cost model: stage_inner ") + n + " has " +
                                    std::to_string(v.size()) + " shares for " +
                                    std::to_string(waits) + " waits (give waits + 1, or none)");
      for (double x : v)
        nonneg(x, "stage_inner node share");
    };
    shares(c.f_nodes, c.f_waits, "f_nodes");
    shares(c.i_nodes, c.i_waits, "i_nodes");
    shares(c.w_nodes, c.w_waits, "w_nodes");
  }
}

void CostModel::check(int num_stages) const {
  check();
  auto sized = [num_stages](const std::vector<double>& v, const char* n) {
    if (!v.empty() && static_cast<int>(v.size()) != num_stages)
      throw std::invalid_argument(std::string("cost model: ") + n + " has " +
                                  std::to_string(v.size()) + " entries but the schedule has " +
                                  std::to_string(num_stages) +
                                  " stages; give one entry per stage or none");
  };
  sized(stage_f, "stage_f");
  sized(stage_b, "stage_b (I)");
  sized(stage_w, "stage_w");
  sized(stage_mem_b, "stage_mem_b");
  sized(stage_mem_w, "stage_mem_w");
  sized(stage_comm, "stage_comm");
  sized(stage_send, "stage_send");
  if (!stage_inner.empty() && static_cast<int>(stage_inner.size()) != num_stages)
    throw std::invalid_argument("cost model: stage_inner has " +
                                std::to_string(stage_inner.size()) +
                                " entries but the schedule has " + std::to_string(num_stages) +
                                " stages; give one entry per stage or none");
}

bool CostModel::per_stage() const {
  return !stage_f.empty() || !stage_b.empty() || !stage_w.empty() || !stage_mem_b.empty() ||
         !stage_mem_w.empty() || !stage_comm.empty() || !stage_send.empty() || !stage_inner.empty();
}

double CostModel::boundary_cost(const Schedule& s, int upstream, int downstream) const {
  if (s.stage_rank[upstream] == s.stage_rank[downstream]) return 0.0;
  return pick(stage_comm, upstream, s, comm);
}

double CostModel::send_cost(const Schedule& s, const Action& a) const {
  double t = 0.0;
  auto out = [&](int stage, int to) {
    if (to >= 0 && s.stage_rank[to] != s.stage_rank[stage]) t += pick(stage_send, stage, s, send);
  };
  switch (a.op) {
    case Op::F:
      out(a.stage, s.next_stage(a.stage, a.microbatch));
      break;
    case Op::I:
    case Op::B:
      out(a.stage, s.prev_stage(a.stage, a.microbatch));
      break;
    case Op::FB:
      out(a.stage, s.next_stage(a.stage, a.microbatch));
      out(a.stage2, s.prev_stage(a.stage2, a.microbatch2));
      break;
    default:
      break;
  }
  return t;
}

std::pair<int, double> CostModel::inner_waits(const Action& a) const {
  if (stage_inner.empty()) return {0, 0.0};
  auto of = [&](Op op, int stage) -> std::pair<int, double> {
    const InnerComm& c = stage_inner.at(stage);
    if (op == Op::F) return {c.f_waits, c.f_waits * c.f};
    if (op == Op::I) return {c.i_waits, c.i_waits * c.i};
    if (op == Op::W) return {c.w_waits, c.w_waits * c.w};
    if (op == Op::B) return {c.i_waits + c.w_waits, c.i_waits * c.i + c.w_waits * c.w};
    return {0, 0.0};
  };
  if (a.op != Op::FB) return of(a.op, a.stage);
  const auto f = of(Op::F, a.stage), g = of(Op::B, a.stage2);
  return {f.first + g.first, f.second + g.second};
}

double CostModel::stage_cost(const Schedule& s, Op op, int stage) const {
  double k = scale(s);
  switch (op) {
    case Op::F:
      return pick(stage_f, stage, s, f * k);
    case Op::I:
      return pick(stage_b, stage, s, b * k);
    case Op::W:
      return pick(stage_w, stage, s, w * k);
    case Op::B:
      return pick(stage_b, stage, s, b * k) + pick(stage_w, stage, s, w * k);
    default:
      return 0.0;
  }
}

double CostModel::stage_mem_b_of(const Schedule& s, int stage) const {
  return pick(stage_mem_b, stage, s, mem_b * scale(s));
}
double CostModel::stage_mem_w_of(const Schedule& s, int stage) const {
  return pick(stage_mem_w, stage, s, mem_w * scale(s));
}

double CostModel::cost(const Schedule& s, const Action& a) const {
  if (a.op == Op::FB) return stage_cost(s, Op::F, a.stage) + stage_cost(s, Op::B, a.stage2);
  return stage_cost(s, a.op, a.stage);
}

double Timeline::makespan() const {
  double m = 0.0;
  for (const auto& e : events)
    m = std::max(m, e.end);
  return m;
}

int comm_volume(const Schedule& s) {
  int v = 0;
  for (int mb = 0; mb < s.num_microbatches; ++mb) {
    const auto& r = s.route(mb);
    for (size_t i = 0; i + 1 < r.size(); ++i)
      if (s.stage_rank[r[i]] != s.stage_rank[r[i + 1]]) v += 2;
  }
  return v;
}

namespace {

// A queued W and its parts left (NOTE [Weight gradients until the message is
// there] in hp/pipeline/overlap.cpp).
struct QueuedW {
  int stage = 0, microbatch = 0;
  int left = 1;  // of SimOptions::deferred_w_parts
};

// One half of an overlapped pair (NOTE [An overlapped pair in the
// simulator]): `compute` seconds of CPU cut into waits + 1 equal nodes, a
// wait of `inflight` seconds between two (NOTE [Waits inside a chunk]), and
// before the first its input's wait when `receives` (the input there at
// `ready`).
struct Half {
  double ready = 0.0;
  bool receives = false;
  double compute = 0.0;
  const std::vector<double>* shares = nullptr;  // each node's share, or equal ones
  int waits = 0;
  double inflight = 0.0;
  bool queues_w = false;  // defer_wgrad: its W is queued as it ends
  QueuedW w{};            // that W
};

using WQueue = std::deque<QueuedW>;
struct WRun {  // parts of a queued W run in a pair: the W as it was, where, how many
  QueuedW w;
  double start = 0.0;
  int parts = 0;
};

// The pair as the runner runs it; index 0 the lead, 1 the partner.
struct PairRun {
  double start[2] = {0, 0}, end[2] = {0, 0};           // first node's start, last node's end
  std::vector<WRun> w_runs;                            // queued W's run in it
  WQueue queue;                                        // what stays queued after it
  std::vector<std::tuple<int, double, double>> nodes;  // half, start, end: as they ran
  double hidden = 0.0, exposed = 0.0;                  // NOTE [What a pair hides, predicted]
  double finish() const { return std::max(end[0], end[1]); }
};

// NOTE [What a pair hides, predicted]
// As the executor's PairStats (NOTE [Overlapped pairs] in
// hp/pipeline/overlap.cpp): each wait of a half, from where the half
// reaches it (its input's: when the half first holds the CPU; an all-to-all's:
// as its node ends) to where its message is there, is hidden while the CPU
// computes (a node of the other half, or a queued W) and exposed
// otherwise. The CPU runs one thing at a time, so the busy stretches do not
// overlap and each wait's hidden part is the sum of its overlaps with them.
// An in-flight time read from a measured run holds the wait for a slower
// expert-parallel peer too (NOTE [Waits inside a chunk] in simulate.h), so
// the prediction counts that part of the exposure as the measurement does.
void account_waits(PairRun& run, const std::vector<std::pair<double, double>>& waits,
                   const std::vector<std::pair<double, double>>& busy) {
  for (const auto& [a, b] : waits) {
    double hidden = 0.0;
    for (const auto& [s, e] : busy)
      hidden += std::max(0.0, std::min(b, e) - std::max(a, s));
    hidden = std::min(hidden, b - a);
    run.hidden += hidden;
    run.exposed += (b - a) - hidden;
  }
}

// The runner's turns (NOTE [Overlapped pairs] in hp/pipeline/overlap.cpp):
// the half that holds the CPU runs its next node once the wait in front of
// it has ended; at each wait it enters it first runs the oldest queued W if
// defer and the other half has started (NOTE [Weight gradients in the
// waits]; with first_ready, parts of W's until its wait or the other's
// ends: NOTE [Weight gradients until the message is there]), then hands the CPU to the other half
// unless that one has ended, or, with first_ready, to the half whose wait ends first (the other on
// a tie: NOTE [Turns as messages arrive] in hp/pipeline/overlap.cpp).
PairRun run_pair(double t0, const Half (&h)[2], WQueue queue, bool defer, bool first_ready,
                 int w_parts, const std::function<double(int)>& w_cost) {
  PairRun run;
  bool started[2] = {true, false}, done[2] = {false, false}, entered[2] = {false, false};
  int node[2] = {0, 0};
  double wait_until[2] = {h[0].ready, h[1].ready};  // end of the wait before the next node
  auto has_wait = [&](int x) { return node[x] > 0 || h[x].receives; };
  double t = t0;
  auto can_run_at = [&](int x) { return has_wait(x) ? std::max(t, wait_until[x]) : t; };
  std::vector<std::pair<double, double>> waits, busy;  // NOTE [What a pair hides, predicted]
  int cur = 0;
  while (!done[0] || !done[1]) {
    const int x = cur, y = 1 - cur;
    started[x] = true;
    if (has_wait(x) && !entered[x]) {
      entered[x] = true;
      if (node[x] == 0) waits.emplace_back(t, std::max(t, wait_until[x]));  // its input's
      // A W's parts, or the rest of it whole.
      auto run_parts = [&](int parts) {
        QueuedW& q = queue.front();
        run.w_runs.push_back({q, t, parts});
        busy.emplace_back(t, t + w_cost(q.stage) * parts / w_parts);
        t = busy.back().second;
        if ((q.left -= parts) == 0) queue.pop_front();
      };
      const bool until_there = first_ready && w_parts > 1;
      if (defer && started[y] && !until_there && !queue.empty()) run_parts(queue.front().left);
      if (defer && started[y] && until_there) {
        const double until = done[y] ? wait_until[x] : std::min(wait_until[x], can_run_at(y));
        while (!queue.empty() && t < until)
          run_parts(1);
      }
      if (!done[y] && (!first_ready || can_run_at(y) <= can_run_at(x))) {
        cur = y;
        continue;
      }
    }
    if (has_wait(x)) t = std::max(t, wait_until[x]);
    if (node[x] == 0) run.start[x] = t;
    const double node_start = t;
    const auto* sh = h[x].shares;
    t += sh != nullptr && sh->size() == size_t(h[x].waits + 1) ? h[x].compute * (*sh)[node[x]]
                                                               : h[x].compute / (h[x].waits + 1);
    run.nodes.emplace_back(x, node_start, t);
    busy.emplace_back(node_start, t);
    entered[x] = false;
    if (++node[x] == h[x].waits + 1) {
      done[x] = true;
      run.end[x] = t;
      if (h[x].queues_w) queue.push_back(h[x].w);
      if (!done[y]) cur = y;
    } else {
      wait_until[x] = t + h[x].inflight;
      waits.emplace_back(t, wait_until[x]);
    }
  }
  account_waits(run, waits, busy);
  run.queue = std::move(queue);
  return run;
}

}  // namespace

bool pair_turns_ready(const std::string& pair_turns, bool defer_wgrad) {
  if (pair_turns != "auto" && pair_turns != "ready" && pair_turns != "fixed")
    throw std::invalid_argument("pair turns must be 'auto', 'ready' or 'fixed', not '" +
                                pair_turns + "'");
  return pair_turns == "ready" || (pair_turns == "auto" && !defer_wgrad);
}

void check_deferred_w_gain(double gain) {
  if (!(gain >= -1.0 && gain <= 1.0))
    throw std::invalid_argument(
        "the gain deferred W's must bring is a share of the step from -1 "
        "to 1, got " +
        std::to_string(gain));
}

// NOTE [Deferred W's where they lower the step]
// A deferred W fills a wait only if there is one it fits in: with a slow
// link and a B much longer than its W's share of a wait it shortens the
// step; with little to wait for, or W's longer than the waits, the W's
// pile up at the step's end and the queued ones hold their microbatches'
// activations meanwhile (about twice the plain pairs' peak on the dense
// GPT's dualpipev). Which one a run is cannot be told from the schedule
// alone, so `hp train --fb-overlap` decides from the run itself (NOTE [The
// deferred W's chosen in the run] in hp/pipeline/pipeline.cpp): both ways
// simulated under one step's fitted costs, each with the turns `auto`
// takes for it (ready without deferred W's, fixed with them). The
// deferred W's are chosen only where they shorten the predicted step by
// kDeferredWGain or more: the two predictions share their costs, so their
// difference is surer than either step (each within about 10 % of the
// measured one), but a gain of a percent or two is not worth the memory.
DeferredWChoice choose_deferred_w(const Schedule& s, const CostModel& costs,
                                  const std::string& pair_turns, bool cpu, bool recompute,
                                  double gain) {
  check_deferred_w_gain(gain);
  const bool ready_without = pair_turns_ready(pair_turns, false);  // the spelling, on any device
  SimOptions without;
  without.record_timeline = false;
  without.overlap_pairs = true;
  without.pair_first_ready = cpu && ready_without;
  const SimResult a = simulate(s, costs, without);
  DeferredWChoice c;
  c.step_without = a.makespan;
  c.peak_without = a.max_peak_memory;
  SimOptions with = without;
  with.defer_wgrad = true;
  with.pair_first_ready = cpu && pair_turns_ready(pair_turns, true);
  if (with.pair_first_ready && recompute) return c;  // refused: NOTE [Turns as messages arrive]
  const SimResult b = simulate(s, costs, with);
  c.step_with = b.makespan;
  c.peak_with = b.max_peak_memory;
  c.defer = b.makespan <= (1.0 - gain) * a.makespan;
  return c;
}

SimResult simulate(const Schedule& s, const CostModel& costs, const SimOptions& opts) {
  costs.check(s.num_stages);
  const int p = s.num_ranks;
  // What has run and when (NOTE [What an action waits for] in progress.h).
  Progress progress(s);
  auto transfer = [&](int a, int b) { return costs.boundary_cost(s, a, b); };

  SimResult res;
  res.rank_busy.assign(p, 0.0);
  res.rank_idle.assign(p, 0.0);
  res.rank_span.assign(p, 0.0);
  res.peak_memory.assign(p, 0.0);
  if (opts.overlap_pairs) {
    res.rank_pair_hidden.assign(p, 0.0);
    res.rank_pair_exposed.assign(p, 0.0);
  }
  std::vector<double> first_f(p, -1.0), last_end(p, 0.0), free_at(p, 0.0), mem(p, 0.0);
  std::vector<size_t> pc(p, 0);
  if (opts.record_timeline) {
    res.timeline.num_ranks = p;
    res.timeline.title = s.name;
  }

  size_t remaining = 0;
  for (const auto& row : s.actions)
    remaining += row.size();
  if (opts.record_timeline) res.timeline.events.reserve(remaining);
  // NOTE [Deferred W's in the simulator]
  // With overlap_pairs and defer_wgrad, as the executor's defer_wgrad (NOTE
  // [Weight gradients in the waits] in hp/pipeline/overlap.cpp): a pair's B
  // half is its I (an I event), its W is queued, holding the W's memory, and
  // a queued W runs, oldest first, where the executor runs one: inside a
  // pair, at the partner's first wait (where both halves wait, or after a
  // lead that did not), or with pair_first_ready in parts at every wait
  // until a half's wait ends (NOTE [Weight gradients until the message is
  // there]); outside, the rest of it before each action whose input comes from
  // another rank, whether or not the message is there; the rest after the
  // rank's last action. A chunk's own waits in a pair (NOTE [Waits inside a
  // chunk] in simulate.h) take W's as its input's wait does.
  const bool defer = opts.overlap_pairs && opts.defer_wgrad;
  if (opts.deferred_w_parts < 1)
    throw std::invalid_argument("simulate: deferred W parts must be at least 1, got " +
                                std::to_string(opts.deferred_w_parts));
  if (opts.deferred_w_parts > 1 && !(defer && opts.pair_first_ready))
    throw std::invalid_argument(
        "simulate: deferred W parts cut the deferred W's of overlapped pairs with ready turns: "
        "give defer_wgrad and ready turns too");
  const int w_parts = opts.deferred_w_parts;
  std::vector<WQueue> queued_w(p);
  // The oldest queued W at t, `parts` of its parts (0: the rest); its end. A
  // W run in parts is one event once done, as long as its compute.
  auto run_w = [&](int r, double t, int parts = 0) {
    QueuedW& q = queued_w[r].front();
    const int k = parts > 0 ? std::min(parts, q.left) : q.left;
    const double share = double(k) / w_parts;
    const Action w = Action::make(Op::W, q.stage, q.microbatch);
    const double whole = costs.stage_cost(s, Op::W, q.stage);
    const auto [n, waited_whole] = costs.inner_waits(w);  // waited whole: no partner runs
    const double d = whole * share, waited = waited_whole * share;
    res.rank_busy[r] += d;
    last_end[r] = std::max(last_end[r], t + d + waited);
    const bool in_parts = q.left < w_parts || k < w_parts;
    if ((q.left -= k) == 0) {
      mem[r] -= costs.stage_mem_w_of(s, q.stage);
      const double end = t + d + waited;
      if (opts.record_timeline)
        res.timeline.events.push_back(in_parts ? Event{r, w, end - whole, end, n, waited_whole}
                                               : Event{r, w, t + waited, end, n, waited});
      queued_w[r].pop_front();
    }
    return t + d + waited;
  };
  auto receives = [&](const Action& a) {  // a waits for a message (F, I, B)
    if (a.op == Op::F)
      return forward_input(s, a.stage, a.microbatch).kind == InputSource::Kind::Remote;
    if (a.op == Op::I || a.op == Op::B)
      return backward_input(s, a.stage, a.microbatch).kind == InputSource::Kind::Remote;
    return false;
  };
  // NOTE [An overlapped pair in the simulator]
  // The executor's overlapped pair (NOTE [Overlapped pairs] in
  // hp/pipeline/overlap.cpp) runs its two halves on one CPU, taking turns at
  // every wait on communication, in an order fixed by the code: the leading
  // half (F, or B where the action says so: NOTE [The half that leads] in
  // fuse.cpp) runs to its first wait, the partner to its own, and so on. The
  // pipeline's part of those waits is each half's input from another rank
  // (F's activation, B's output gradient); an input from the same rank or
  // none (the data, the loss) is no wait. So (run_pair below):
  // - the lead waits and the partner does not: the partner runs whole
  //   first, then the lead once its input is there;
  // - otherwise the lead runs first once its input is there, then the
  //   partner once the lead has ended and its input is there, even if the
  //   partner's input came first (the rank idles: choosing the lead well is
  //   what order_pairs is for).
  // A chunk that waits on communication of its own (an expert layer's
  // all-to-alls: NOTE [Waits inside a chunk] in simulate.h) is cut there into
  // nodes, and the turns go on node by node (run_pair): the lead's first
  // node, the partner's, the lead's second once its all-to-all is back, and
  // so on; a communication in flight is hidden as long as the partner's node
  // runs. Each half's output leaves when the half ends (its consumer may
  // start before the pair ends), and the rank is busy for the two halves'
  // compute only. The timeline holds the halves as the F and B events they
  // ran as, each as long as its compute and ending where the half ended
  // (as the measured one: NOTE [An overlapped pair's events] in
  // hp/pipeline/step_timer.cpp).
  // NOTE [Simulation order]
  // Start times depend only on dependencies and on the rank's previous
  // action, never on the order ranks are visited. A worklist of ranks that
  // may progress keeps the cost linear: a rank runs until it blocks, and
  // finishing an action re-queues the rank that consumes its output.
  std::vector<int> work;
  std::vector<char> queued(p, 1);
  for (int r = p - 1; r >= 0; --r)
    work.push_back(r);
  auto wake = [&](int st) {
    if (st < 0) return;
    int q = s.stage_rank[st];
    if (!queued[q]) {
      queued[q] = 1;
      work.push_back(q);
    }
  };
  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    queued[r] = 0;
    {
      const auto& row = s.actions[r];
      while (pc[r] < row.size()) {
        const Action& a = row[pc[r]];
        const double ready = progress.ready_at(a, transfer);
        if (ready < 0) break;
        if (is_compute(a.op)) {
          // NOTE [Deferred W's in the simulator]
          if (defer && a.op != Op::FB && !queued_w[r].empty() && receives(a))
            free_at[r] = run_w(r, free_at[r]);
          double start = std::max(ready, free_at[r]);
          double busy = costs.cost(s, a);
          // NOTE [Waits inside a chunk]: alone, an action waits each one whole.
          const auto [inner_n, inner_s] = costs.inner_waits(a);
          double end = start + busy + inner_s;
          if (a.op == Op::FB && opts.overlap_pairs) {
            // NOTE [An overlapped pair in the simulator]
            const Action f = Action::make(Op::F, a.stage, a.microbatch);
            const Action g = Action::make(Op::B, a.stage2, a.microbatch2);
            const Action g_ran = defer ? Action::make(Op::I, a.stage2, a.microbatch2) : g;
            Half hf, hg;
            hf.ready = progress.ready_at(f, transfer);
            hg.ready = progress.ready_at(g, transfer);
            hf.receives = receives(f);
            hg.receives = receives(g);
            hf.compute = costs.stage_cost(s, Op::F, a.stage);
            hg.compute = costs.stage_cost(s, g_ran.op, a.stage2);
            if (!costs.stage_inner.empty()) {
              const InnerComm& cf = costs.stage_inner[a.stage];
              const InnerComm& cg = costs.stage_inner[a.stage2];
              hf.waits = cf.f_waits, hf.inflight = cf.f, hf.shares = &cf.f_nodes;
              const auto [n, t] = costs.inner_waits(g_ran);  // I's, or I's and W's for a B
              hg.waits = n, hg.inflight = n > 0 ? t / n : 0.0;
              if (g_ran.op == Op::I) hg.shares = &cg.i_nodes;  // a fused B's: equal
            }
            hg.queues_w = defer;
            hg.w = {a.stage2, a.microbatch2, w_parts};
            auto w_cost = [&](int st) {
              const Action w = Action::make(Op::W, st, 0);
              return costs.stage_cost(s, Op::W, st) + costs.inner_waits(w).second;
            };
            auto order = [&](bool b_leads) {
              const Half halves[2] = {b_leads ? hg : hf, b_leads ? hf : hg};
              return run_pair(free_at[r], halves, queued_w[r], defer, opts.pair_first_ready,
                              w_parts, w_cost);
            };
            bool b_leads = a.backward_first;
            if (opts.choose_leads) {
              const PairRun as_f = order(false), as_b = order(true);
              b_leads = as_b.finish() < as_f.finish();
              if (b_leads) res.backward_leads.emplace_back(r, pc[r]);
            }
            const PairRun run = order(b_leads);
            res.rank_pair_hidden[r] += run.hidden;  // NOTE [What a pair hides, predicted]
            res.rank_pair_exposed[r] += run.exposed;
            const int fi = b_leads ? 1 : 0, gi = 1 - fi;  // run's index of each half
            start = std::min(run.start[0], run.start[1]);
            end = run.finish();
            busy = hf.compute + hg.compute;
            progress.finish(f, run.end[fi]);
            progress.finish(g, run.end[gi]);
            if (opts.record_timeline) {  // each half as long as its compute, at its end
              Event ef{r,           f,        run.end[fi] - hf.compute,
                       run.end[fi], hf.waits, hf.waits * hf.inflight};
              Event eg{r,           g_ran,    run.end[gi] - hg.compute,
                       run.end[gi], hg.waits, hg.waits * hg.inflight};
              if (ef.end > eg.end) std::swap(ef, eg);
              res.timeline.events.push_back(ef);
              res.timeline.events.push_back(eg);
              if (hf.waits + hg.waits > 0)  // the nodes, for drawing
                for (const auto& [x, t0, t1] : run.nodes)
                  res.pair_nodes.push_back({r, x == fi ? f : g_ran, t0, t1});
            }
            // NOTE [Deferred W's in the simulator]: the W's that ran in it,
            // and what stays queued (the pair's own W among them).
            for (const WRun& wr : run.w_runs) {
              queued_w[r] = WQueue{wr.w};
              run_w(r, wr.start, wr.parts);
            }
            queued_w[r] = run.queue;
          } else {
            progress.finish(a, end);
          }
          free_at[r] = end + costs.send_cost(s, a);  // NOTE [Sending occupies the sender]
          last_end[r] = end;
          res.rank_busy[r] += busy;
          if (first_f[r] < 0 && (a.op == Op::F || a.op == Op::FB)) first_f[r] = start;
          auto on_f = [&](int st, int mb) {
            mem[r] += costs.stage_mem_b_of(s, st);
            wake(s.next_stage(st, mb));
          };
          auto on_g = [&](int st, int mb) { wake(s.prev_stage(st, mb)); };
          switch (a.op) {
            case Op::F:
              on_f(a.stage, a.microbatch);
              break;
            case Op::I:
              on_g(a.stage, a.microbatch);
              mem[r] -= costs.stage_mem_b_of(s, a.stage) - costs.stage_mem_w_of(s, a.stage);
              break;
            case Op::W:
              mem[r] -= costs.stage_mem_w_of(s, a.stage);
              break;
            case Op::B:
              on_g(a.stage, a.microbatch);
              mem[r] -= costs.stage_mem_b_of(s, a.stage);
              break;
            case Op::FB:
              on_f(a.stage, a.microbatch);
              on_g(a.stage2, a.microbatch2);
              res.peak_memory[r] = std::max(res.peak_memory[r], mem[r]);
              mem[r] -= costs.stage_mem_b_of(s, a.stage2);
              if (defer) mem[r] += costs.stage_mem_w_of(s, a.stage2);  // held until its W
              break;
            default:
              break;
          }
          res.peak_memory[r] = std::max(res.peak_memory[r], mem[r]);
          if (opts.record_timeline && !(a.op == Op::FB && opts.overlap_pairs))
            res.timeline.events.push_back(Event{r, a, end - busy, end, inner_n, inner_s});
        }
        ++pc[r];
        --remaining;
        if (pc[r] == row.size())  // NOTE [Deferred W's in the simulator]: what is left
          while (!queued_w[r].empty())
            free_at[r] = run_w(r, free_at[r]);
      }
    }
  }
  if (remaining > 0) {
    std::string msg = "schedule '" + s.name + "' deadlocks in simulation; stuck:";
    for (int r = 0; r < p; ++r)
      if (pc[r] < s.actions[r].size())
        msg += " rank " + std::to_string(r) + " at action " + std::to_string(pc[r]) + " (" +
               to_string(s.actions[r][pc[r]]) + ");";
    msg += " each waits for an input that no rank can produce (check the order)";
    throw std::runtime_error(msg);
  }
  double busy_total = 0.0;
  for (int r = 0; r < p; ++r) {
    res.makespan = std::max(res.makespan, last_end[r]);
    res.rank_span[r] = first_f[r] < 0 ? 0.0 : last_end[r] - first_f[r];
    res.span = std::max(res.span, res.rank_span[r]);
    res.work = std::max(res.work, res.rank_busy[r]);
    res.max_peak_memory = std::max(res.max_peak_memory, res.peak_memory[r]);
    busy_total += res.rank_busy[r];
  }
  for (int r = 0; r < p; ++r)
    res.rank_idle[r] = res.makespan - res.rank_busy[r];
  res.bubble_rate = res.span > 0 ? (res.span - res.work) / res.span : 0.0;
  if (res.bubble_rate < 0) res.bubble_rate = 0.0;  // guards rounding on zero-bubble schedules
  res.idle_fraction = res.makespan > 0 ? 1.0 - busy_total / (p * res.makespan) : 0.0;
  res.comm_volume = comm_volume(s);
  return res;
}

Timeline pair_nodes_drawn(const SimResult& r) {
  Timeline t = r.timeline;
  if (r.pair_nodes.empty()) return t;
  std::set<std::pair<int, std::string>> cut;  // (rank, action) of the halves with nodes
  for (const Event& e : r.pair_nodes)
    cut.emplace(e.rank, to_string(e.action));
  t.events.clear();
  for (const Event& e : r.timeline.events)
    if (!cut.count({e.rank, to_string(e.action)})) t.events.push_back(e);
  t.events.insert(t.events.end(), r.pair_nodes.begin(), r.pair_nodes.end());
  return t;
}

}  // namespace hp::schedule
