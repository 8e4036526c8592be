// with_link_model: point-to-point that costs what a real network link costs
// (NOTE [The link model]).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "hp/distributed/comm.h"

namespace hp::distributed {

// NOTE [The link model]
// Ranks on one host talk over loopback, where a message costs a copy and
// almost no latency, so communication that a cluster must hide (DualPipe's
// all-to-alls, the pipeline's transfers) cannot be seen to be hidden here.
// with_link_model gives each process's outgoing messages the cost of a
// link: a message posted at t leaves when the link is free (the messages of
// a process leave one after another, as through one network interface,
// whatever Comm posted them), occupies it bytes / bandwidth, and arrives
// `latency` later; only then is it handed to the inner Comm, which moves it
// at once. One thread per process holds the messages until they are due,
// sleeping (no CPU is used), and posts them in the order they were posted,
// so point-to-point keeps its posting order across every Comm of the process
// (NOTE [Point-to-point without tags]; class Link below). Ranks run as
// threads of one process share that one link. Receives go straight to the
// inner Comm: they complete when the delayed message arrives. What is modelled is
// the sender's link; a receiver taking messages from several peers at once
// is not slowed (an all-to-all's receives overlap, as on a switch whose
// ports each have the link's bandwidth). Collectives that the inner Comm
// runs itself (all_reduce, all_gather, broadcast, barrier) are not delayed:
// the model is for what the pipeline and expert parallelism send.

LinkModel LinkModel::parse(const std::string& text, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(what + " '" + text + "': " + why +
                                 "; give LATENCY_US,GBPS, e.g. 20,12.5 for 20 microseconds and "
                                 "12.5 GB/s (GBPS 0: no bandwidth limit)");
  };
  const auto comma = text.find(',');
  if (comma == std::string::npos) throw bad("no comma");
  auto number = [&](const std::string& part, const char* name) {
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(part.c_str(), &end);
    if (part.empty() || end != part.c_str() + part.size() || errno != 0 || !(v >= 0) || v > 1e12)
      throw bad(std::string(name) + " '" + part + "' is not a number >= 0");
    return v;
  };
  LinkModel link;
  link.latency_s = number(text.substr(0, comma), "LATENCY_US") * 1e-6;
  link.bytes_per_s = number(text.substr(comma + 1), "GBPS") * 1e9;
  return link;
}

std::string LinkModel::describe() const {
  std::ostringstream out;
  out << latency_s * 1e6 << " us, ";
  if (bytes_per_s > 0)
    out << bytes_per_s / 1e9 << " GB/s";
  else
    out << "unlimited bandwidth";
  return out.str();
}

namespace {

using Clock = std::chrono::steady_clock;

// A send held until it is due.
struct HeldSend {
  std::mutex mutex;
  std::condition_variable posted_cv;
  bool posted = false;
  Work inner;
  std::exception_ptr error;
  std::shared_ptr<Comm> comm;  // where it goes when due
  at::Tensor tensor;
  int dst = 0;
  Clock::time_point due;
};

struct HeldSendWork : Work::Impl {
  std::shared_ptr<HeldSend> send;
  std::chrono::milliseconds timeout;
  void wait() override {
    {
      std::unique_lock<std::mutex> lock(send->mutex);
      // The message is due by its time; the timeout guards a stuck link.
      const bool ok =
          send->posted_cv.wait_until(lock, send->due + timeout, [&] { return send->posted; });
      TORCH_CHECK(ok, "link model: a send to rank ", send->dst, " was never handed over");
      if (send->error) std::rethrow_exception(send->error);
    }
    send->inner.wait();
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(send->mutex);
    if (send->posted) send->inner.abort();
  }
  std::optional<bool> test() const override {
    std::lock_guard<std::mutex> lock(send->mutex);
    if (!send->posted) return false;  // not yet due
    if (send->error) return true;     // the wait throws at once
    return send->inner.test();
  }
};

// The process's one link: every LinkComm's sends leave through it, one after
// another, in the order they were posted, whatever Comm or group they are
// for. One queue per process, not per Comm: two Comms over one process group
// (a Pipeline's and an expert dispatcher's, or one dispatcher per layer)
// post tag-free point-to-point on the same channels, and a send of the
// second Comm overtaking an earlier one of the first would meet the peer's
// receive of the first (NOTE [Point-to-point without tags]). Never
// destroyed: its thread sleeps when there is nothing to send.
class Link {
 public:
  static Link& instance() {
    static Link* link = new Link();
    return *link;
  }

  std::shared_ptr<HeldSend> hold(std::shared_ptr<Comm> comm, const LinkModel& model,
                                 const at::Tensor& tensor, int dst) {
    auto held = std::make_shared<HeldSend>();
    held->comm = std::move(comm);
    held->tensor = tensor;
    held->dst = dst;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto now = Clock::now();
      const auto busy = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
          model.busy_seconds(int64_t(tensor.numel()) * int64_t(tensor.element_size()))));
      free_ = std::max(free_, now) + busy;
      held->due = free_ + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(model.latency_s));
      // Posting order is kept: a message never leaves before an earlier one.
      if (!queue_.empty()) held->due = std::max(held->due, queue_.back()->due);
      queue_.push_back(held);
    }
    cv_.notify_all();
    return held;
  }

 private:
  Link() {
    std::thread([this] { run(); }).detach();
  }

  // Hands each held send to its Comm when it is due, in posting order.
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (queue_.empty()) {
        cv_.wait(lock);
        continue;
      }
      std::shared_ptr<HeldSend> next = queue_.front();
      if (Clock::now() < next->due) {
        cv_.wait_until(lock, next->due);
        continue;
      }
      queue_.pop_front();
      lock.unlock();
      Work posted;
      std::exception_ptr error;
      try {
        posted = next->comm->isend(next->tensor, next->dst);
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> held_lock(next->mutex);
        next->inner = std::move(posted);
        next->error = error;
        next->posted = true;
        next->comm.reset();
      }
      next->posted_cv.notify_all();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<HeldSend>> queue_;
  Clock::time_point free_{};
};

class LinkComm : public Comm {
 public:
  LinkComm(std::shared_ptr<Comm> inner, LinkModel link) : inner_(std::move(inner)), link_(link) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  bool early_receives_are_free() const override { return inner_->early_receives_are_free(); }

  Work isend(const at::Tensor& tensor, int dst) override {
    auto work = std::make_shared<HeldSendWork>();
    work->send = Link::instance().hold(inner_, link_, tensor, dst);
    work->timeout = timeout();
    return Work(work);
  }
  Work irecv(const at::Tensor& tensor, int src) override { return inner_->irecv(tensor, src); }
  // batch(): Comm's own, one isend or irecv per operation, so each send is held.

  void all_reduce(const at::Tensor& t, ReduceOp op) override { inner_->all_reduce(t, op); }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    inner_->all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }
  void abandon(const std::string& why) override { inner_->abandon(why); }
  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    return with_link_model(inner_->split(ranks), link_);
  }

 private:
  std::shared_ptr<Comm> inner_;
  LinkModel link_;
};

}  // namespace

std::shared_ptr<Comm> with_link_model(std::shared_ptr<Comm> inner, LinkModel link) {
  TORCH_CHECK(inner != nullptr, "with_link_model: no Comm given");
  if (!link.active() || inner->world_size() < 2) return inner;
  return std::make_shared<LinkComm>(std::move(inner), link);
}

}  // namespace hp::distributed
