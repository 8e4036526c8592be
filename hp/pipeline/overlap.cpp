// PairRunner: two halves of work that take turns on the CPU at their waits
// on communication (NOTE [Overlapped pairs]).
#include "hp/pipeline/overlap.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "hp/core/memory.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/lanes.h"
#include "hp/pipeline/step_timer.h"

namespace hp::pipeline {

// NOTE [Overlapped pairs]
// DualPipe pairs the forward of one microbatch with the backward of another
// (an FB action) so that each hides the other's communication: while the
// forward's tokens are in an all-to-all, the backward computes, and the
// other way round (the user's DualPipe document, part 1; Megatron-core's
// combined 1F1B plans the same by hand, node by node). Here the nodes are
// found, not declared: the halves are cut wherever the model already waits
// on communication, so any model whose exchanges go through a Comm (hp/moe's
// dispatch and combine, a pipeline receive) overlaps without a plan.
//
// The two halves run on two threads but never compute at once: a baton
// (`turn`) says which one may. At every Work::wait of a half, a WaitObserver
// (hp/distributed/comm.h) hands the baton to the other half and lets the
// wait run; when the wait has ended, the half takes the baton back as soon
// as the other half reaches its own wait (or ends). So the forward runs to
// its first wait, the backward to its first, the forward to its second, and
// so on: the order of every rank's posts is fixed by the code alone, which
// is what keeps an expert-parallel group's exchanges matched without tags
// (every peer runs the same pair and switches at the same waits; a switch
// that depended on whether a message had already arrived would let two
// peers post in different orders). One CPU thread's worth of compute, as
// DualPipe's single stream on a GPU: the gain is the waits, not the cores.
//
// The second half runs with the first's at::ThreadLocalState (grad mode,
// saved-tensor hooks, recompute sessions' debug info), its interrupt check
// and, when the first has one, a step cache scope of its own. A half that
// throws ends the pair: the other's wait in flight is aborted where the
// backend can, its next switch throws, and run() rethrows the error that
// came first once both have ended (a half never outlives run()).
//
// Timing, per wait of a half: from its start to its end, the part during
// which the CPU computed (the other half, or a W run in a wait) is hidden
// communication; the rest is exposed (PairStats). Each half's compute is
// the time it held the baton, from taking it to its next wait or its end (a
// W run in a wait left out): the pair's span less its waits would not do,
// since the waits of one half overlap the other's compute.
//
// Which half is `first` is the caller's: the executor passes the lead of
// the pair's action (NOTE [The half that leads] in hp/schedule/fuse.cpp).

// NOTE [Turns as messages arrive]
// The fixed order wastes the CPU whenever the half whose turn it is still
// waits while the other's message is there: an expert layer's forward
// waits on its dispatch, the backward's next node is short (the gap
// between its two all-to-alls), and the CPU idles until the dispatch ends
// although the backward's combine arrived long ago. A GPU's two streams
// have no such order: whichever's data is there runs. With `first_ready`
// the runner does the same: the CPU is a lock the computing half holds,
// released at each wait, and taken by whichever half's wait ends first (or
// the one that was waiting when it is released). The posts of the two
// halves then interleave by timing, which is only safe when each half posts
// on a copy of each group of its own: the second half runs under
// distributed::kPartnerLane and the executor runs deferred W's under
// kDeferredLane (NOTE [Lanes] in hp/distributed/lanes.cpp); `hp train`
// makes its expert-parallel and data-parallel groups in lanes and turns it
// on with --fb-overlap. The pipeline's sends that a half posts as it ends
// keep their order by themselves (NOTE [A half's sends leave when it
// ends] in executor_pairs.cpp); the receives are posted before the pair.
// With deferred W's their posts have a lane of their own (kDeferredLane,
// which the executor keeps), but where a W runs then depends on timing.
// Two things follow. (1) A W must not wait on its peers: one that does
// (a recompute's all-to-all) while they wait on this rank's half for an
// exchange that this rank posts only after the W hangs the group
// (dualpipe pp 2 x ep 2 with recompute sessions and --defer-wgrad did so
// once in a full test run). Without recompute a W exchanges nothing: the
// expert all-to-all is an anchor of the split and runs in I (NOTE
// [Anchors] in hp/autograd/split_plan.h). With recompute sessions `hp
// train` refuses --pair-turns ready with --defer-wgrad; where it cannot be
// told beforehand (Python's chunks), a deferred W that starts an expert
// exchange under ready turns throws (distributed::NoExchangeScope) and so
// fails the step on every rank rather than hang it, and the choice of
// deferred W's never takes ready turns after a step that recomputed
// (Pipeline::choose_deferred_w). (2) Which action ends a
// stage, and so when and on which lane its gradient reduction is posted,
// may differ between ranks: the reductions go in the schedule's order on
// one lane (NOTE [Reductions in a fixed order] in data_parallel.h); before
// that, pp 1 x ep 2 dualpipev with ready turns and deferred W's hung once
// in 9 runs, both ranks waiting on a reduction. And the order in which the
// microbatches' W's add into .grad then follows the messages, so float32
// results change in their last bits from run to run: `--pair-turns auto`
// (the default) takes fixed turns with --defer-wgrad.

// NOTE [An overlapped pair on a device]
// On a GPU the CPU's baton is not enough: with NCCL a wait only makes the
// current stream wait for the communication (NOTE [Stream-ordered waits]),
// so if both halves issued on one stream, everything the partner issues
// after that wait would queue behind the transfer. So each half issues on a
// stream of its own (two from the device's pool, kept by the runner): the
// half that waits orders its own stream after its transfer, and the
// partner's kernels, on the other stream, run while it is in flight, as
// DualPipe's compute and communication streams do. The pair starts after
// everything the caller's stream had (an event both streams wait for) and
// the caller's stream waits for both at the end, so the actions around the
// pair see it as one. Memory stays safe without record_stream: a half
// allocates from its own stream's pool, which is only used again after the
// next pair's start event, and what it frees of the caller's stream is not
// reused before the caller's stream has waited for the pair.
// stand_in_overlap checks on one GPU that the two really run at once
// (scripts/gpu_check.py); on the CPU the halves take turns on one stream of
// work as before.

// NOTE [Weight gradients in the waits]
// With split backwards a pair's backward half can run I alone and leave its
// W (the weight gradient, which no one downstream waits for) in a queue
// (ExecutorOptions::defer_wgrad). At a wait of one half, the other has
// ended or is itself stopped at a wait (whose message may be in flight):
// there the half runs one queued W first, then waits (Megatron-core's
// delayed wgrad, Lancet's weight gradients in the all-to-all windows). The
// pair's first wait (the forward's, before the backward started) hands the
// CPU to the backward instead. Where a W runs is fixed by the code, never by
// whether a message has arrived: the last W of a stage posts its gradient
// reduction over the data-parallel group (NOTE [Expert gradients]), which
// is the expert-parallel group whose all-to-alls the pair posts, and
// every peer must post both in one order (NOTE [Point-to-point without
// tags]). The W runs with the observer off (its own waits, if any, switch
// nothing). Outside a pair, a queued W runs before each receive's wait
// (a forward's input, a backward's output gradient: where a rank of the
// cooldown idles), one W per receive, whether or not the message is there,
// by the same rule. What is still queued when the step's actions end runs
// then.
// A queued W holds its microbatch's activations until it runs: the price
// is memory, as with any W that a schedule places late.

// NOTE [Weight gradients until the message is there]
// A whole W is often longer than the wait it fills (a stage's W is a few
// milliseconds, an all-to-all's wait one or two), so the half whose message
// came meanwhile waits for the W to end. With first-ready turns (NOTE
// [Turns as messages arrive]), where a W's place depends on timing anyway,
// `hp train --w-parts N` (ExecutorOptions::deferred_w_parts) runs each W in
// N parts (about 1/N of its weight groups each: NOTE [dw in parts] in
// hp/autograd/grad_function.cpp), and a wait takes parts, the oldest W
// first, for as long as neither its own communication nor the partner's
// has completed, asked without blocking (distributed::Work::test). Where a
// backend cannot tell, one part runs. The W's still add into .grad in the
// queue's order, each whole once its last part ran; a W that a hook wraps
// (a recompute session's) is not cut. The test must answer for the data,
// not its first bytes: an exchange whose counts had come while its rows
// were still on the link answered "there" a millisecond early, and the CPU
// idled that long each time (distributed::test_arrived; SizedWork::test in
// hp/moe/all_to_all.cpp). The simulator predicts parts hiding most of what
// whole turns leave exposed (SimOptions::deferred_w_parts); measured on 2
// cores they hide more than whole W's, but the step stays within the
// rounds' spread of the pairs without deferred W's (benchmarks.md, "W's in
// parts until the message is there"). So it is off (1: one whole W per
// wait) unless asked for.

using Clock = std::chrono::steady_clock;

struct PairRunner::State {
  std::mutex mutex;
  std::condition_variable cv;
  bool first_ready = false;  // NOTE [Turns as messages arrive]
  // The pair in progress.
  int turn = 0;      // the fixed order: the half that may run (when its wait ended)
  int holder = 0;    // first-ready: the half that holds the CPU, -1 none
  int released = 0;  // the half that last gave the CPU up at a wait
  bool done[2] = {false, false};
  bool started[2] = {false, false};
  const std::function<bool()>* idle = nullptr;
  bool fill_until_there = false;  // NOTE [Weight gradients until the message is there]
  // NOTE [An overlapped pair on a device]: unset on the CPU.
  std::optional<c10::Device> device;
  std::optional<c10::Stream> streams[2];
  std::exception_ptr error[2];
  int failed_first = -1;  // the half whose error came first
  distributed::Work in_flight[2];
  Clock::time_point wait_start[2];
  Clock::time_point arrived[2];        // at its current wait (before a W run there)
  bool inner[2] = {false, false};      // that wait is the chunk's own (NOTE [A chunk's own waits])
  double node[2] = {0.0, 0.0};         // compute of the half's node so far
  Clock::time_point running_since[2];  // when the half last took the CPU
  // The CPU's compute so far (a half, or a W in a wait), for what a wait hid.
  bool busy = false;
  double busy_before = 0.0;  // seconds, up to busy_since
  Clock::time_point busy_since;
  // PairStats::chunk_idle: the halves in a receive's wait, the last change.
  bool receiving[2] = {false, false};
  Clock::time_point idle_mark;
  double busy_at_wait[2] = {0.0, 0.0};  // busy_until(wait_start[half])
  Clock::time_point ended_at[2];        // when the half ended (done)
  double busy_at_end[2] = {0.0, 0.0};   // busy_until(ended_at[half])
  PairStats stats;
  // The runner's thread and its job.
  std::thread thread;
  bool has_job = false, stop = false;
  const std::function<void()>* job = nullptr;
  std::optional<at::ThreadLocalState> tls;
  std::function<void()> interrupt_check;
  bool step_cache = false;

