// hp/schedule/simulate.h: the cost model, the timeline (simulated or measured)
// and the event simulation that turns a Schedule into timings and statistics.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "hp/schedule/action.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/timeline.h"

namespace hp::schedule {

/// Per-op costs and activation memory.
///
/// NOTE [Cost units]
/// `f`, `b`, `w`, `mem_b` and `mem_w` are for one rank's share of the model
/// (model / p). A schedule that cuts the model into more chunks (interleaved
/// into v*p, ZB-V into 2p) scales each stage's cost by p / num_chunks, so all
/// schedules compare on the same model. `b` is the cost of `I` (dx), the Zero
/// Bubble paper's B (see NOTE [Naming of B]); a fused `B` costs b + w; an `FB`
/// pair costs f + b + w of its halves (no overlap gain in compute). Memory
/// (the paper's model): F adds mem_b, I turns mem_b into mem_w, W frees mem_w,
/// B frees mem_b. The per-stage vectors, when not empty, must hold one entry
/// per stage of the schedule they are used with (num_stages) and override the
/// scaled defaults with absolute values (e.g. measured costs per stage).
///
/// `stage_comm[s]` is the latency of a cross-rank transfer over the boundary
/// between stage s and the stage after it on its route: the activation s
/// sends forward and the input gradient it receives back cross the same
/// boundary, so both cost stage_comm[s] (a last stage's entry is unused).
/// Without it every cross-rank transfer costs `comm`; a hand-off between two
/// stages on one rank is free either way.
///
/// NOTE [Sending occupies the sender]
/// `send` (or `stage_send[s]`) is the time the rank of stage s stays busy
/// after a compute action whose output (an activation forward, an input
/// gradient back) goes to another rank: posting the send. On loopback Gloo
/// the posting runs the copy into the socket in the calling thread, and on a
/// rank pinned to one core the transport's threads compete with it: measured
/// 0.2-5 ms per 128 KiB message, 1-5 % of a step, more on schedules with more
/// transfers per rank. `comm` still runs from the producer's end (the
/// measured one-way latency includes the posting); the sender starts its
/// next action `send` later. Busy time and bubble statistics count compute
/// only, as the measured ones do. Default 0: transfers occupy no rank (a
/// device's copy engine, NCCL).
///
/// NOTE [Waits inside a chunk]
/// A chunk may wait on communication of its own between its computations:
/// an expert layer posts its dispatch, waits, runs the experts, posts its
/// combine and waits (its backward the same in reverse). `stage_inner[s]`
/// gives, per F, I and W of stage s, how many such waits it makes and the
/// seconds each is in flight; a fused B makes its I's and its W's (on a first
/// stage, whose I has no input gradient to compute, the all-to-alls'
/// backwards fall in W). The compute costs (`f`, `b`, `w`) stay the CPU's
/// share alone. An action that runs by itself waits each one whole: it lasts
/// its compute plus its waits' time, and is busy for its compute. In an
/// overlapped pair the halves are cut at those waits into waits + 1 nodes,
/// each the share of the compute that `*_nodes` gives (measured: where an
/// expert F exchanges its token counts before its tokens, the node between
/// the two waits is short), equal shares where none are given, and the partner's nodes run while a
/// half's communication is in flight (NOTE [An overlapped pair in the simulator] in
/// simulate.cpp). Measured: the `waits` and `waited` of a runtime's events
/// (costs_from_timeline).
struct InnerComm {
  int f_waits = 0;  ///< waits inside one F
  double f = 0.0;   ///< seconds each of them is in flight
  int i_waits = 0;  ///< waits inside one I
  double i = 0.0;
  int w_waits = 0;  ///< waits inside one W
  double w = 0.0;
  /// Each node's share of the op's compute (waits + 1 entries summing to
  /// 1), or empty: equal shares.
  std::vector<double> f_nodes{}, i_nodes{}, w_nodes{};
};

struct CostModel {
  double f = 1.0;      ///< forward
  double b = 1.0;      ///< input gradient I (the paper's B)
  double w = 1.0;      ///< weight gradient W
  double comm = 0.0;   ///< latency of one cross-rank transfer (SEND -> RECV)
  double mem_b = 1.0;  ///< activation memory held from F until I (or B)
  double mem_w = 0.5;  ///< memory held from I until W
  std::vector<double> stage_f, stage_b, stage_w;  ///< optional absolute per-stage costs
  std::vector<double> stage_mem_b, stage_mem_w;   ///< optional absolute per-stage memory
  std::vector<double> stage_comm;      ///< optional per-boundary transfer latency (above)
  double send = 0.0;                   ///< sender busy per cross-rank output (NOTE [Sending ...])
  std::vector<double> stage_send;      ///< optional per-stage `send`
  std::vector<InnerComm> stage_inner;  ///< optional per-stage waits inside a chunk (NOTE above)

