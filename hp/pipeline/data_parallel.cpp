// GradientReducer: data-parallel gradient averages started per stage from
// the pipeline's on_done hook (NOTE [Gradient reduction in the cool-down]).
#include "hp/pipeline/data_parallel.h"

#include <chrono>

namespace hp::pipeline {

GradientReducer::GradientReducer(std::shared_ptr<distributed::Comm> dp,
                                 const std::map<int, std::vector<torch::Tensor>>& stage_parameters,
                                 std::map<int, int> stage_microbatches)
    : dp_(std::move(dp)), microbatches_(std::move(stage_microbatches)) {
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
}

void GradientReducer::begin_step() {
  TORCH_CHECK(pending_.empty(),
              "GradientReducer: the previous step's reductions were not waited for");
  remaining_ = holders_;
  done_.clear();
  exposed_ = 0;
}

void GradientReducer::start(size_t i) {
  torch::Tensor& t = tensors_[i];
  if (!t.grad().defined()) t.mutable_grad() = torch::zeros_like(t);
  TORCH_INTERNAL_ASSERT(t.grad().is_contiguous(), "gradients are contiguous");
  pending_.push_back(dp_->all_reduce_async(t.grad(), distributed::ReduceOp::Avg));
}

void GradientReducer::on_done(int stage, int mb) {
  auto it = stage_tensors_.find(stage);
  if (it == stage_tensors_.end()) return;  // a stage without parameters
  if (++done_[stage] != microbatches_.at(stage)) return;
  for (size_t i : it->second)
    if (--remaining_[i] == 0) start(i);
}

void GradientReducer::finish_step() {
  for (const auto& [stage, idx] : stage_tensors_)
    TORCH_CHECK(done_[stage] == microbatches_.at(stage), "stage ", stage, " ran ", done_[stage],
                " of ", microbatches_.at(stage),
                " microbatches this step; its gradients were not reduced");
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

}  // namespace hp::pipeline
