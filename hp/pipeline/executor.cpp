// Executor: the walk over one rank's lowered actions (see NOTE [Executor
// protocol]): batches of SEND/RECV posted in list order, local hand-offs, and
// a helper thread that completes sends and frees sent outputs.
#include "hp/pipeline/executor.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "hp/schedule/action.h"

namespace hp::pipeline {
namespace {

using schedule::Action;
using schedule::Op;
using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Waits for posted sends in order on its own thread and runs each one's
// completion callback; remembers the first failure for the walk to rethrow.
class SendReaper {
 public:
  SendReaper() : thread_([this] { loop(); }) {}
  ~SendReaper() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void add(distributed::Work work, torch::Tensor keep_alive, std::function<void()> on_done) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back({std::move(work), std::move(keep_alive), std::move(on_done)});
    }
    cv_.notify_all();
  }
  // Blocks until every send added so far completed; rethrows the first error.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  void rethrow_if_failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  struct Item {
    distributed::Work work;
    torch::Tensor keep_alive;
    std::function<void()> on_done;
  };
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      Item item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      try {
        item.work.wait();
        if (item.on_done) item.on_done();
      } catch (...) {
        std::lock_guard<std::mutex> g(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      item = Item{};
      lock.lock();
      busy_ = false;
      idle_cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Item> queue_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

using Key = std::pair<int, int>;  // (stage, microbatch)

}  // namespace

struct Executor::State {
  const schedule::Schedule& sched;
  int rank;
  PipelineStage& stage;
  std::shared_ptr<distributed::Comm> comm;
  ExecutorOptions opts;
  const std::vector<Action>& actions;

  // Per step.
  struct Posted {
    distributed::Work work;
    torch::Tensor buffer;
  };
  std::map<std::tuple<int, int, int>, Posted> recvs;  // (kind, consumer stage, mb)
  std::map<Key, torch::Tensor> local_grad;            // dx handed to (consumer stage, mb)
  std::map<Key, torch::Tensor> pending_dx;            // dx waiting for its SEND_B
  StepStats stats;
  Clock::time_point t0;
  std::unique_ptr<SendReaper> reaper;

  State(const schedule::Schedule& s, int r, PipelineStage& st, std::shared_ptr<distributed::Comm> c,
        ExecutorOptions o)
      : sched(s),
        rank(r),
        stage(st),
        comm(std::move(c)),
        opts(std::move(o)),
        actions(s.actions.at(r)) {}

  int rank_of(int stage_id) const { return sched.stage_rank.at(stage_id); }
  static bool is_send(Op op) { return op == Op::SEND_F || op == Op::SEND_B; }
  std::string where(const Action& a) const {
    std::ostringstream os;
    os << "rank " << rank << " action " << schedule::to_string(a);
    return os.str();
  }

  // The receive of a RECV action: a fresh buffer, from the producer's rank.
  distributed::P2POp recv_op(const Action& a, torch::Tensor& buffer) {
    const bool fwd = a.op == Op::RECV_F;
    int producer =
        fwd ? sched.prev_stage(a.stage, a.microbatch) : sched.next_stage(a.stage, a.microbatch);
    TORCH_CHECK(producer >= 0, where(a), ": nothing on the route sends this");
    TORCH_CHECK(!recvs.count(std::make_tuple(fwd ? 0 : 1, a.stage, a.microbatch)), where(a),
                ": received twice");
    auto shape = opts.activation_shape(fwd ? producer : a.stage, a.microbatch);
    buffer = torch::empty(shape, torch::TensorOptions().dtype(opts.dtype).device(opts.device));
    return distributed::P2POp::recv(buffer, rank_of(producer));
  }

  torch::Tensor take_recv(int kind, int stage_id, int mb, const Action& consumer) {
    auto it = recvs.find(std::make_tuple(kind, stage_id, mb));
    TORCH_CHECK(it != recvs.end(), where(consumer), ": its input was never received (no ",
                kind == 0 ? "RECV_F" : "RECV_B", " before it in the action list)");
    auto t = Clock::now();
    it->second.work.wait();
    auto end = Clock::now();
    stats.comm_wait += seconds_between(t, end);
    // The wait is the receive's event (NOTE [Compute events exclude waits]).
    record(Action::make(kind == 0 ? Op::RECV_F : Op::RECV_B, stage_id, mb), t, end);
    torch::Tensor buffer = std::move(it->second.buffer);
    recvs.erase(it);
    return buffer;
  }

  // The send of a SEND action: the output (F) or input gradient (I/B) it
  // names, to the consumer's rank; `on_done` frees a sent output.
  distributed::P2POp send_op(const Action& a, std::function<void()>& on_done) {
    const bool fwd = a.op == Op::SEND_F;
    const int mb = a.microbatch;
    int consumer = fwd ? sched.next_stage(a.stage, mb) : sched.prev_stage(a.stage, mb);
    TORCH_CHECK(consumer >= 0, where(a), ": nothing on the route receives this");
    torch::Tensor t;
    if (fwd) {
      t = stage.output(a.stage, mb);
      TORCH_INTERNAL_ASSERT(t.is_contiguous(), where(a), ": outputs are contiguous");
      if (opts.release_sent_outputs) {
        PipelineStage* st = &stage;
        int s = a.stage;
        on_done = [st, s, mb] { st->release_output(s, mb); };
      }
    } else {
      auto it = pending_dx.find({a.stage, mb});
      TORCH_CHECK(it != pending_dx.end(), where(a),
                  ": no input gradient to send (I must run first)");
      t = std::move(it->second);
      pending_dx.erase(it);
    }
    return distributed::P2POp::send(t, rank_of(consumer));
  }

  // Posts actions[i, j) (consecutive SEND/RECV actions) as one batch, in
  // list order (NOTE [Executor protocol]).
  void post_batch(size_t i, size_t j) {
    std::vector<distributed::P2POp> ops;
    std::vector<torch::Tensor> buffers(j - i);
    std::vector<std::function<void()>> on_done(j - i);
    for (size_t k = i; k < j; ++k) {
      const Action& a = actions[k];
      ops.push_back(is_send(a.op) ? send_op(a, on_done[k - i]) : recv_op(a, buffers[k - i]));
    }
    auto works = comm->batch(ops);
    for (size_t k = i; k < j; ++k) {
      const Action& a = actions[k];
      if (is_send(a.op)) {
        // The reaper holds the sent tensor while the send runs; the data is
        // freed by on_done (outputs) or when the handle drops (gradients).
        const bool fwd = a.op == Op::SEND_F;
        reaper->add(works[k - i], fwd ? torch::Tensor() : ops[k - i].tensor,
                    std::move(on_done[k - i]));
      } else {
        recvs.emplace(std::make_tuple(a.op == Op::RECV_F ? 0 : 1, a.stage, a.microbatch),
                      Posted{works[k - i], buffers[k - i]});
      }
    }
  }

  void forward(int s, int mb, const Action& a) {
    int prev = sched.prev_stage(s, mb);
    torch::Tensor input;
    if (prev < 0) {
      input = opts.input(mb);
    } else if (rank_of(prev) == rank) {
      input = stage.output(prev, mb);
    } else {
      input = take_recv(0, s, mb, a);
    }
    stage.forward(s, mb, input, /*input_needs_grad=*/prev >= 0,
                  /*is_last=*/sched.next_stage(s, mb) < 0);
  }

  torch::Tensor grad_for(int s, int mb, const Action& a) {
    stage.prepare_backward(s, mb);
    int next = sched.next_stage(s, mb);
    if (next < 0) return {};
    if (rank_of(next) == rank) {
      auto it = local_grad.find({s, mb});
      TORCH_CHECK(it != local_grad.end(), where(a), ": the output gradient from stage ", next,
                  " (same rank) is not there yet; its I must run first");
      torch::Tensor g = std::move(it->second);
      local_grad.erase(it);
      return g;
    }
    return take_recv(1, s, mb, a);
  }

  void store_dx(int s, int mb, torch::Tensor dx) {
    int prev = sched.prev_stage(s, mb);
    if (prev < 0) return;
    TORCH_INTERNAL_ASSERT(dx.defined(), "stage ", s, " microbatch ", mb, ": dx missing");
    if (rank_of(prev) == rank) {
      local_grad[{prev, mb}] = std::move(dx);
    } else {
      pending_dx[{s, mb}] = dx.contiguous();
    }
  }

  void compute(const Action& a) {
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
      case Op::FB: {
        forward(a.stage, a.microbatch, a);
        Action b = Action::make(Op::B, a.stage2, a.microbatch2);
        store_dx(b.stage, b.microbatch,
                 stage.backward(b.stage, b.microbatch, grad_for(b.stage, b.microbatch, b)));
        break;
      }
      default:
        TORCH_INTERNAL_ASSERT(false, "not a compute action");
    }
  }

  void record(const Action& a, Clock::time_point start, Clock::time_point end) {
    stats.events.push_back({rank, a, seconds_between(t0, start), seconds_between(t0, end)});
  }

  StepStats run() {
    TORCH_CHECK(sched.lowered, "the Executor runs lowered schedules; call schedule::lower first");
    stats = StepStats{};
    recvs.clear();
    local_grad.clear();
    pending_dx.clear();
    stage.reset();
    reaper = std::make_unique<SendReaper>();
    t0 = Clock::now();
    const size_t n = actions.size();
    for (size_t i = 0; i < n;) {
      const Action& a = actions[i];
      auto start = Clock::now();
      if (schedule::is_comm(a.op)) {
        size_t j = i;
        while (j < n && schedule::is_comm(actions[j].op))
          ++j;
        try {
          post_batch(i, j);
        } catch (const distributed::CommError& e) {
          throw e.with_context(where(a) + ": ");
        } catch (const std::exception& e) {
          throw std::runtime_error(where(a) + ": " + e.what());
        }
        auto end = Clock::now();
        stats.comm_wait += seconds_between(start, end);
        // Posting a batch runs its sends' copies (on loopback): the sends' events.
        for (size_t k = i; k < j; ++k)
          if (is_send(actions[k].op)) record(actions[k], start, end);
        i = j;
        continue;
      }
      try {
        double waited = stats.comm_wait;
        compute(a);
        auto end = Clock::now();
        waited = stats.comm_wait - waited;
        stats.compute += seconds_between(start, end) - waited;
        stats.executed.push_back(a);
        // NOTE [Compute events exclude waits]
        // A compute action waits for its inputs inside the call; that time is
        // communication, recorded as the receive's own event. The compute
        // event keeps only the compute: it starts `waited` after the call
        // did (for FB, whose second wait falls in the middle, the event is
        // as long as the compute and ends when it ended). Counting the wait
        // as compute once made the measured costs of waiting stages look
        // heavier, the simulator pessimistic about 1F1B and the measured
        // bubble too small.
        record(a,
               start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(waited)),
               end);
        reaper->rethrow_if_failed();
      } catch (const distributed::CommError& e) {
        throw e.with_context(where(a) + ": ");
      } catch (const std::exception& e) {
        throw std::runtime_error(where(a) + ": " + e.what());
      }
      ++i;
    }
    auto t = Clock::now();
    try {
      reaper->drain();
    } catch (const distributed::CommError& e) {
      throw e.with_context("rank " + std::to_string(rank) + " while completing the step's sends: ");
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(rank) +
                               " while completing the step's sends: " + e.what());
    }
    auto end = Clock::now();
    stats.comm_wait += seconds_between(t, end);
    reaper.reset();
    TORCH_CHECK(recvs.empty() && local_grad.empty() && pending_dx.empty(), "rank ", rank,
                ": the step ended with ", recvs.size(), " unread receives, ", local_grad.size(),
                " unused local gradients and ", pending_dx.size(),
                " unsent input gradients; the action list is inconsistent");
    TORCH_CHECK(stage.in_flight() == 0, "rank ", rank, ": ", stage.in_flight(),
                " microbatches did not finish their W");
    stats.wall = seconds_between(t0, end);
    stats.overhead = std::max(0.0, stats.wall - stats.compute - stats.comm_wait);
    stats.loss_sum = stage.loss_sum();
    return std::move(stats);
  }
};

Executor::Executor(const schedule::Schedule& schedule, int rank, PipelineStage& stage,
                   std::shared_ptr<distributed::Comm> comm, ExecutorOptions options)
    : state_(std::make_unique<State>(schedule, rank, stage, std::move(comm), std::move(options))) {
  TORCH_CHECK(rank >= 0 && rank < schedule.num_ranks, "rank ", rank, " is not in a ",
              schedule.num_ranks, "-rank schedule");
  TORCH_CHECK(state_->comm->world_size() == schedule.num_ranks, "the Comm has ",
              state_->comm->world_size(), " ranks but the schedule has ", schedule.num_ranks);
  for (int s = 0; s < schedule.num_stages; ++s)
    TORCH_CHECK((schedule.stage_rank[s] == rank) == stage.holds(s), "rank ", rank,
                (schedule.stage_rank[s] == rank ? " must hold" : " must not hold"), " stage ", s);
}

Executor::~Executor() = default;

StepStats Executor::run_step() {
  return state_->run();
}

}  // namespace hp::pipeline
