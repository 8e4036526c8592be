// StepTimer: the points of one step in the order of the compute stream, on
// the host clock or as device events (NOTE [Timing on the device]).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/schedule/action.h"
#include "hp/schedule/timeline.h"

namespace hp::pipeline {

// NOTE [Timing on the device]
// The executor times a step through a StepTimer: `mark()` is a point in the
// order of the compute stream, turned into seconds after the step. On the
// CPU an action's work is done when its call returns, so host clock readings
// are its times (make_host_timer). On a GPU the call returns once its kernels
// are enqueued and the device runs them later: host readings would time the
// launches. The device timer records an event with timing on the calling
// thread's current stream at each mark (c10::Event: any device type with
// events, no CUDA headers) and reads them all after the step, behind one host
// synchronization on the last one. An action's time is then the device's time
// between its marks, a receive's wait is how long the stream stalled for its
// data (NOTE [Stream-ordered waits] in hp/distributed/comm.h), and the
// measured timeline, bubble and Chrome trace are the device's. A mark never
// synchronizes.

/// Marks points of one step in the order of the compute stream and turns
/// them into seconds after the step (NOTE [Timing on the device]).
class StepTimer {
 public:
  virtual ~StepTimer() = default;
  /// Starts a step: earlier marks are forgotten; the next mark is time 0.
  virtual void start() = 0;
  /// A point after everything the calling thread has enqueued so far (the
  /// host clock's now on the CPU). Never synchronizes. Returns its index.
  virtual int mark() = 0;
  /// Seconds from the step's first mark to mark `index`. The first call after
  /// new marks may synchronize the host with the device, once.
  virtual double seconds(int index) = 0;
  /// Host synchronizations made since start().
  virtual int host_syncs() const = 0;
};

/// One stretch of a step as two marks: an action, a send's posting, a
/// receive's wait.
struct TimedSpan {
  schedule::Action action;
  int start = 0, end = 0;
  std::vector<std::pair<int, int>> waits{};  ///< a compute action's receive waits, as marks
  /// Its compute in seconds where the runner counted it (an overlapped pair's
  /// half: NOTE [An overlapped pair's events] in step_timer.cpp); < 0: not.
  double compute = -1;
  /// Its waits on communication of its own (NOTE [A chunk's own waits]):
  /// how many, and their seconds from entering each to its end.
  int inner_waits = 0;
  double inner_waited = 0.0;
  std::vector<double> nodes{};  ///< its compute between those waits (waits + 1), if any
};

// NOTE [A chunk's own waits]
// A compute action waits for its input (a pipeline receive: the receive's
// own event) and may wait inside its chunk on communication of its own: an
// expert layer's dispatch and combine. The simulator takes the second kind
// as nodes of the chunk (NOTE [Waits inside a chunk] in
// hp/schedule/simulate.h), so the runtime counts them apart: every wait a
// compute action makes through a Comm is its chunk's own unless it falls
// inside a ReceiveScope, which the executor opens around a receive's waits.
// Outside a pair a ChunkWaits observer counts them; inside one the pair
// runner's observer does (PairStats::inner_waits). The event of the action
// excludes them, as it does its receive's wait (NOTE [Compute events
// exclude waits]), and carries their count and seconds, and its compute
// between them (its nodes: their shares place a pair's turns in the
// simulator). A node leaves out what the thread did for others meanwhile: a
// queued W, a send's posting.

/// While alive, the calling thread's waits are a pipeline receive's (or,
/// with false, are not: a W run inside a receive's wait).
class ReceiveScope {
 public:
  explicit ReceiveScope(bool receiving = true);
  ~ReceiveScope();
  ReceiveScope(const ReceiveScope&) = delete;
  ReceiveScope& operator=(const ReceiveScope&) = delete;

 private:
  bool previous_;
};
/// True inside a ReceiveScope of the calling thread.
bool in_receive();

/// Counts the waits of its thread that are not a receive's (NOTE [A chunk's
/// own waits]) while installed with a distributed::WaitObserverScope, and
/// times the compute between them: the action's nodes.
class ChunkWaits : public distributed::WaitObserver {
 public:
  ChunkWaits();  ///< the action starts
  void before_wait(const distributed::Work& work) override;
  void after_wait() override;
  /// `seconds` of the thread's time since went to other work (a queued W).
  void exclude(double seconds);
  /// The action ended: its last node. `nodes` stays empty without waits.
  void finish();
  int count = 0;              ///< the waits seen
  double seconds = 0.0;       ///< their time, each from its start to its end
  std::vector<double> nodes;  ///< compute between them (count + 1, after finish())

 private:
  std::chrono::steady_clock::time_point started_, last_;
  double node_ = 0.0;
  bool counting_ = false;
};

/// The step's spans of `rank` as events in seconds (compute events without
/// their waits: NOTE [Compute events exclude waits] in step_timer.cpp),
/// appended to `events`; returns the seconds of compute among them.
double resolve_spans(StepTimer& timer, int rank, const std::vector<TimedSpan>& spans,
                     std::vector<schedule::Event>& events);

/// A StepTimer on the host clock (std::chrono::steady_clock).
std::unique_ptr<StepTimer> make_host_timer();
/// A StepTimer of events on `device`'s current stream of the thread that
/// marks (CUDA, or any device type whose events record time).
std::unique_ptr<StepTimer> make_device_timer(torch::Device device);

}  // namespace hp::pipeline