  // Called with the mutex held.
  void give_turn(int to) {
    if (first_ready)
      holder = -1;  // whichever half's wait ends first (or has ended) takes it
    else
      turn = to;
    cv.notify_all();
  }
  bool may_run(int half) const { return first_ready ? holder == -1 : turn == half; }

  // Adds the time since the last change to chunk_idle if nothing computed
  // and no half waited on a receive; call before busy or receiving change.
  void account_idle(Clock::time_point now) {
    if (now <= idle_mark) return;  // a time read before another thread's change
    if (!busy && !receiving[0] && !receiving[1])
      stats.chunk_idle += std::chrono::duration<double>(now - idle_mark).count();
    idle_mark = now;
  }
  void set_busy(bool b, Clock::time_point now) {
    account_idle(now);
    if (b && !busy) busy_since = now;
    if (!b && busy) busy_before += std::chrono::duration<double>(now - busy_since).count();
    busy = b;
  }
  double busy_until(Clock::time_point now) const {
    return busy_before + (busy ? std::chrono::duration<double>(now - busy_since).count() : 0.0);
  }
  // The half takes the CPU.
  void start_running(int half) {
    running_since[half] = Clock::now();
    if (first_ready) holder = half;
    set_busy(true, running_since[half]);
  }
  // The half gives up the CPU (a wait, its end): its compute since it took it.
  void stop_running(int half) {
    const auto now = Clock::now();
    const double ran = std::chrono::duration<double>(now - running_since[half]).count();
    stats.compute[half] += ran;
    node[half] += ran;
    set_busy(false, now);
  }
  // A node of the half ends (at a wait of its chunk's own, or its end).
  void end_node(int half) {
    stats.nodes[half].push_back(node[half]);
    node[half] = 0.0;
  }

