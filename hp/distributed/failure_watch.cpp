// with_failure_store: a Comm decorator through which a rank whose step failed
// tells its peers over a group that has no signal of its own (a plain Gloo
// group), through a c10d Store the ranks share (NOTE [A failed step reaches
// the peers] in comm.h).
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::distributed {
namespace {

// How often a wait in progress looks at the store.
constexpr auto kPoll = std::chrono::milliseconds(100);
// The reason a failed rank leaves (at most this long).
constexpr size_t kMaxReason = 2000;

// "failed/R" holds rank R's reason; "failed" is set by every failed rank
// after its reason, so that one look tells whether any rank failed.
const std::string kAny = "failed";
std::string reason_key(int rank) {
  return "failed/" + std::to_string(rank);
}

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

struct Failure {
  int rank = -1;
  std::string why;
};

// The store, the waits in progress and the thread that watches for a peer's
// failure while there are any (one per decorated Comm; started at the first
// wait that blocks).
class Watch {
 public:
  Watch(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size)
      : store_(std::move(store)), rank_(rank), world_size_(world_size) {}

  ~Watch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // Before the calling thread blocks on `w`: false (and `known` filled) when
  // a peer's failure is already known, so the caller does not wait at all.
  bool enter(Work* w, Failure* known) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) {
      *known = *failure_;
      return false;
    }
    waiting_.push_back(w);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    if (waiting_.size() == 1) cv_.notify_all();  // an idle watcher starts looking
    return true;
  }

  void leave(Work* w) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(waiting_.begin(), waiting_.end(), w);
    if (it != waiting_.end()) waiting_.erase(it);
  }

  std::optional<Failure> failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

  // This rank stopped taking part: its reason, then the mark. A store that
  // fails (its host is gone) leaves the peers to notice that instead; one
  // whose host is stopped (rank 0 under torchrun, SIGSTOPped: NOTE [A stopped
  // peer] in comm_internal.h) would block the call until the store's own
  // timeout, so the writes run on a thread of their own, waited for 2 s.
  void publish(const std::string& why) {
    const std::string line = why.substr(0, std::min(why.size(), kMaxReason));
    auto done = std::make_shared<std::promise<void>>();
    auto written = done->get_future();
    std::thread([store = store_, key = reason_key(rank_), line, done] {
      try {
        store->set(key, bytes_of(line));
        store->set(kAny, bytes_of("1"));
      } catch (...) {
      }
      done->set_value();
    }).detach();
    written.wait_for(std::chrono::seconds(2));
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (waiting_.empty() || failure_ || store_failed_) {
        cv_.wait(lock, [&] { return stop_ || (!waiting_.empty() && !failure_ && !store_failed_); });
        continue;
      }
      // Waits in progress: look once they have gone on for a while, so that
      // the short waits of a healthy step never reach the store.
      if (cv_.wait_for(lock, kPoll, [&] { return stop_ || waiting_.empty(); })) continue;
      lock.unlock();
      std::optional<Failure> found;
      bool store_failed = false;
      try {
        found = look();
      } catch (...) {
        store_failed = true;  // its host is gone: the peers' connections say so
      }
      lock.lock();
      store_failed_ = store_failed;
      if (found) {
        failure_ = found;
        for (Work* w : waiting_)
          w->abort();  // their waits end and throw (Gloo: the group stays intact)
      }
    }
  }

  // A peer's failure, if the store holds one (one round trip when none).
  std::optional<Failure> look() const {
    if (!store_->check({kAny})) return std::nullopt;
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_ || !store_->check({reason_key(r)})) continue;
      auto v = store_->get(reason_key(r));
      return Failure{r, std::string(v.begin(), v.end())};
    }
    return std::nullopt;  // only this rank failed
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int world_size_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Work*> waiting_;  // the Works of the waits in progress
  std::optional<Failure> failure_;
  bool store_failed_ = false;
  bool stop_ = false;
  std::thread thread_;
};

CommError failure_error(int rank, const Failure& f, const std::string& what) {
  return CommError("rank " + std::to_string(rank) + ": rank " + std::to_string(f.rank) +
                       " stopped taking part while this rank was " + what + ": " + f.why,
                   {f.rank}, false);
}

