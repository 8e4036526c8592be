// The step's timers: host clock readings, or events with timing recorded on
// the current stream of a device (NOTE [Timing on the device] in
// step_timer.h).
#include "hp/pipeline/step_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

namespace hp::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

class HostTimer : public StepTimer {
 public:
  void start() override { marks_.clear(); }
  int mark() override {
    marks_.push_back(Clock::now());
    return static_cast<int>(marks_.size()) - 1;
  }
  double seconds(int index) override {
    return std::chrono::duration<double>(marks_.at(index) - marks_.at(0)).count();
  }
  int host_syncs() const override { return 0; }

 private:
  std::vector<Clock::time_point> marks_;
};

// Events with timing recorded on the current stream; read after one
// synchronization on the last (the stream ran every earlier one before it).
// Events are reused from step to step.
class DeviceTimer : public StepTimer {
 public:
  explicit DeviceTimer(torch::Device device) : device_(device), impl_(device.type()) {}
  void start() override {
    used_ = 0;
    seconds_.clear();
    syncs_ = 0;
  }
  int mark() override {
    if (used_ == events_.size())
      events_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    events_[used_].record(impl_.getStream(device_));
    seconds_.clear();
    return static_cast<int>(used_++);
  }
  double seconds(int index) override {
    TORCH_CHECK(index >= 0 && size_t(index) < used_, "StepTimer: mark ", index,
                " was not made in this step");
    if (seconds_.size() != used_) {
      events_[used_ - 1].synchronize();
      ++syncs_;
      seconds_.resize(used_);
      for (size_t k = 0; k < used_; ++k)
        seconds_[k] = k == 0 ? 0.0 : events_[0].elapsedTime(events_[k]) / 1e3;  // ms -> s
    }
    return seconds_[index];
  }
  int host_syncs() const override { return syncs_; }

 private:
  torch::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  std::vector<c10::Event> events_;
  size_t used_ = 0;
  std::vector<double> seconds_;
  int syncs_ = 0;
};

}  // namespace

std::unique_ptr<StepTimer> make_host_timer() {
  return std::make_unique<HostTimer>();
}

std::unique_ptr<StepTimer> make_device_timer(torch::Device device) {
  TORCH_CHECK(!device.is_cpu(), "make_device_timer: ", device,
              " records no events; time the CPU with make_host_timer()");
  return std::make_unique<DeviceTimer>(device);
}

// NOTE [Compute events exclude waits]
// A compute action waits for its inputs inside the call; that time is
// communication, recorded as the receive's own event. The compute event
// keeps only the compute: it starts `waited` after the call did (for an FB
// run as one action after the other, whose second wait falls in the
// middle, the event is as long as the compute and ends when it ended), and
// never before its first wait ended, so that it never overlaps a receive's
// event on its rank. The little the call did before its first wait (a
// lookup; under load, a preemption of tens of microseconds, which once put
// the event before its receive's end) counts as overhead. Counting the wait
// as compute once made the measured costs of waiting stages look heavier,
// the simulator pessimistic about 1F1B and the measured bubble too small.

namespace {
thread_local bool t_in_receive = false;
}  // namespace

ReceiveScope::ReceiveScope(bool receiving) : previous_(std::exchange(t_in_receive, receiving)) {}
ReceiveScope::~ReceiveScope() {
  t_in_receive = previous_;
}
bool in_receive() {
  return t_in_receive;
}

ChunkWaits::ChunkWaits() : last_(Clock::now()) {}

void ChunkWaits::before_wait(const distributed::Work&) {
  const auto now = Clock::now();
  node_ += std::chrono::duration<double>(now - last_).count();
  counting_ = !in_receive();
  if (!counting_) return;
  started_ = now;
  nodes.push_back(std::max(0.0, node_));
  node_ = 0.0;
}
void ChunkWaits::after_wait() {
  last_ = Clock::now();
  if (!counting_) return;
  ++count;
  seconds += std::chrono::duration<double>(last_ - started_).count();
}
void ChunkWaits::exclude(double s) {
  node_ -= s;
}
void ChunkWaits::finish() {
  node_ += std::chrono::duration<double>(Clock::now() - last_).count();
  nodes.push_back(std::max(0.0, node_));
  if (count == 0) nodes.clear();
}

// NOTE [An overlapped pair's events]
// An overlapped pair's timeline holds its halves, as the simulator's does
// (NOTE [An overlapped pair in the simulator] in hp/schedule/simulate.cpp):
// an F event and a B event (an I with defer_wgrad, whose W's are events of
// their own), each ending when its half ended and as long as the half held
// the CPU (PairStats::compute, the span's `compute`). Not the pair's span
// less its waits: the waits of one half overlap the other's compute, so
// that subtraction made pairs look almost free, their measured costs low
// and the predicted step 12-23 % short. A half cut by waits inside its
// chunk (an expert layer's all-to-alls) is drawn as one stretch before its
// end, which may overlap the partner's; its length is still its compute.
double resolve_spans(StepTimer& timer, int rank, const std::vector<TimedSpan>& spans,
                     std::vector<schedule::Event>& events) {
  auto sec = [&](int mark) { return timer.seconds(mark); };
  double compute = 0.0;
  for (const TimedSpan& sp : spans) {
    double start = sec(sp.start);
    const double end = sec(sp.end);
    if (schedule::is_compute(sp.action.op)) {
      if (sp.compute >= 0) {  // NOTE [An overlapped pair's events]
        start = std::max(start, end - sp.compute);
      } else {  // NOTE [Compute events exclude waits], NOTE [A chunk's own waits]
        double waited = sp.inner_waited;
        for (const auto& [w0, w1] : sp.waits)
          waited += sec(w1) - sec(w0);
        start = start + waited;
        if (!sp.waits.empty()) start = std::max(start, sec(sp.waits.front().second));
      }
      start = std::min(end, start);
      compute += end - start;
    }
    events.push_back({rank, sp.action, start, end, sp.inner_waits, sp.inner_waited, sp.nodes});
  }
  return compute;
}

}  // namespace hp::pipeline
