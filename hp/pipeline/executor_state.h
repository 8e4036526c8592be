// hp/pipeline/executor_state.h: the Executor's state, shared by the two
// files of its walk (internal): executor.cpp (batches of transfers, receives,
// compute actions, the step) and executor_pairs.cpp (FB pairs, the deferred
// W's, the sends a half posts as it ends).
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hp/pipeline/executor.h"
#include "hp/pipeline/frames.h"
#include "hp/pipeline/overlap.h"
#include "hp/pipeline/send_reaper.h"
#include "hp/schedule/action.h"

namespace hp::pipeline {

struct Executor::State {
  using Action = schedule::Action;
  using Op = schedule::Op;
  using Key = std::pair<int, int>;  // (stage, microbatch)

  const schedule::Schedule& sched;
  int rank;
  PipelineStage& stage;
  std::shared_ptr<distributed::Comm> comm;
  ExecutorOptions opts;
  const std::vector<Action>& actions;

  // Per step.
  struct Posted {
    std::vector<distributed::Work> works;  // one per tensor
    Message buffers;
    std::vector<bool> takes_grad;  // forward: which leaves take a gradient
    int peer = -1;        // framed: the sender's rank (NOTE [Messages that describe themselves])
    uint64_t number = 0;  // framed: the message's number from that rank
  };
  std::map<std::tuple<int, int, int>, Posted> recvs;  // (kind, consumer stage, mb)
  std::map<Key, Message> local_grad;                  // dx handed to (consumer stage, mb)
  std::map<Key, Message> pending_dx;                  // dx waiting for its SEND_B
  StepStats stats;
  std::unique_ptr<StepTimer> timer;
  std::unique_ptr<detail::SendReaper> reaper;
  // This step's timed spans as timer marks, turned into seconds after the
  // step (NOTE [Timing on the device]).
  std::vector<TimedSpan> spans;                 // the events, in the order they happened
  std::vector<std::pair<int, int>> comm_spans;  // batch postings, receive waits, the drain
  std::vector<std::pair<int, int>>* waits_of_running = nullptr;
  ChunkWaits* own_waits_of_running = nullptr;  // NOTE [A chunk's own waits] in step_timer.h
  std::unique_ptr<PairRunner> pairs;           // made by the first overlapped FB
  std::deque<std::pair<int, int>> deferred_w;  // (stage, mb): NOTE [Weight gradients in the waits]
  // The oldest deferred W's parts run so far (NOTE [dw in parts]): its first
  // part's mark (-1: none ran), their compute and their own waits.
  struct WParts {
    int start = -1;
    int calls = 0;
    double compute = 0.0;
    int waits = 0;
    double waited = 0.0;
  } w_parts;
  bool in_pair = false;                // an overlapped pair runs (its idle runs the W's)
  std::vector<TimedSpan> pair_halves;  // the last overlapped pair's halves, as they ended
  // The action list's batches (runs of SEND/RECV actions) as [first, last),
  // the batch starting at each index, and the receives posted ahead this step
  // (NOTE [Receives posted ahead]).
  std::vector<std::pair<size_t, size_t>> batches;
  std::map<size_t, size_t> batch_at;
  size_t lookahead = 0;
  std::vector<char> posted_ahead;
  size_t running = 0;  // the index of the compute action that runs
  // Messages that describe themselves (no layout declared): their frames.
  std::unique_ptr<Frames> frames;

  int rank_of(int stage_id) const { return sched.stage_rank.at(stage_id); }
  static bool is_send(Op op) { return op == Op::SEND_F || op == Op::SEND_B; }
  // An action's range for torch.profiler (RECORD_FUNCTION's user scope, as
  // torch.profiler.record_function makes): "hp::1F3" is stage 1's F of
  // microbatch 3. The name is made only while a profiler listens.
  struct ProfiledAction {
    at::RecordFunction guard{at::RecordScope::USER_SCOPE};
    explicit ProfiledAction(const Action& a) {
      if (guard.isActive()) guard.before("hp::" + schedule::to_string(a));
    }
  };

  State(const schedule::Schedule& s, int r, PipelineStage& st, std::shared_ptr<distributed::Comm> c,
        ExecutorOptions o);

  // executor.cpp: errors, transfers, compute actions, the step.
  std::string where(const Action& a) const;
  std::string around(size_t i) const;  // NOTE [The actions around a failure]
  [[noreturn]] void fail_at(size_t i, const std::string& what) const;
  Layout layout_for(int stage_id, int mb) const;
  std::vector<distributed::P2POp> recv_ops(const Action& a, Posted& posted);
  Message take_recv(int kind, int stage_id, int mb, const Action& consumer,
                    std::vector<bool>* takes_grad = nullptr);
  std::vector<distributed::P2POp> send_ops(const Action& a, std::function<void()>& on_done);
  void check_layout(const Action& a, const Message& m, const Layout& want) const;
  void post_batch(size_t i, size_t j);
  Message forward_input(int s, int mb, const Action& a, std::vector<bool>* takes_grad);
  bool ends_in_loss(int s, int mb) const;
  void forward(int s, int mb, const Action& a);
  Message grad_for(int s, int mb, const Action& a);
  void store_dx(int s, int mb, Message dx);
  void compute(const Action& a);
  void resolve(int last);
  StepStats run();

  // executor_pairs.cpp: FB pairs and what runs in their waits.
  void run_pair(const Action& a);
  void post_ready_sends();  // NOTE [A half's sends leave when it ends]
  void computed_pair(const Action& a, const Action& b,
                     const std::function<Message(const PairInputs&)>& fn);
  bool run_deferred_w(int parts);
  void run_deferred_w_span(int parts = 1);
};

}  // namespace hp::pipeline
