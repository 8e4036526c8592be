// SendReaper: completes a step's posted sends off the walk's thread (the
// executor's helper; NOTE [Sends complete when posted]).
#pragma once

#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "hp/distributed/comm.h"

namespace hp::pipeline::detail {

// Waits for posted sends in order on its own thread (started at the first
// send still in flight; NOTE [Sends complete when posted]), runs each one's
// completion callback and drops its tensor; remembers the first failure for
// the walk to rethrow. A stream-ordered send (NOTE [No host synchronization
// per action]) is waited on a side stream of `device`, and its tensor is
// marked as used there before it is freed.
class SendReaper {
 public:
  explicit SendReaper(torch::Device device) : device_(device) {}
  ~SendReaper() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void add(distributed::Work work, torch::Tensor keep_alive, std::function<void()> on_done) {
    // NOTE [Sends complete when posted]
    // A send that completed when it was posted (one copied into a
    // shared-memory ring) is finished here, on the walk's thread: handing it
    // to the helper thread would wake that thread once per send, and with
    // one core per rank the wake-up and the switch back cost the walk tens
    // of microseconds per send on the critical path (1F1B at p = 2 has one
    // send per action pair). The helper thread starts only for the first
    // send that is still in flight, so a step whose sends all complete at
    // once never starts it.
    if (work.completed()) {
      try {
        if (on_done) on_done();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      host_blocking_ = host_blocking_ || work.blocks_host();
      queue_.push_back({std::move(work), std::move(keep_alive), std::move(on_done)});
    }
    if (!thread_.joinable()) {
      if (!device_.is_cpu())
        side_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_);
      thread_ = std::thread([this] { loop(); });
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
  // Whether any send added since the last call blocks the host (so that
  // drain() waited for the transfer itself, not only for the helper).
  bool took_host_blocking_sends() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(host_blocking_, false);
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
        if (side_ && !item.work.blocks_host()) {
          c10::StreamGuard on_side(*side_);
          item.work.wait();  // the side stream waits for the send; the host does not
          if (item.keep_alive.defined() && !item.keep_alive.device().is_cpu())
            item.keep_alive.record_stream(*side_);  // its memory is reused after the send
        } else {
          item.work.wait();
        }
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
  bool busy_ = false, stop_ = false, host_blocking_ = false;
  std::exception_ptr error_;
  torch::Device device_;
  std::optional<c10::Stream> side_;  // set before the thread starts
  std::thread thread_;
};

}  // namespace hp::pipeline::detail
