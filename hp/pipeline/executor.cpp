// Executor: the walk over one rank's lowered actions (see NOTE [Executor
// protocol]): batches of SEND/RECV posted in list order, local hand-offs, a
// helper thread that completes sends and frees sent outputs, and the step's
// timers (host clock, device events).
#include "hp/pipeline/executor.h"

#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "hp/core/memory.h"
#include "hp/pipeline/executor_state.h"
#include "hp/pipeline/frames.h"
#include "hp/schedule/action.h"
#include "hp/schedule/progress.h"

namespace hp::pipeline {
namespace {

using detail::SendReaper;

using schedule::Action;
using schedule::Op;
using Clock = std::chrono::steady_clock;

}  // namespace

Executor::State::State(const schedule::Schedule& s, int r, PipelineStage& st,
                       std::shared_ptr<distributed::Comm> c, ExecutorOptions o)
    : sched(s),
      rank(r),
      stage(st),
      comm(std::move(c)),
      opts(std::move(o)),
      actions(s.actions.at(r)) {
  if (opts.make_timer) {
    timer = opts.make_timer();
    TORCH_CHECK(timer != nullptr, "ExecutorOptions::make_timer returned no timer");
  } else {
    timer = opts.device.is_cpu() ? make_host_timer() : make_device_timer(opts.device);
  }
  for (size_t i = 0; i < actions.size();) {
    if (!schedule::is_comm(actions[i].op)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < actions.size() && schedule::is_comm(actions[j].op))
      ++j;
    batch_at[i] = batches.size();
    batches.emplace_back(i, j);
    i = j;
  }
  const bool free_early = comm->early_receives_are_free();
  TORCH_CHECK(opts.receive_lookahead >= 0, "ExecutorOptions::receive_lookahead is ",
              opts.receive_lookahead, "; give a number of batches (0: none ahead)");
  TORCH_CHECK(opts.receive_lookahead <= 0 || free_early, "ExecutorOptions::receive_lookahead is ",
              opts.receive_lookahead, ", but the ", comm->backend_name(),
              " Comm does not say that receives posted ahead are free (where a rank's "
              "operations run in posting order, as on NCCL, they would hold back its sends; "
              "NOTE [Receives posted ahead])");
  lookahead = size_t(opts.receive_lookahead);
  if (!opts.layout && !opts.activation_shape) {
    frames = std::make_unique<Frames>(s.num_ranks, opts.device, opts.first_frame_bytes);
  }
}

std::string Executor::State::where(const Action& a) const {
  std::ostringstream os;
  os << "rank " << rank << " action " << schedule::to_string(a);
  return os.str();
}

// NOTE [The actions around a failure]
// A failed action's error ends with this rank's actions around it, the
// failed one in brackets, as PyTorch's pipelining prints the schedule: which
// transfers came before it and what the rank was about to do says more
// than the action alone (a mismatched order, a missing send).
std::string Executor::State::around(size_t i) const {
  constexpr size_t kBefore = 6, kAfter = 4;
  const size_t from = i > kBefore ? i - kBefore : 0;
  const size_t to = std::min(actions.size(), i + kAfter + 1);
  std::ostringstream os;
  os << "\n  rank " << rank << "'s actions " << from << "-" << to - 1 << " of " << actions.size()
     << ":";
  for (size_t k = from; k < to; ++k) {
    const std::string text = schedule::to_string(actions[k]);
    os << " " << (k == i ? "[" + text + "]" : text);
  }
  return os.str();
}

// Rethrows the error of action i with where it happened, before and after.
[[noreturn]] void Executor::State::fail_at(size_t i, const std::string& what) const {
  const std::string prefix = where(actions[i]) + what + ": ";
  try {
    throw;
  } catch (const distributed::CommError& e) {
    throw distributed::CommError(prefix + e.what() + around(i), e.lost_ranks(), e.timed_out());
  } catch (const c10::Error& e) {
    throw std::runtime_error(prefix + e.what_without_backtrace() + around(i));
  } catch (const std::exception& e) {
    throw std::runtime_error(prefix + e.what() + around(i));
  }
}

// What stage `stage_id` outputs for microbatch `mb` (NOTE [Messages
// between stages]): ExecutorOptions::layout, or one tensor that takes a
// gradient.
Layout Executor::State::layout_for(int stage_id, int mb) const {
  if (opts.layout) return opts.layout(stage_id, mb);
  return {Leaf{opts.dtype, opts.activation_shape(stage_id, mb), true}};
}

// The receives of a RECV action: fresh buffers, one per tensor of the
// message, from the producer's rank.
std::vector<distributed::P2POp> Executor::State::recv_ops(const Action& a, Posted& posted) {
  const bool fwd = a.op == Op::RECV_F;
  int producer =
      fwd ? sched.prev_stage(a.stage, a.microbatch) : sched.next_stage(a.stage, a.microbatch);
  TORCH_CHECK(producer >= 0, where(a), ": nothing on the route sends this");
  TORCH_CHECK(!recvs.count(std::make_tuple(fwd ? 0 : 1, a.stage, a.microbatch)), where(a),
              ": received twice");
  // A forward message is what the producer outputs; a backward one the
  // gradients of what this stage outputs, for its leaves that take one.
  if (frames) {  // NOTE [Messages that describe themselves] in frames.h
    posted.peer = rank_of(producer);
    return {frames->expect(posted.peer, &posted.number)};
  }
  const Layout layout = layout_for(fwd ? producer : a.stage, a.microbatch);
  std::vector<distributed::P2POp> ops;
  for (const Leaf& leaf : layout) {
    if (fwd) posted.takes_grad.push_back(leaf.grad);
    if (!fwd && !leaf.grad) continue;
    posted.buffers.push_back(
        torch::empty(leaf.shape, torch::TensorOptions().dtype(leaf.dtype).device(opts.device)));
    ops.push_back(distributed::P2POp::recv(posted.buffers.back(), rank_of(producer)));
  }
  return ops;
}

Message Executor::State::take_recv(int kind, int stage_id, int mb, const Action& consumer,
                                   std::vector<bool>* takes_grad) {
  auto it = recvs.find(std::make_tuple(kind, stage_id, mb));
  TORCH_CHECK(it != recvs.end(), where(consumer), ": its input was never received (no ",
              kind == 0 ? "RECV_F" : "RECV_B", " before it in the action list)");
  Posted& posted = it->second;
  // NOTE [Weight gradients in the waits] in overlap.cpp: outside a pair,
  // one queued W before each receive's wait, a span of its own that the
  // waiting action's compute excludes.
  if (!in_pair && !deferred_w.empty()) {
    const int w_start = timer->mark();
    run_deferred_w_span();
    if (waits_of_running != nullptr) waits_of_running->emplace_back(w_start, timer->mark());
    ++stats.deferred_w_in_waits;
  }
  bool blocks = false;
  const int start = timer->mark();
  Message buffers;
  ReceiveScope receiving;  // NOTE [A chunk's own waits] in step_timer.h
  if (frames) {
    blocks = !opts.device.is_cpu() || (!posted.works.empty() && posted.works[0].blocks_host());
    buffers = frames->take(posted.peer, posted.number, takes_grad,
                           [this](const distributed::P2POp& op) { return comm->batch({op})[0]; });
  } else {
    for (distributed::Work& w : posted.works) {
      blocks = blocks || w.blocks_host();
      w.wait();
    }
    buffers = std::move(posted.buffers);
    if (takes_grad != nullptr) *takes_grad = std::move(posted.takes_grad);
  }
  const int end = timer->mark();
  if (blocks) ++stats.host_syncs;
  comm_spans.emplace_back(start, end);
  // The wait is the receive's event (NOTE [Compute events exclude waits] in step_timer.cpp).
  spans.push_back({Action::make(kind == 0 ? Op::RECV_F : Op::RECV_B, stage_id, mb), start, end});
  if (waits_of_running != nullptr) waits_of_running->emplace_back(start, end);
  recvs.erase(it);
  return buffers;
}

// The sends of a SEND action: the output (F) or input gradients (I/B) it
// names, one per tensor, to the consumer's rank; `on_done` frees a sent
// output.
std::vector<distributed::P2POp> Executor::State::send_ops(const Action& a,
                                                          std::function<void()>& on_done) {
  const bool fwd = a.op == Op::SEND_F;
  const int mb = a.microbatch;
  int consumer = fwd ? sched.next_stage(a.stage, mb) : sched.prev_stage(a.stage, mb);
  TORCH_CHECK(consumer >= 0, where(a), ": nothing on the route receives this");
  Message m;
  std::vector<bool> grad;
  if (fwd) {
    m = stage.output(a.stage, mb);
    if (frames) grad = stage.output_takes_grad(a.stage, mb);
    if (opts.layout) check_layout(a, m, opts.layout(a.stage, mb));
    if (opts.release_sent_outputs) {
      PipelineStage* st = &stage;
      int s = a.stage;
      on_done = [st, s, mb] { st->release_output(s, mb); };
    }
  } else {
    auto it = pending_dx.find({a.stage, mb});
    TORCH_CHECK(it != pending_dx.end(), where(a), ": no input gradient to send (I must run first)");
    m = std::move(it->second);
    pending_dx.erase(it);
  }
  int64_t bytes = 0;
  for (const torch::Tensor& t : m)
    bytes += static_cast<int64_t>(t.nbytes());
  stats.largest_message_bytes = std::max(stats.largest_message_bytes, bytes);
  if (frames) {  // gradients take none
    if (!fwd) grad.assign(m.size(), false);
    return frames->send(m, grad, rank_of(consumer));
  }
  std::vector<distributed::P2POp> ops;
  for (const torch::Tensor& t : m) {
    TORCH_INTERNAL_ASSERT(t.is_contiguous(), where(a), ": what is sent is contiguous");
    ops.push_back(distributed::P2POp::send(t, rank_of(consumer)));
  }
  return ops;
}

// A stage's output against the layout its receiver posted buffers for.
void Executor::State::check_layout(const Action& a, const Message& m, const Layout& want) const {
  const Layout got = layout_of(m);
  if (got == want) return;
  std::string which;
  for (size_t i = 0; i < std::max(got.size(), want.size()); ++i)
    if (i >= got.size() || i >= want.size() || got[i] != want[i]) {
      which = "tensor " + std::to_string(i) + " differs first";
      break;
    }
  TORCH_CHECK(false, where(a), ": stage ", a.stage, " microbatch ", a.microbatch, " output ",
              to_string(got), " where its layout says ", to_string(want), " (", which, ")");
}

// NOTE [Receives posted ahead]
// Gloo's TCP transport moves a message only once both ends posted it: a
// posted receive writes a "ready" note to the sender, and a send posted
// after that note arrived is written at once by the posting thread; a send
// posted before it waits for the sender's event-loop thread to answer the
// note. That thread shares the core with the rank's main thread, which is
// computing by then, and the scheduler may let the computation run on to
// its next tick: on the benchmark host (4 ms ticks, 1F1B, 32 microbatches
// of 2 KB) one message in five arrived 1-5 ms after its send was posted
// (seen with `perf sched`: the sender's event-loop thread woken by the
// note, then runnable for 4.3 ms behind its own rank's compute). Posting
// each batch's receives a batch earlier (ExecutorOptions::receive_lookahead
// 1) cut that lateness from 8.5-9.9 to 1-3 ms per step, and in the compute
// setting from 3.8-4.4 to 0.2-0.3 ms, yet the steps got slower in paired
// runs (PyTorch / hp step 1.23 -> 1.03 on 1F1B and 1.41 -> 1.21 on GPipe
// in the overhead setting, 1.20 -> 0.91 on 1F1B in the compute one): the
// data now lands while the receiver computes (its event-loop thread
// preempts the computation to read it), the sender writes it inline on its
// compute thread, and more arrivals meet a posting thread holding the
// connection's lock (NOTE [Sends before receives] in lower.cpp). So none
// are posted ahead by default; the option stays for hosts where transport
// threads have cores of their own. Only where the Comm says it is free: on
// NCCL a rank's operations run in posting order on one stream, so an
// early receive would hold back the sends behind it.
//
// Posts actions[i, j) (consecutive SEND/RECV actions) as one batch, in
// list order (NOTE [Executor protocol]), with the RECVs of the next
// `lookahead` batches after them (their order kept: every channel's
// receives are still posted in list order).
void Executor::State::post_batch(size_t i, size_t j) {
  std::vector<size_t> which;
  for (size_t k = i; k < j; ++k)
    if (!posted_ahead[k]) which.push_back(k);
  const size_t b = batch_at.at(i);
  for (size_t ahead = b + 1; ahead <= b + lookahead && ahead < batches.size(); ++ahead)
    for (size_t k = batches[ahead].first; k < batches[ahead].second; ++k)
      if (!is_send(actions[k].op) && !posted_ahead[k]) {
        posted_ahead[k] = 1;
        which.push_back(k);
      }
  if (which.empty()) return;
  std::vector<distributed::P2POp> ops;
  std::vector<size_t> first_op(which.size() + 1,
                               0);  // action n's ops: [first_op[n], first_op[n+1])
  std::vector<Posted> posted(which.size());
  std::vector<std::function<void()>> on_done(which.size());
  for (size_t n = 0; n < which.size(); ++n) {
    const Action& a = actions[which[n]];
    auto mine = is_send(a.op) ? send_ops(a, on_done[n]) : recv_ops(a, posted[n]);
    ops.insert(ops.end(), mine.begin(), mine.end());
    first_op[n + 1] = ops.size();
  }
  auto works = comm->batch(ops);
  for (size_t n = 0; n < which.size(); ++n) {
    const Action& a = actions[which[n]];
    if (is_send(a.op)) {
      // The reaper holds each sent tensor while its send runs; the data is
      // freed by on_done after the message's last send (outputs: their
      // storage is swapped out) or when the reaper drops it (gradients).
      for (size_t k = first_op[n]; k < first_op[n + 1]; ++k)
        reaper->add(works[k], ops[k].tensor,
                    k + 1 == first_op[n + 1] ? std::move(on_done[n]) : std::function<void()>());
    } else {
      posted[n].works.assign(works.begin() + first_op[n], works.begin() + first_op[n + 1]);
      if (frames) frames->posted(posted[n].peer, posted[n].works.at(0));
      recvs.emplace(std::make_tuple(a.op == Op::RECV_F ? 0 : 1, a.stage, a.microbatch),
                    std::move(posted[n]));
    }
  }
}

// Where each input comes from: schedule::forward_input/backward_input,
// the same definition validation and the simulator use (NOTE [What an
// action waits for]).
// The input of F (s, mb), and which of its tensors take a gradient (the
// model's input takes none).
Message Executor::State::forward_input(int s, int mb, const Action& a,
                                       std::vector<bool>* takes_grad) {
  const schedule::InputSource in = schedule::forward_input(sched, s, mb);
  switch (in.kind) {
    case schedule::InputSource::Kind::Data:
      return opts.input_message ? opts.input_message(mb) : Message{opts.input(mb)};
    case schedule::InputSource::Kind::Local:
      *takes_grad = stage.output_takes_grad(in.stage, mb);
      return stage.output(in.stage, mb);
    default:
      return take_recv(0, s, mb, a, takes_grad);
  }
}

bool Executor::State::ends_in_loss(int s, int mb) const {
  return schedule::backward_input(sched, s, mb).kind == schedule::InputSource::Kind::Loss;
}

void Executor::State::forward(int s, int mb, const Action& a) {
  std::vector<bool> takes_grad;
  Message input = forward_input(s, mb, a, &takes_grad);
  stage.forward(s, mb, input, takes_grad, ends_in_loss(s, mb));
}

Message Executor::State::grad_for(int s, int mb, const Action& a) {
  stage.prepare_backward(s, mb);
  const schedule::InputSource in = schedule::backward_input(sched, s, mb);
  if (in.kind == schedule::InputSource::Kind::Loss) return {};
  if (in.kind == schedule::InputSource::Kind::Local) {
    auto it = local_grad.find({s, mb});
    TORCH_CHECK(it != local_grad.end(), where(a), ": the output gradient from stage ", in.stage,
                " (same rank) is not there yet; its I must run first");
    Message g = std::move(it->second);
    local_grad.erase(it);
    return g;
  }
  return take_recv(1, s, mb, a);
}

void Executor::State::store_dx(int s, int mb, Message dx) {
  int prev = sched.prev_stage(s, mb);
  if (prev < 0) return;
  if (rank_of(prev) == rank) {
    local_grad[{prev, mb}] = std::move(dx);
  } else {
    for (torch::Tensor& t : dx)
      t = t.contiguous();
    pending_dx[{s, mb}] = std::move(dx);
  }
}

void Executor::State::compute(const Action& a) {
  switch (a.op) {
    case Op::F:
      forward(a.stage, a.microbatch, a);
      break;
    case Op::I:
      store_dx(a.stage, a.microbatch,
               stage.backward_input(a.stage, a.microbatch, grad_for(a.stage, a.microbatch, a)));
      break;
    case Op::W:
      stage.backward_weight(a.stage, a.microbatch);
      break;
    case Op::B:
      store_dx(a.stage, a.microbatch,
               stage.backward(a.stage, a.microbatch, grad_for(a.stage, a.microbatch, a)));
      break;
    case Op::FB:  // NOTE [Overlapped pairs] in overlap.cpp
      run_pair(a);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "not a compute action");
  }
}