  void finish(int half, std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    stop_running(half);
    end_node(half);
    done[half] = true;
    ended_at[half] = Clock::now();
    busy_at_end[half] = busy_until(ended_at[half]);
    if (e) {
      error[half] = e;
      if (failed_first < 0) failed_first = half;
      in_flight[1 - half].abort();  // wakes the other half where the backend can
    }
    give_turn(1 - half);
  }

  // First-ready turns, the mutex held, at `half`'s wait on `work` after `n`
  // parts of W's ran there: whether another runs (NOTE [Weight gradients
  // until the message is there]). Not when its wait or the partner's has
  // ended; where one cannot tell (Work::test), one part only.
  bool fill_more(int half, const distributed::Work& work, int n) {
    const int other = 1 - half;
    std::optional<bool> theirs = false;  // an ended partner takes nothing
    if (!done[other]) {
      if (!in_flight[other].valid()) return false;  // its wait ended: it runs next
      theirs = in_flight[other].test();
    }
    const std::optional<bool> mine = work.test();
    if (mine == true || theirs == true) return false;
    return n == 0 || (mine.has_value() && theirs.has_value());
  }

  void check_partner(int half) {
    if (error[1 - half] && failed_first == 1 - half)
      throw std::runtime_error(
          "the other half of this overlapped forward-and-backward pair failed");
  }
};

namespace {

// Hands the baton over at each wait of one half.
class Switcher : public distributed::WaitObserver {
 public:
  Switcher(PairRunner::State& s, int half) : s_(s), half_(half) {}
  void before_wait(const distributed::Work& work) override {
    std::unique_lock<std::mutex> lock(s_.mutex);
    s_.stop_running(half_);
    s_.arrived[half_] = Clock::now();
    s_.inner[half_] = !in_receive();
    s_.account_idle(Clock::now());
    s_.receiving[half_] = !s_.inner[half_];
    if (s_.inner[half_]) s_.end_node(half_);
    if (s_.idle != nullptr && *s_.idle && s_.started[1 - half_]) {
      // The partner has ended or is stopped at a wait: a deferred W runs
      // first, on this thread, which holds the CPU (NOTE [Weight gradients
      // in the waits]); with first-ready turns, parts of W's until a wait
      // ends (NOTE [Weight gradients until the message is there]).
      s_.set_busy(true, Clock::now());
      for (int n = 0;; ++n) {
        if (s_.fill_until_there && !s_.fill_more(half_, work, n)) break;
        lock.unlock();
        const bool ran = (*s_.idle)();
        lock.lock();
        if (!ran) break;
        ++s_.stats.filled;
        if (!s_.fill_until_there) break;
      }
      s_.set_busy(false, Clock::now());
    }
    s_.in_flight[half_] = work;
    s_.wait_start[half_] = Clock::now();
    s_.busy_at_wait[half_] = s_.busy_until(s_.wait_start[half_]);
    s_.released = half_;
    if (!s_.done[1 - half_]) {
      ++s_.stats.switches;
      s_.give_turn(1 - half_);
    }
  }
  void after_wait() override {
    const auto ended = Clock::now();
    std::unique_lock<std::mutex> lock(s_.mutex);
    s_.account_idle(ended);
    s_.receiving[half_] = false;
    s_.in_flight[half_] = distributed::Work();
    if (s_.inner[half_]) {
      ++s_.stats.inner_waits[half_];
      s_.stats.inner_waited[half_] +=
          std::chrono::duration<double>(ended - s_.arrived[half_]).count();
    }
    // What the CPU computed while the wait was in flight (up to now, a
    // moment after its end: no more than the wait).
    const double waited = std::chrono::duration<double>(ended - s_.wait_start[half_]).count();
    const double hidden = std::clamp(s_.busy_until(Clock::now()) - s_.busy_at_wait[half_], 0.0,
                                     std::max(0.0, waited));
    s_.stats.hidden += hidden;
    s_.stats.exposed += std::max(0.0, waited - hidden);
    // The part of it after the partner ended: that stretch less what a W
    // computed in it.
    const int other = 1 - half_;
    if (s_.done[other] && s_.ended_at[other] < ended) {
      const bool before = s_.ended_at[other] <= s_.wait_start[half_];
      const auto from = before ? s_.wait_start[half_] : s_.ended_at[other];
      const double alone = std::chrono::duration<double>(ended - from).count();
      const double computed =
          s_.busy_until(Clock::now()) - (before ? s_.busy_at_wait[half_] : s_.busy_at_end[other]);
      s_.stats.exposed_alone += std::clamp(alone - computed, 0.0, std::max(0.0, waited - hidden));
    }
    s_.cv.wait(lock, [&] { return s_.may_run(half_) || s_.done[1 - half_]; });
    if (s_.released == half_ && s_.started[1 - half_] && !s_.done[1 - half_]) ++s_.stats.reordered;
    s_.start_running(half_);
    s_.check_partner(half_);
  }