// A Work of the inner Comm whose host wait the Watch can end.
struct WatchedWork : Work::Impl {
  WatchedWork(std::shared_ptr<Watch> w, Work in, std::string wh, int r)
      : watch(std::move(w)), inner(std::move(in)), what(std::move(wh)), rank(r) {}

  void wait() override {
    if (!inner.blocks_host() || inner.completed()) {
      inner.wait();
      return;
    }
    Failure known;
    if (!watch->enter(&inner, &known)) throw failure_error(rank, known, what);
    try {
      inner.wait();
    } catch (...) {
      watch->leave(&inner);
      if (auto f = watch->failure()) throw failure_error(rank, *f, what);
      throw;
    }
    watch->leave(&inner);
  }
  bool blocks_host() const override { return inner.blocks_host(); }
  bool completed() const override { return inner.completed(); }
  std::optional<bool> test() const override { return inner.test(); }
  void abort() override { inner.abort(); }

  std::shared_ptr<Watch> watch;
  Work inner;
  std::string what;
  int rank;
};

class FailureStoreComm : public Comm {
 public:
  FailureStoreComm(std::shared_ptr<Comm> inner, c10::intrusive_ptr<c10d::Store> store)
      : inner_(std::move(inner)),
        watch_(std::make_shared<Watch>(std::move(store), inner_->rank(), inner_->world_size())) {}
  FailureStoreComm(std::shared_ptr<Comm> inner, std::shared_ptr<Watch> watch)
      : inner_(std::move(inner)), watch_(std::move(watch)) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  bool early_receives_are_free() const override { return inner_->early_receives_are_free(); }

  Work isend(const at::Tensor& tensor, int dst) override {
    return watched(inner_->isend(tensor, dst), "sending to rank " + std::to_string(dst));
  }
  Work irecv(const at::Tensor& tensor, int src) override {
    return watched(inner_->irecv(tensor, src), "receiving from rank " + std::to_string(src));
  }
  std::vector<Work> batch(const std::vector<P2POp>& ops) override {
    auto works = inner_->batch(ops);
    for (size_t i = 0; i < works.size() && i < ops.size(); ++i)
      works[i] =
          watched(std::move(works[i]),
                  (ops[i].kind == P2POp::Kind::Send ? "sending to rank " : "receiving from rank ") +
                      std::to_string(ops[i].peer));
    return works;
  }

  // Collectives are not woken (Gloo's cannot be aborted); they fail at once
  // once a peer's failure is known.
  void all_reduce(const at::Tensor& t, ReduceOp op) override {
    check("in an all_reduce");
    inner_->all_reduce(t, op);
  }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    check("in an all_gather");
    inner_->all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override {
    check("in a broadcast");
    inner_->broadcast(t, root);
  }
  void barrier() override {
    check("in a barrier");
    inner_->barrier();
  }
  void abandon(const std::string& why) override {
    watch_->publish(why);
    inner_->abandon(why);
  }
  // A copy over the same ranks (a lane: NOTE [Lanes] in lanes.cpp) shares
  // the watch, so a failure reaches waits on every copy; a subgroup numbers
  // its ranks anew and has no store of its own.
  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    auto part = inner_->split(ranks);
    if (part->world_size() != world_size()) return part;
    return std::make_shared<FailureStoreComm>(std::move(part), watch_);
  }

 private:
  Work watched(Work w, std::string what) {
    if (!w.valid() || w.completed()) return w;
    return Work(std::make_shared<WatchedWork>(watch_, std::move(w), std::move(what), rank()));
  }
  void check(const std::string& what) const {
    if (auto f = watch_->failure()) throw failure_error(rank(), *f, what);
  }

  std::shared_ptr<Comm> inner_;
  std::shared_ptr<Watch> watch_;
};

}  // namespace

std::shared_ptr<Comm> with_failure_store(std::shared_ptr<Comm> inner,
                                         c10::intrusive_ptr<c10d::Store> store) {
  TORCH_CHECK(inner != nullptr, "with_failure_store: no Comm given");
  if (!store || inner->world_size() < 2) return inner;
  return std::make_shared<FailureStoreComm>(std::move(inner), std::move(store));
}

}  // namespace hp::distributed