// Turns the step's marks into its events and sums; `last` is the step's last mark.
void Executor::State::resolve(int last) {
  auto sec = [&](int mark) { return timer->seconds(mark); };
  stats.compute = resolve_spans(*timer, rank, spans, stats.events);
  for (const auto& [c0, c1] : comm_spans)
    stats.comm_wait += sec(c1) - sec(c0);
  stats.wall = sec(last);
  // The chunks' own waits outside pairs (a pair's, in chunk_wait already,
  // are its idle CPU, not the sum of its halves' waits).
  for (const TimedSpan& sp : spans)
    if (sp.compute < 0) stats.chunk_wait += sp.inner_waited;
  stats.overhead = std::max(0.0, stats.wall - stats.compute - stats.comm_wait - stats.chunk_wait);
  stats.host_syncs += timer->host_syncs();
}

StepStats Executor::State::run() {
  TORCH_CHECK(sched.lowered, "the Executor runs lowered schedules; call schedule::lower first");
  // The stages' device is current for the step (streams, events, allocations).
  c10::OptionalDeviceGuard on_device;
  if (!opts.device.is_cpu()) on_device.reset_device(opts.device);
  std::optional<StepCacheScope> cache;  // NOTE [The step cache] in hp/core/memory.cpp
  if (opts.cache_cpu_memory && opts.device.is_cpu()) cache.emplace();
  stats = StepStats{};
  recvs.clear();
  deferred_w.clear();
  w_parts = WParts{};
  local_grad.clear();
  pending_dx.clear();
  spans.clear();
  comm_spans.clear();
  waits_of_running = nullptr;
  posted_ahead.assign(actions.size(), 0);
  stage.reset();
  reaper = std::make_unique<SendReaper>(opts.device);
  timer->start();
  timer->mark();  // time 0
  const size_t n = actions.size();
  for (size_t i = 0; i < n;) {
    const Action& a = actions[i];
    const int start = timer->mark();
    if (schedule::is_comm(a.op)) {
      const size_t j = batches[batch_at.at(i)].second;  // the batch's end
      try {
        ProfiledAction range(a);
        post_batch(i, j);
      } catch (const std::exception&) {
        fail_at(i, "");
      }
      const int end = timer->mark();
      comm_spans.emplace_back(start, end);
      // Posting a batch runs its sends' copies (on loopback): the sends' events.
      for (size_t k = i; k < j; ++k)
        if (is_send(actions[k].op) && !posted_ahead[k]) spans.push_back({actions[k], start, end});
      i = j;
      continue;
    }
    try {
      std::vector<std::pair<int, int>> waits;
      waits_of_running = &waits;
      running = i;
      pair_halves.clear();
      ChunkWaits own;  // NOTE [A chunk's own waits] in step_timer.h
      own_waits_of_running = &own;
      {
        ProfiledAction range(a);
        distributed::WaitObserverScope observe(&own);
        compute(a);
      }
      own.finish();
      own_waits_of_running = nullptr;
      waits_of_running = nullptr;
      const int end = timer->mark();
      stats.executed.push_back(a);
      if (pair_halves.empty()) {
        spans.push_back(
            {a, start, end, std::move(waits), -1, own.count, own.seconds, std::move(own.nodes)});
      } else {  // NOTE [An overlapped pair's events] in step_timer.cpp
        for (TimedSpan& half : pair_halves)
          spans.push_back(std::move(half));
        pair_halves.clear();
      }
      reaper->rethrow_if_failed();
    } catch (const std::exception&) {
      waits_of_running = nullptr;
      own_waits_of_running = nullptr;
      fail_at(i, "");
    }
    ++i;
  }
  // The deferred W's no wait took: after the step's last action, each its own event.
  while (!deferred_w.empty()) {
    run_deferred_w_span();
    ++stats.deferred_w_at_end;
  }
  const int drain_start = timer->mark();
  try {
    reaper->drain();
  } catch (const distributed::CommError& e) {
    throw e.with_context("rank " + std::to_string(rank) + " while completing the step's sends: ");
  } catch (const std::exception& e) {
    throw std::runtime_error("rank " + std::to_string(rank) +
                             " while completing the step's sends: " + e.what());
  }
  const int last = timer->mark();
  comm_spans.emplace_back(drain_start, last);
  if (reaper->took_host_blocking_sends()) ++stats.host_syncs;
  reaper.reset();
  if (frames) frames->end_step();
  TORCH_CHECK(recvs.empty() && local_grad.empty() && pending_dx.empty(), "rank ", rank,
              ": the step ended with ", recvs.size(), " unread receives, ", local_grad.size(),
              " unused local gradients and ", pending_dx.size(),
              " unsent input gradients; the action list is inconsistent");
  TORCH_CHECK(stage.in_flight() == 0, "rank ", rank, ": ", stage.in_flight(),
              " microbatches did not finish their W");
  resolve(last);
  stats.loss_sum = stage.loss_sum();
  if (!opts.device.is_cpu()) ++stats.host_syncs;  // the loss read from the device
  return std::move(stats);
}