 private:
  PairRunner::State& s_;
  int half_;
};

}  // namespace

PairRunner::PairRunner(c10::Device device, bool first_ready) : state_(std::make_unique<State>()) {
  State* s = state_.get();
  s->first_ready = first_ready;
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    s->device = device;
    for (auto& stream : s->streams)
      stream = impl.getStreamFromGlobalPool(device);
  }
  s->thread = std::thread([s] {
    std::unique_lock<std::mutex> lock(s->mutex);
    while (true) {
      s->cv.wait(lock, [&] { return s->has_job || s->stop; });
      if (s->stop) return;
      s->has_job = false;
      s->cv.wait(lock, [&] { return s->may_run(1); });
      const bool skip = s->failed_first >= 0;  // the first half failed before it waited
      s->started[1] = true;
      s->start_running(1);
      lock.unlock();
      std::exception_ptr error;
      if (!skip) {
        at::ThreadLocalStateGuard tls(*s->tls);
        distributed::InterruptCheck check(s->interrupt_check);
        std::optional<StepCacheScope> cache;
        if (s->step_cache) cache.emplace();
        Switcher switcher(*s, 1);
        distributed::WaitObserverScope observe(&switcher);
        distributed::LaneScope lane(distributed::kPartnerLane);  // NOTE [Lanes]
        std::optional<c10::StreamGuard> on_stream;
        if (s->streams[1]) on_stream.emplace(*s->streams[1]);
        try {
          (*s->job)();
        } catch (...) {
          error = std::current_exception();
        }
      }
      s->finish(1, error);
      lock.lock();
    }
  });
}

