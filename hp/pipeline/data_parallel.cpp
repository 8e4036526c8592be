// GradientReducer: data-parallel gradient averages started per stage from
// the pipeline's on_done hook (NOTE [Gradient reduction in the cool-down]).
#include "hp/pipeline/data_parallel.h"

#include <algorithm>
#include <chrono>

#include "hp/distributed/lanes.h"

namespace hp::pipeline {

GradientReducer::GradientReducer(std::shared_ptr<distributed::Comm> dp,
                                 const std::map<int, std::vector<torch::Tensor>>& stage_parameters,
                                 std::map<int, int> stage_microbatches, std::vector<int> order)
    : dp_(std::move(dp)), microbatches_(std::move(stage_microbatches)), order_(std::move(order)) {
  TORCH_CHECK(dp_ != nullptr, "GradientReducer: no data-parallel group");
  std::map<const void*, size_t> index;  // TensorImpl -> position in tensors_
  for (const auto& [stage, params] : stage_parameters) {
    TORCH_CHECK(microbatches_.count(stage) && microbatches_.at(stage) > 0,
                "GradientReducer: no microbatch count for stage ", stage);
    for (const auto& t : params) {
      auto [it, fresh] = index.emplace(t.unsafeGetTensorImpl(), tensors_.size());
      if (fresh) {
        tensors_.push_back(t);
        holders_.push_back(0);
      }
      stage_tensors_[stage].push_back(it->second);
      ++holders_[it->second];
    }
  }
  // Every stage with parameters once, in order; those the order leaves out
  // after it, ascending.
  std::vector<int> full;
  for (int st : order_)
    if (stage_tensors_.count(st) && std::find(full.begin(), full.end(), st) == full.end())
      full.push_back(st);
  for (const auto& [st, idx] : stage_tensors_)
    if (std::find(full.begin(), full.end(), st) == full.end()) full.push_back(st);
  order_ = std::move(full);
}

void GradientReducer::begin_step() {
  TORCH_CHECK(pending_.empty(),
              "GradientReducer: the previous step's reductions were not waited for");
  remaining_ = holders_;
  done_.clear();
  posted_ = 0;
  exposed_ = 0;
}

void GradientReducer::start(size_t i) {
  torch::Tensor& t = tensors_[i];
  if (!t.grad().defined()) t.mutable_grad() = torch::zeros_like(t);
  TORCH_INTERNAL_ASSERT(t.grad().is_contiguous(), "gradients are contiguous");
  pending_.push_back(dp_->all_reduce_async(t.grad(), distributed::ReduceOp::Avg));
}

void GradientReducer::on_done(int stage, int mb) {
  if (!stage_tensors_.count(stage)) return;  // a stage without parameters
  if (++done_[stage] != microbatches_.at(stage)) return;
  post_ready();
}

// NOTE [Reductions in a fixed order]
void GradientReducer::post_ready() {
  distributed::LaneScope lane(distributed::kDeferredLane);
  while (posted_ < order_.size()) {
    const int st = order_[posted_];
    if (done_[st] != microbatches_.at(st)) return;
    for (size_t i : stage_tensors_.at(st))
      if (--remaining_[i] == 0) start(i);
    ++posted_;
  }
}

void GradientReducer::finish_step() {
  for (const auto& [stage, idx] : stage_tensors_)
    TORCH_CHECK(done_[stage] == microbatches_.at(stage), "stage ", stage, " ran ", done_[stage],
                " of ", microbatches_.at(stage),
                " microbatches this step; its gradients were not reduced");
  TORCH_INTERNAL_ASSERT(posted_ == order_.size(),
                        "every stage done, yet not every reduction posted");
  const auto t0 = std::chrono::steady_clock::now();
  distributed::wait_all(pending_);
  pending_.clear();
  exposed_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::map<int, int> microbatches_per_stage(const schedule::Schedule& schedule, int rank) {
  std::map<int, int> n;
  for (const auto& a : schedule.actions.at(rank))
    if (a.op == schedule::Op::F || a.op == schedule::Op::FB) ++n[a.stage];  // FB: its F half
  return n;
}

std::vector<int> stages_by_last_backward(const schedule::Schedule& schedule, int rank) {
  std::map<int, size_t> last;  // stage -> position of its last backward
  const auto& actions = schedule.actions.at(rank);
  for (size_t k = 0; k < actions.size(); ++k) {
    const auto& a = actions[k];
    if (a.op == schedule::Op::B || a.op == schedule::Op::W) last[a.stage] = k;
    if (a.op == schedule::Op::FB) last[a.stage2] = k;  // its backward half
  }
  std::vector<std::pair<size_t, int>> by_position;  // (position, stage)
  for (const auto& [st, k] : last)
    by_position.emplace_back(k, st);
  std::sort(by_position.begin(), by_position.end());
  std::vector<int> order;
  for (const auto& [k, st] : by_position)
    order.push_back(st);
  return order;
}

}  // namespace hp::pipeline
