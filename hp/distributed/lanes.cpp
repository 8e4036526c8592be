// with_lanes: a Comm whose operations go to one of several copies of a
// group, the one the calling thread's LaneScope names (NOTE [Lanes]).
#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "hp/distributed/lanes.h"

namespace hp::distributed {

// NOTE [Lanes]
// Point-to-point is matched in posting order per pair of ranks, and
// collectives in call order (NOTE [Point-to-point without tags]), so every
// rank must post a group's operations in one order. An overlapped pair
// whose halves take the CPU as their messages arrive (NOTE [Overlapped
// pairs] in hp/pipeline/overlap.cpp, ExecutorOptions::pair_first_ready)
// posts in an order that depends on timing: the forward's dispatch before
// the backward's combine on one rank, after it on its expert-parallel peer.
// Lanes make that safe: the group is split into copies over the same ranks
// (each its own c10d group, so its own channels and sequence numbers), and
// each thread posts on the lane its LaneScope names: the executor and a
// pair's first half on lane 0, the second half on lane 1, the weight
// gradients run in a pair's waits on lane 2. Within each lane the order is
// the code's again (a half's own program order, the queue of deferred W's),
// the same on every rank, whichever half got the CPU first. A lane beyond
// the group's count falls back to lane 0, so a LaneScope is harmless where
// no group has lanes (and there the pair keeps its fixed order). A group
// in lanes also tells an expert dispatch that each thread posting on it
// has a lane of its own (lane_count; NOTE [Counts at the head of the rows]
// in hp/moe/all_to_all.cpp).

namespace {

thread_local int current_lane_index = 0;

class LanedComm : public Comm {
 public:
  explicit LanedComm(std::vector<std::shared_ptr<Comm>> lanes) : lanes_(std::move(lanes)) {}

  int rank() const override { return lanes_[0]->rank(); }
  int world_size() const override { return lanes_[0]->world_size(); }
  std::chrono::milliseconds timeout() const override { return lanes_[0]->timeout(); }
  std::string backend_name() const override { return lanes_[0]->backend_name(); }
  bool early_receives_are_free() const override { return lanes_[0]->early_receives_are_free(); }

  Work isend(const at::Tensor& tensor, int dst) override { return lane().isend(tensor, dst); }
  Work irecv(const at::Tensor& tensor, int src) override { return lane().irecv(tensor, src); }
  std::vector<Work> batch(const std::vector<P2POp>& ops) override { return lane().batch(ops); }
  void all_reduce(const at::Tensor& t, ReduceOp op) override { lane().all_reduce(t, op); }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    lane().all_gather(out, in);
  }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    lane().reduce_scatter(out, in, op);
  }
  void broadcast(const at::Tensor& t, int root) override { lane().broadcast(t, root); }
  void barrier() override { lane().barrier(); }
  void abandon(const std::string& why) override {
    for (auto& l : lanes_)
      l->abandon(why);
  }
  // A subgroup has as many lanes (each split in turn, on every member alike).
  int lanes() const { return static_cast<int>(lanes_.size()); }
  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    std::vector<std::shared_ptr<Comm>> parts;
    for (auto& l : lanes_)
      parts.push_back(l->split(ranks));
    return std::make_shared<LanedComm>(std::move(parts));
  }

 private:
  Comm& lane() const {
    const int i = current_lane_index;
    return *lanes_[i >= 0 && i < static_cast<int>(lanes_.size()) ? i : 0];
  }
  std::vector<std::shared_ptr<Comm>> lanes_;
};

}  // namespace

std::shared_ptr<Comm> with_lanes(std::shared_ptr<Comm> group, int lanes) {
  TORCH_CHECK(group != nullptr, "with_lanes: no Comm given");
  TORCH_CHECK(lanes >= 1, "with_lanes: lanes must be at least 1, got ", lanes);
  if (lanes == 1) return group;
  std::vector<int> all(group->world_size());
  for (int r = 0; r < group->world_size(); ++r)
    all[r] = r;
  std::vector<std::shared_ptr<Comm>> copies{group};
  for (int l = 1; l < lanes; ++l)
    copies.push_back(group->split(all));
  return std::make_shared<LanedComm>(std::move(copies));
}

int lane_count(const Comm& group) {
  const auto* laned = dynamic_cast<const LanedComm*>(&group);
  return laned != nullptr ? laned->lanes() : 1;
}

LaneScope::LaneScope(int lane) : previous_(current_lane_index) {
  current_lane_index = lane;
}
LaneScope::~LaneScope() {
  current_lane_index = previous_;
}
int current_lane() {
  return current_lane_index;
}

namespace {
thread_local const std::string* exchange_refusal = nullptr;
thread_local std::string last_refusal;  // take_exchange_refusal's
}  // namespace

NoExchangeScope::NoExchangeScope(std::string why)
    : previous_(exchange_refusal), why_(std::move(why)) {
  exchange_refusal = &why_;
  last_refusal.clear();  // none left over from an earlier scope's error
}
NoExchangeScope::~NoExchangeScope() {
  exchange_refusal = previous_;
}
void check_exchange_allowed(const char* what) {
  if (exchange_refusal == nullptr) return;
  last_refusal = std::string(what) + ": " + *exchange_refusal;
  throw std::runtime_error(last_refusal);
}
std::string take_exchange_refusal() {
  return std::exchange(last_refusal, std::string());
}

}  // namespace hp::distributed