  /// Compute time of a compute action on schedule s (0 for SEND/RECV).
  double cost(const Schedule& s, const Action& a) const;
  /// Per-stage F, I, W costs after scaling (NOTE [Cost units]).
  double stage_cost(const Schedule& s, Op op, int stage) const;
  /// Per-stage activation memory after scaling.
  double stage_mem_b_of(const Schedule& s, int stage) const;
  double stage_mem_w_of(const Schedule& s, int stage) const;
  /// Latency of a hand-off over the boundary between route-consecutive stages
  /// `upstream` (earlier on the route) and `downstream`, in either direction:
  /// 0 when both are on one rank, else stage_comm[upstream] (or `comm`).
  double boundary_cost(const Schedule& s, int upstream, int downstream) const;
  /// Time the rank of `stage` stays busy after compute action `a` (on that
  /// rank) hands its outputs to other ranks: `send` (or stage_send) per
  /// output that leaves the rank (NOTE [Sending occupies the sender]).
  double send_cost(const Schedule& s, const Action& a) const;
  /// The waits inside compute action `a` (an FB's two halves together):
  /// their number and their seconds in flight in all (NOTE
  /// [Waits inside a chunk]); {0, 0} without stage_inner.
  std::pair<int, double> inner_waits(const Action& a) const;
  /// Throws std::invalid_argument unless costs are positive and finite, comm
  /// and memory non-negative (per-stage entries included).
  void check() const;
  /// check(), and that every non-empty per-stage vector has `num_stages`
  /// entries; the message names the vector and the sizes.
  void check(int num_stages) const;
  /// True when some per-stage vector is set.
  bool per_stage() const;
};

/// Options of simulate().
struct SimOptions {
  bool record_timeline = true;  ///< fill SimResult::timeline
  /// Each FB pair runs as the executor's overlapped pair does (`--fb-overlap`,
  /// NOTE [An overlapped pair in the simulator] in simulate.cpp): its halves
  /// in the runner's order, each half's output leaving when that half ends
  /// (the timeline holds the halves as F and B events). False: the pair
  /// starts when both inputs are there and both outputs leave at its end.
  bool overlap_pairs = false;
  /// With overlap_pairs: each pair's lead is not the action's but the half
  /// under which the pair ends first (F on a tie); SimResult::backward_leads
  /// lists where B was chosen (order_pairs in fuse.h).
  bool choose_leads = false;
  /// With overlap_pairs: a pair's B half runs its I and queues its W, as the
  /// executor's defer_wgrad (NOTE [Deferred W's in the simulator] in
  /// simulate.cpp); the W's time and the memory it holds are counted.
  bool defer_wgrad = false;
  /// With overlap_pairs: at each wait the CPU goes to the half whose wait
  /// ends first, as the executor's `--pair-turns ready` (NOTE [Turns as
  /// messages arrive] in hp/pipeline/overlap.cpp); false: to the other half.
  bool pair_first_ready = false;
  /// With defer_wgrad and pair_first_ready, > 1: each queued W runs in this
  /// many parts, and a wait takes parts for as long as neither its message
  /// nor the other half's is there (`hp train --w-parts`: NOTE [Weight
  /// gradients until the message is there] in hp/pipeline/overlap.cpp); 1:
  /// one whole W per wait.
  int deferred_w_parts = 1;
};

/// SimOptions::pair_first_ready for a `--pair-turns` word, as hp train
/// takes its turns on CPU ranks (NOTE [Turns as messages arrive] in
/// hp/pipeline/overlap.cpp): "ready", or "auto" without deferred W's (with
/// them "auto" is fixed, whose W's keep float32 bits from run to run);
/// "fixed" never. Throws std::invalid_argument for any other word.
bool pair_turns_ready(const std::string& pair_turns, bool defer_wgrad);

/// Deferred W's (`--defer-wgrad`) against none, both simulated under the
/// same costs (NOTE [Deferred W's where they lower the step] in
/// simulate.cpp).
struct DeferredWChoice {
  double step_without = 0.0, step_with = 0.0;  ///< predicted makespans
  double peak_without = 0.0, peak_with = 0.0;  ///< predicted max_peak_memory
  bool defer = false;  ///< step_with is at least the gain (kDeferredWGain) shorter
};

/// The share by which deferred W's must shorten the predicted step to be
/// chosen (NOTE [Deferred W's where they lower the step]).
constexpr double kDeferredWGain = 0.03;

/// Simulates `s` under `costs` with overlapped pairs, without deferred W's
/// (`pair_turns` as resolved without them) and with them (as resolved with
/// them), on CPU ranks when `cpu` (on a device the turns are fixed). Where
/// the turns refuse deferred W's (`ready` with `recompute`) only the first
/// is simulated and `defer` is false. `gain`: the share by which the step
/// must shorten (1: never chosen; below 0: chosen up to that share longer).
/// std::invalid_argument for a gain outside -1..1 or turns not spelt
/// "auto", "ready" or "fixed".
DeferredWChoice choose_deferred_w(const Schedule& s, const CostModel& costs,
                                  const std::string& pair_turns, bool cpu, bool recompute,
                                  double gain = kDeferredWGain);

/// std::invalid_argument unless -1 <= gain <= 1 (choose_deferred_w's gain).
void check_deferred_w_gain(double gain);

/// What simulate() reports.
///
/// NOTE [Bubble rate]
/// As the Zero Bubble paper defines it: span_r is rank r's time from its first
/// F start to its last op end; span = max_r span_r; work = max_r busy_r (equal
/// to m(F+B+W) on balanced schedules); bubble_rate = (span - work) / span.
/// `idle_fraction` is the seed's wall-clock measure: total idle over
/// p * makespan.
struct SimResult {
  double makespan = 0.0;            ///< latest op end
  double span = 0.0;                ///< max over ranks of first-F-start to last-end
  double work = 0.0;                ///< max over ranks of busy time
  double bubble_rate = 0.0;         ///< (span - work) / span
  double idle_fraction = 0.0;       ///< sum of idle / (p * makespan)
  std::vector<double> rank_busy;    ///< [p] compute time
  std::vector<double> rank_idle;    ///< [p] makespan - busy
  std::vector<double> rank_span;    ///< [p] first F start to last end
  std::vector<double> peak_memory;  ///< [p] peak activation memory
  /// SimOptions::choose_leads: (rank, action index) of each FB pair whose B
  /// half was chosen to lead.
  std::vector<std::pair<int, size_t>> backward_leads;
  /// With overlap_pairs and record_timeline: the nodes of each pair whose
  /// halves wait inside their chunks (NOTE [Waits inside a chunk]), as they
  /// ran, each an event of its half's action (`hp schedule show` draws them
  /// in place of the halves: pair_nodes_drawn).
  std::vector<Event> pair_nodes;
  /// [p] with overlap_pairs: the overlapped pairs' waits on communication
  /// (inputs and chunks' own), the part during which the rank computed (the
  /// other half, or a queued W) and the rest, as the executor's PairStats
  /// counts them (NOTE [What a pair hides, predicted] in simulate.cpp).
  std::vector<double> rank_pair_hidden, rank_pair_exposed;
  double max_peak_memory = 0.0;  ///< max over ranks of peak_memory
  int comm_volume = 0;           ///< cross-rank transfers (activations + gradients)
  Timeline timeline;             ///< compute events (when recorded)
};

/// r.timeline with each overlapped pair's halves replaced by their nodes
/// (r.pair_nodes), for drawing: the halves of a pair interleave there.
Timeline pair_nodes_drawn(const SimResult& r);

/// Bubble statistics of any timeline (e.g. one measured by a runtime), with
/// the definitions of NOTE [Bubble rate]: span, work, bubble_rate,
/// idle_fraction and the per-rank busy/idle/span fields of SimResult (memory
/// and comm fields stay zero). Compute events only; SEND/RECV are ignored.
SimResult timeline_stats(const Timeline& t);

/// The cost model of schedule `s` from one measured run of it (a runtime's
/// timeline of one step, SEND events included) and the measured latency
/// `comm` of one transfer: per-stage F, I, W and send times (NOTE [Costs from
/// a measured timeline]). Throws std::invalid_argument when an event names a
/// stage the schedule does not have.
CostModel costs_from_timeline(const Schedule& s, const Timeline& t, double comm);

/// Event simulation: every rank runs its list in order; an action starts when
/// the rank is free and its inputs have arrived (producer end + comm across
/// ranks; local hand-offs are free). SEND/RECV actions take no time
/// (receives are posted early and waited at the consumer); a compute action
/// whose output leaves the rank keeps the rank busy `send` longer (NOTE
/// [Sending occupies the sender]), lowered or not. Throws std::runtime_error naming
/// each stuck rank and action if the schedule deadlocks.
SimResult simulate(const Schedule& s, const CostModel& costs, const SimOptions& opts = {});

/// Number of cross-rank transfers the schedule implies (2 per cross-rank hop
/// of each microbatch route: activation forward, gradient backward).
int comm_volume(const Schedule& s);

}  // namespace hp::schedule
