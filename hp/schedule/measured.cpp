// hp/schedule/measured.cpp: what a measured timeline says - its bubble
// statistics (timeline_stats) and the cost model it implies
// (costs_from_timeline), both declared in simulate.h.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "hp/schedule/simulate.h"

namespace hp::schedule {

// NOTE [Costs from a measured timeline]
// Per stage, means over the step's microbatches (a rank's total is what its
// makespan adds up, so a slow outlier counts as what it cost):
// - F from F events; the backward of a microbatch from a fused B, or from its
//   I plus its W. A stage that ran both forms gets I and W scaled so that
//   I + W is the mean backward (the split form is 5-10 % slower than the
//   fused one on CPU, and the model has one backward per stage), in the
//   proportion its split I and W had (half and half where it never split).
// - FB (F of one microbatch beside B of another, one event) is split in
//   proportion to the stage means of its two halves measured alone, or, where
//   one half never ran alone, as the event less the other half; where neither
//   did, one third F (the backward is about twice the forward).
// - the waits inside a chunk (NOTE [Waits inside a chunk] in simulate.h):
//   per stage, the mean number an F, I and W made, rounded, and the mean
//   time one was in flight; a stage that never split its backward gives its
//   B's as its I's; an FB run as one event gives none. Where events carry
//   their nodes, each node's mean share of the op's compute (over the events
//   with that many waits).
// - send: the mean time the stage's rank spent posting one of its SENDs
//   (NOTE [Sending occupies the sender]); sends posted in one batch share the
//   batch's time equally (their events carry the whole batch's span).
CostModel costs_from_timeline(const Schedule& s, const Timeline& t, double comm) {
  const int S = s.num_stages;
  auto stage_ok = [&](int st) {
    if (st < 0 || st >= S)
      throw std::invalid_argument("costs_from_timeline: an event names stage " +
                                  std::to_string(st) + " but the schedule has " +
                                  std::to_string(S) + " stages");
    return st;
  };
  struct Sum {
    double total = 0;
    int n = 0;
    void add(double v) { total += v, n++; }
    double mean() const { return n ? total / n : 0.0; }
  };
  std::vector<Sum> f(S), i(S), w(S), back(S), send(S);
  // NOTE [Waits inside a chunk]: per stage, F's and backwards' waits (count,
  // seconds) and how many events carried them.
  struct Waits {
    Sum f, i, w, b;  // seconds waited per event, and the events
    int f_waits = 0, i_waits = 0, w_waits = 0, b_waits = 0;
  };
  std::vector<Waits> inner(S);
  // (stage, op, waits) -> the sum of the events' node shares, and how many.
  std::map<std::tuple<int, int, int>, std::pair<std::vector<double>, int>> shares;
  bool any_inner = false;
  // Batches of sends: events of one rank with the same span.
  std::map<std::tuple<int, double, double>, int> batch;
  for (const Event& e : t.events)
    if (e.action.op == Op::SEND_F || e.action.op == Op::SEND_B) batch[{e.rank, e.start, e.end}]++;
  for (const Event& e : t.events) {
    const double d = e.end - e.start;
    const Action& a = e.action;
    if (e.waits > 0) any_inner = true;
    if (a.op == Op::F || a.op == Op::I || a.op == Op::W || a.op == Op::B) {
      Waits& in = inner[stage_ok(a.stage)];
      Sum& sum = a.op == Op::F ? in.f : a.op == Op::I ? in.i : a.op == Op::W ? in.w : in.b;
      int& n = a.op == Op::F   ? in.f_waits
               : a.op == Op::I ? in.i_waits
               : a.op == Op::W ? in.w_waits
                               : in.b_waits;
      sum.add(e.waited), n += e.waits;
      double total = 0.0;
      for (double v : e.nodes)
        total += v;
      if (e.waits > 0 && e.nodes.size() == size_t(e.waits + 1) && total > 0) {
        auto& [sums, count] = shares[{a.stage, int(a.op), e.waits}];
        sums.resize(e.nodes.size(), 0.0);
        for (size_t k = 0; k < e.nodes.size(); ++k)
          sums[k] += e.nodes[k] / total;
        ++count;
      }
    }
    switch (a.op) {
      case Op::F:
        f[stage_ok(a.stage)].add(d);
        break;
      case Op::I:
        i[stage_ok(a.stage)].add(d);
        break;
      case Op::W:
        w[stage_ok(a.stage)].add(d);
        break;
      case Op::B:
        back[stage_ok(a.stage)].add(d);
        break;
      case Op::SEND_F:
      case Op::SEND_B:
        send[stage_ok(a.stage)].add(d / batch[{e.rank, e.start, e.end}]);
        break;
      default:
        break;
    }
  }
  // A microbatch's I and W together are one backward of the stage.
  for (int st = 0; st < S; ++st)
    if (i[st].n > 0 && w[st].n > 0) {
      const int pairs = std::min(i[st].n, w[st].n);
      back[st].total += (i[st].mean() + w[st].mean()) * pairs;
      back[st].n += pairs;
    }
  // FB halves, from what ran alone.
  const std::vector<Sum> f_alone = f, back_alone = back;
  for (const Event& e : t.events) {
    if (e.action.op != Op::FB) continue;
    const int sf = stage_ok(e.action.stage), sb = stage_ok(e.action.stage2);
    const double d = e.end - e.start;
    const bool hf = f_alone[sf].n > 0, hb = back_alone[sb].n > 0;
    const double fe = f_alone[sf].mean(), be = back_alone[sb].mean();
    double share = 1.0 / 3;
    if (hf && hb && fe + be > 0)
      share = fe / (fe + be);
    else if (hf && d > 0)
      share = std::min(1.0, fe / d);
    else if (hb && d > 0)
      share = std::max(0.0, 1.0 - be / d);
    f[sf].add(d * share);
    back[sb].add(d * (1 - share));
  }
  CostModel c;
  c.comm = comm;
  c.stage_f.resize(S), c.stage_b.resize(S), c.stage_w.resize(S), c.stage_send.resize(S);
  Sum all_sends;
  for (int st = 0; st < S; ++st) {
    const double bt = back[st].mean();
    const double ie = i[st].mean(), we = w[st].mean();
    const double i_share = ie + we > 0 ? ie / (ie + we) : 0.5;
    c.stage_f[st] = std::max(f[st].n ? f[st].mean() : 1e-6, 1e-9);
    c.stage_b[st] = std::max(bt * i_share, 1e-9);
    c.stage_w[st] = std::max(bt * (1 - i_share), 1e-9);
    c.stage_send[st] = send[st].mean();
    all_sends.total += send[st].total, all_sends.n += send[st].n;
  }
  c.send = all_sends.mean();
  if (any_inner) {  // the mean count per action, each wait's mean time in flight
    c.stage_inner.resize(S);
    for (int st = 0; st < S; ++st) {
      const Waits& in = inner[st];
      InnerComm& ic = c.stage_inner[st];
      auto per = [](const Sum& sum, int n, int& waits, double& each) {
        waits = sum.n > 0 ? static_cast<int>(std::lround(double(n) / sum.n)) : 0;
        each = n > 0 ? sum.total / n : 0.0;
      };
      per(in.f, in.f_waits, ic.f_waits, ic.f);
      if (in.i.n > 0 || in.w.n > 0) {  // split: I's and W's own; else a fused B's, as I's
        per(in.i, in.i_waits, ic.i_waits, ic.i);
        per(in.w, in.w_waits, ic.w_waits, ic.w);
      } else {
        per(in.b, in.b_waits, ic.i_waits, ic.i);
      }
      auto mean_shares = [&](Op op, int waits, std::vector<double>& out) {
        auto it = shares.find({st, int(op), waits});
        if (waits == 0 || it == shares.end()) return;
        for (double v : it->second.first)
          out.push_back(v / it->second.second);
      };
      mean_shares(Op::F, ic.f_waits, ic.f_nodes);
      mean_shares(Op::I, ic.i_waits, ic.i_nodes);
      mean_shares(Op::W, ic.w_waits, ic.w_nodes);
    }
  }
  return c;
}

SimResult timeline_stats(const Timeline& t) {
  SimResult r;
  const int p = t.num_ranks;
  r.rank_busy.assign(p, 0.0);
  r.rank_idle.assign(p, 0.0);
  r.rank_span.assign(p, 0.0);
  r.peak_memory.assign(p, 0.0);  // a measured timeline carries no memory: zeros, never absent
  std::vector<double> first_f(p, std::numeric_limits<double>::infinity()), last_end(p, 0.0);
  for (const Event& e : t.events) {
    if (e.rank < 0 || e.rank >= p || !is_compute(e.action.op)) continue;
    r.rank_busy[e.rank] += e.end - e.start;
    last_end[e.rank] = std::max(last_end[e.rank], e.end);
    if (e.action.op == Op::F || e.action.op == Op::FB)
      first_f[e.rank] = std::min(first_f[e.rank], e.start);
    r.makespan = std::max(r.makespan, e.end);
  }
  double idle_sum = 0.0;
  for (int k = 0; k < p; ++k) {
    if (std::isfinite(first_f[k])) r.rank_span[k] = last_end[k] - first_f[k];
    r.rank_idle[k] = r.makespan - r.rank_busy[k];
    idle_sum += r.rank_idle[k];
    r.span = std::max(r.span, r.rank_span[k]);
    r.work = std::max(r.work, r.rank_busy[k]);
  }
  r.bubble_rate = r.span > 0 ? (r.span - r.work) / r.span : 0.0;
  r.idle_fraction = r.makespan > 0 && p > 0 ? idle_sum / (p * r.makespan) : 0.0;
  return r;
}

}  // namespace hp::schedule