PairRunner::~PairRunner() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->cv.notify_all();
  state_->thread.join();
}

PairStats PairRunner::run(const std::function<void()>& first, const std::function<void()>& second,
                          const std::function<bool()>& idle, bool fill_until_there) {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    TORCH_CHECK(!s.has_job && s.job == nullptr, "PairRunner::run is not reentrant");
    s.turn = 0;
    s.holder = 0;
    s.busy = false;
    s.busy_before = 0.0;
    s.done[0] = s.done[1] = false;
    s.started[0] = true;
    s.started[1] = false;
    s.idle = &idle;
    s.fill_until_there = fill_until_there && s.first_ready;
    s.error[0] = s.error[1] = nullptr;
    s.failed_first = -1;
    s.stats = PairStats{};
    s.node[0] = s.node[1] = 0.0;
    s.receiving[0] = s.receiving[1] = false;
    s.idle_mark = Clock::now();
    s.start_running(0);
    s.tls.emplace();  // this thread's state, for the second half
    s.interrupt_check = distributed::current_interrupt_check();
    s.step_cache = step_cache_active();
    s.job = &second;
    s.has_job = true;
  }
  // NOTE [An overlapped pair on a device]: both streams after the caller's.
  std::optional<c10::Stream> caller;
  if (s.device) {
    caller = c10::impl::VirtualGuardImpl(s.device->type()).getStream(*s.device);
    c10::Event start(s.device->type());
    start.record(*caller);
    start.block(*s.streams[0]);
    start.block(*s.streams[1]);
  }
  s.cv.notify_all();
  std::exception_ptr error;
  {
    Switcher switcher(s, 0);
    distributed::WaitObserverScope observe(&switcher);
    std::optional<c10::StreamGuard> on_stream;
    if (s.streams[0]) on_stream.emplace(*s.streams[0]);
    try {
      first();
    } catch (...) {
      error = std::current_exception();
    }
  }
  s.finish(0, error);
  std::unique_lock<std::mutex> lock(s.mutex);
  s.cv.wait(lock, [&] { return s.done[1]; });
  if (caller) {  // the caller's stream after both halves' work
    for (const auto& stream : s.streams) {
      c10::Event end(s.device->type());
      end.record(*stream);
      end.block(*caller);
    }
  }
  s.job = nullptr;
  s.idle = nullptr;
  s.tls.reset();
  s.account_idle(Clock::now());
  const int failed = s.failed_first;
  if (failed >= 0) {
    std::exception_ptr e = s.error[failed];
    lock.unlock();
    std::rethrow_exception(e);
  }
  return s.stats;
}