Executor::Executor(const schedule::Schedule& schedule, int rank, PipelineStage& stage,
                   std::shared_ptr<distributed::Comm> comm, ExecutorOptions options) {
  TORCH_CHECK(comm != nullptr, "Executor: no Comm given");
  TORCH_CHECK(rank >= 0 && rank < schedule.num_ranks, "rank ", rank, " is not in a ",
              schedule.num_ranks, "-rank schedule");
  TORCH_CHECK(comm->world_size() == schedule.num_ranks, "the Comm has ", comm->world_size(),
              " ranks but the schedule has ", schedule.num_ranks);
  for (int s = 0; s < schedule.num_stages; ++s)
    TORCH_CHECK((schedule.stage_rank[s] == rank) == stage.holds(s), "rank ", rank,
                (schedule.stage_rank[s] == rank ? " must hold" : " must not hold"), " stage ", s);
  state_ = std::make_unique<State>(schedule, rank, stage, std::move(comm), std::move(options));
}

Executor::~Executor() = default;

void Executor::set_pair_function(std::function<void(PairCall&)> fn) {
  state_->opts.pair_function = std::move(fn);
}

void Executor::set_deferred_w(bool defer_wgrad, bool pair_first_ready) {
  state_->opts.defer_wgrad = defer_wgrad;
  if (state_->opts.pair_first_ready != pair_first_ready) state_->pairs.reset();
  state_->opts.pair_first_ready = pair_first_ready;
}

StepStats Executor::run_step() {
  try {
    return state_->run();
  } catch (const std::exception& e) {
    // NOTE [A failed step reaches the peers] in hp/distributed/comm.h.
    if (state_->frames) state_->frames->abandon_step();
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    state_->comm->abandon("rank " + std::to_string(state_->rank) + "'s step failed: " +
                          (c10_error ? c10_error->what_without_backtrace() : e.what()));
    throw;
  }
}

}  // namespace hp::pipeline
