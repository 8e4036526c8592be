// with_stream_ordered_p2p: a Comm decorator whose point-to-point runs as one
// NCCL stream does - each rank's operations one batch at a time, in posting
// order - over the wrapped (Gloo) Comm. The CPU check of the GPU protocol.
#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "hp/distributed/comm.h"

namespace hp::distributed {
namespace {

// NOTE [Stream-ordered point-to-point]
// On NCCL every point-to-point operation of a rank is a kernel on one stream:
// it starts when the one before it finished, and a send finishes only when
// the peer's matching receive runs (and the other way round). A batch
// (`Comm::batch`, a coalesced group) is one kernel for all its operations.
// Gloo's sends have the same rendezvous: a send completes only once the
// receiver posted its receive (checked: a send with no receive posted times
// out). So running each rank's batches one after the other on a worker
// thread, posting a batch's operations on the wrapped Gloo Comm and waiting
// for all of them before the next, behaves as NCCL would, deadlocks
// included: a schedule whose ranks post in inconsistent orders hangs here
// until the timeout, and the test that runs every schedule through this
// decorator is what shows the executor's protocol safe for NCCL.
class OrderedComm : public Comm, public std::enable_shared_from_this<OrderedComm> {
 public:
  explicit OrderedComm(std::shared_ptr<Comm> inner)
      : inner_(std::move(inner)), worker_([this] { loop(); }) {}
  ~OrderedComm() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name() + "+ordered"; }

  Work isend(const at::Tensor& tensor, int dst) override {
    return batch({P2POp::send(tensor, dst)})[0];
  }
  Work irecv(const at::Tensor& tensor, int src) override {
    return batch({P2POp::recv(tensor, src)})[0];
  }
  std::vector<Work> batch(const std::vector<P2POp>& ops) override {
    auto b = std::make_shared<Batch>();
    b->ops = ops;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(b);
    }
    cv_.notify_all();
    auto w = Work(std::make_shared<BatchWork>(shared_from_this(), b));
    return std::vector<Work>(ops.size(), w);
  }

  void all_reduce(const at::Tensor& t, ReduceOp op) override { inner_->all_reduce(t, op); }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    inner_->all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }
  void abandon(const std::string& why) override { inner_->abandon(why); }
  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    return inner_->split(ranks);
  }

 private:
  struct Batch {
    std::vector<P2POp> ops;
    bool done = false;
    std::exception_ptr error;
  };
  struct BatchWork : Work::Impl {
    BatchWork(std::shared_ptr<OrderedComm> c, std::shared_ptr<Batch> b)
        : comm(std::move(c)), batch(std::move(b)) {}
    void wait() override {
      std::unique_lock<std::mutex> lock(comm->mu_);
      comm->done_cv_.wait(lock, [&] { return batch->done; });
      if (batch->error) std::rethrow_exception(batch->error);
    }
    std::optional<bool> test() const override {
      std::lock_guard<std::mutex> lock(comm->mu_);
      return batch->done;
    }
    std::shared_ptr<OrderedComm> comm;
    std::shared_ptr<Batch> batch;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      auto b = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error = failed_;
      if (!error) {
        try {
          auto works = inner_->batch(b->ops);
          wait_all(works);
        } catch (...) {
          error = std::current_exception();
        }
      }
      lock.lock();
      if (error && !failed_) failed_ = error;  // a broken stream fails all later batches
      b->error = error;
      b->done = true;
      done_cv_.notify_all();
    }
  }

  std::shared_ptr<Comm> inner_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::shared_ptr<Batch>> queue_;
  std::exception_ptr failed_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

std::shared_ptr<Comm> with_stream_ordered_p2p(std::shared_ptr<Comm> inner) {
  TORCH_CHECK(inner != nullptr, "with_stream_ordered_p2p: no Comm given");
  return std::make_shared<OrderedComm>(std::move(inner));
}

}  // namespace hp::distributed
