// The step's timers: host clock readings, or events with timing recorded on
// the current stream of a device (NOTE [Timing on the device] in
// step_timer.h).
#include "hp/pipeline/step_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
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

}  // namespace hp::pipeline