namespace {

// The stand-in transfer's Work: waited on in stream order, as NCCL's.
struct StreamOrderedWork : distributed::Work::Impl {
  explicit StreamOrderedWork(c10::Event e) : done(std::move(e)) {}
  void wait() override {
    done.block(c10::impl::VirtualGuardImpl(done.device_type()).getStream(done.device()));
  }
  bool blocks_host() const override { return false; }
  std::optional<bool> test() const override { return done.query(); }
  c10::Event done;
};

}  // namespace

StandInOverlap stand_in_overlap(c10::Device device, int64_t n, int iterations,
                                int64_t transfer_bytes) {
  TORCH_CHECK(!device.is_cpu(), "stand_in_overlap needs a device with streams, got ", device);
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::DeviceGuard on_device(device);
  const auto opts = torch::TensorOptions().device(device);
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  auto src = torch::empty({transfer_bytes}, opts.dtype(torch::kUInt8));
  auto host = torch::empty({transfer_bytes},
                           torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  const c10::Stream comm = impl.getStreamFromGlobalPool(device);
  auto compute = [&] {
    auto c = a;
    for (int i = 0; i < iterations; ++i)
      c = torch::mm(c, b).div_(static_cast<double>(n));
  };
  auto transfer = [&] {
    c10::Event posted(device.type());
    posted.record(impl.getStream(device));
    posted.block(comm);
    {
      c10::StreamGuard on_comm(comm);
      host.copy_(src, /*non_blocking=*/true);
    }
    c10::Event done(device.type());
    done.record(comm);
    distributed::Work(std::make_shared<StreamOrderedWork>(std::move(done))).wait();
  };
  auto timed = [&](const std::function<void()>& fn) {
    const c10::Stream caller = impl.getStream(device);
    c10::Event t0(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    c10::Event t1(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    t0.record(caller);
    fn();
    t1.record(caller);
    t1.synchronize();
    return t0.elapsedTime(t1);
  };
  PairRunner runner(device);
  compute();  // warm-up: kernels, the allocator, the pool's streams
  transfer();
  runner.run(transfer, compute);
  {
    c10::Event idle(device.type());
    idle.record(impl.getStream(device));
    idle.synchronize();
  }
  StandInOverlap out;
  out.compute = timed(compute);
  out.transfer = timed(transfer);
  out.pair = timed([&] { runner.run(transfer, compute); });
  return out;
}

// NOTE [A pair function]
// A user's pair function (torch's register_custom_function(OVERLAP_F_B,
// fn)) decides how an FB pair runs: the F half and the B half in either
// order, on threads or streams of its own, or the built-in overlapped
// runner, or computed(fn): fn runs the module's forward and backward itself
// (DualPipe's overlapped_forward_backward; NOTE [A pair that computes
// itself] in stage.cpp). Whatever it does, the executor needs each half run exactly once
// before the next action (the pair's sends follow it in the list): a
// second call of a half, and a function that returns with a half not run,
// are errors naming the pair. Its exceptions end the step as any
// action's do (NOTE [The actions around a failure]).
void run_pair_function(const std::function<void(PairCall&)>& fn, const schedule::Action& a,
                       const std::function<void()>& run_f, const std::function<void()>& run_b,
                       const std::function<void()>& overlapped,
                       const decltype(PairCall::computed)& computed) {
  bool f_ran = false, b_ran = false;
  auto once = [&](bool& ran, const char* what, const std::function<void()>& fn) {
    TORCH_CHECK(!ran, "the pair function ran the ", what, " of ", schedule::to_string(a), " twice");
    ran = true;
    fn();
  };
  PairCall call;
  call.action = a;
  call.forward = [&] { once(f_ran, "forward half", run_f); };
  call.backward = [&] { once(b_ran, "backward half", run_b); };
  call.overlapped = [&] {
    TORCH_CHECK(!f_ran && !b_ran, "the pair function ran overlapped() after a half of ",
                schedule::to_string(a));
    f_ran = b_ran = true;
    overlapped();
  };
  call.computed = [&](const auto& compute) {
    TORCH_CHECK(!f_ran && !b_ran, "the pair function ran computed() after a half of ",
                schedule::to_string(a));
    f_ran = b_ran = true;
    computed(compute);
  };
  fn(call);
  TORCH_CHECK(f_ran && b_ran, "the pair function returned without running the ",
              f_ran ? "backward" : "forward", " half of ", schedule::to_string(a),
              " (call pair.forward() and pair.backward(), or pair.overlapped())");
}

}  // namespace hp::pipeline
