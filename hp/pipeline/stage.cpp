// PipelineStage: per (stage, microbatch) slots holding the input, the output
// and the GradFunction from F until W; gradients accumulate in .grad().
#include "hp/pipeline/stage.h"

#include <cmath>

namespace hp::pipeline {

PipelineStage::PipelineStage(std::map<int, StageModule> modules, LossFn loss, StageHooks hooks,
                             double loss_scale)
    : modules_(std::move(modules)),
      loss_(std::move(loss)),
      hooks_(std::move(hooks)),
      loss_scale_(loss_scale) {
  TORCH_CHECK(!modules_.empty(), "a PipelineStage needs at least one stage module");
  TORCH_CHECK(std::isfinite(loss_scale) && loss_scale != 0,
              "loss_scale must be finite and not 0, got ", loss_scale);
}

// NOTE [The loss scale is the backward's seed]
// Every microbatch's loss counts loss_scale times (1/m: the step's loss is
// the mean over its microbatches). Dividing the loss in the forward would put
// one more operation into every last-stage microbatch's graph, and one more
// node into its backward; instead the backward starts from loss_scale where
// it would start from 1. The gradients are the same numbers: a division's
// backward hands its input 1 / m, the value the seed holds (bit for bit when
// m is a power of two; else both are 1 / m rounded to the loss's dtype, once
// or through float64). The loss itself is summed as loss * loss_scale in
// float64, on the host for a CPU loss (one read of a scalar, where moving it
// to a float64 tensor and adding took four operations), on its device
// otherwise. In the overhead setting of the peer benchmark (a last stage's
// microbatch is about 3 ms there) the division and the four operations cost
// 35-40 us a microbatch (measured alone, 2026-12-01).
autograd::TensorList PipelineStage::seed(const Slot& s, const torch::Tensor& grad_output) const {
  if (grad_output.defined()) return {grad_output};
  if (!s.is_last || loss_scale_ == 1.0) return {};
  return {torch::full_like(s.output, loss_scale_, torch::MemoryFormat::Contiguous)};
}

PipelineStage::Slot& PipelineStage::slot(int stage, int mb, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  TORCH_CHECK(it != slots_.end(), "stage ", stage, " microbatch ", mb, ": ", what,
              " before its F; the schedule must run F first");
  return it->second;
}

torch::Tensor PipelineStage::forward(int stage, int mb, const torch::Tensor& input,
                                     bool input_needs_grad, bool is_last) {
  auto mod = modules_.find(stage);
  TORCH_CHECK(mod != modules_.end(), "stage ", stage, " microbatch ", mb,
              ": this rank does not hold stage ", stage);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!slots_.count({stage, mb}), "stage ", stage, " microbatch ", mb,
                ": F ran twice in one step");
  }
  Slot s;
  s.input = input_needs_grad ? input.detach().requires_grad_(true) : input;
  auto run = [&] {
    torch::Tensor out = mod->second.forward(s.input);
    if (is_last) out = loss_(out, mb);
    return out;
  };
  s.output = hooks_.around_forward ? hooks_.around_forward(stage, mb, run) : run();
  TORCH_CHECK(s.output.requires_grad(), "stage ", stage, " microbatch ", mb,
              ": the output does not require grad (does the stage have parameters?)");
  // What is sent must be dense. A stage may legally return a strided view
  // (y.t().contiguous().t()); it is copied once, inside the graph, so the
  // copy's backward hands the gradient on and the copy is what gets released.
  if (!is_last && !s.output.is_contiguous()) s.output = s.output.contiguous();
  if (is_last) {
    s.is_last = true;
    if (s.output.device().is_cpu()) {
      loss_sum_host_ += s.output.item<double>() * loss_scale_;
    } else {
      // On the loss's device, in float64 (each float32 loss converts exactly,
      // so the sum has the bits of summing item<double>() values).
      torch::NoGradGuard no_grad;
      torch::Tensor l = s.output.detach().to(torch::kFloat64).reshape({}) * loss_scale_;
      loss_sum_ = loss_sum_.defined() ? loss_sum_ + l : l;
    }
  }
  s.grad_fn.emplace(autograd::TensorList{s.output},
                    input_needs_grad ? autograd::TensorList{s.input} : autograd::TensorList{},
                    mod->second.parameters);
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.emplace(std::make_pair(stage, mb), std::move(s)).first->second.output;
}

torch::Tensor PipelineStage::backward_input(int stage, int mb, const torch::Tensor& grad_output) {
  Slot& s = slot(stage, mb, "I");
  TORCH_CHECK(!s.input_done, "stage ", stage, " microbatch ", mb, ": I ran twice");
  autograd::TensorList dx;
  auto run = [&] { dx = s.grad_fn->compute_input_grad(seed(s, grad_output)); };
  hooks_.around_backward ? hooks_.around_backward(stage, mb, 'I', run) : run();
  s.input_done = true;
  return dx.empty() ? torch::Tensor() : dx[0];
}

void PipelineStage::backward_weight(int stage, int mb) {
  Slot& s = slot(stage, mb, "W");
  TORCH_CHECK(s.input_done, "stage ", stage, " microbatch ", mb, ": W before I");
  auto run = [&] { s.grad_fn->weight_grad_into_grad(); };
  hooks_.around_backward ? hooks_.around_backward(stage, mb, 'W', run) : run();
  finish(stage, mb);
}

torch::Tensor PipelineStage::backward(int stage, int mb, const torch::Tensor& grad_output) {
  Slot& s = slot(stage, mb, "B");
  TORCH_CHECK(!s.input_done, "stage ", stage, " microbatch ", mb, ": B after I");
  autograd::TensorList dxs;
  auto run = [&] { dxs = s.grad_fn->backward_into_grad(seed(s, grad_output)); };
  hooks_.around_backward ? hooks_.around_backward(stage, mb, 'B', run) : run();
  torch::Tensor dx = dxs.empty() ? torch::Tensor() : dxs[0];
  finish(stage, mb);
  return dx;
}

void PipelineStage::finish(int stage, int mb) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slots_.erase({stage, mb});
  }
  if (hooks_.on_done) hooks_.on_done(stage, mb);
}

const torch::Tensor& PipelineStage::output(int stage, int mb) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  TORCH_CHECK(it != slots_.end(), "stage ", stage, " microbatch ", mb,
              ": its output was asked for before its F ran");
  return it->second.output;
}

void PipelineStage::release_output(int stage, int mb) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  if (it == slots_.end()) return;  // already finished: nothing left to free
  torch::Tensor& out = it->second.output;
  // NOTE [Releasing a sent output]
  // After the send, only the output's grad_fn matters: the backward is rooted
  // at its gradient edge, and GradFunction recorded its shape at construction.
  // Swapping in an empty storage frees the activation now instead of at W.
  // If the last op saved its own result (e.g. tanh), autograd holds another
  // reference to the storage and nothing is freed; results never change.
  torch::NoGradGuard no_grad;
  out.set_data(torch::empty({0}, out.options()));
}

size_t PipelineStage::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.size();
}

void PipelineStage::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(slots_.empty(), slots_.size(),
              " (stage, microbatch) pairs are still between F and W at the end of the step; "
              "the schedule must run every W");
  loss_sum_host_ = 0;
  loss_sum_ = torch::Tensor();
}

double PipelineStage::loss_sum() const {
  return loss_sum_host_ + (loss_sum_.defined() ? loss_sum_.item<double>() : 0.0);
}

}  // namespace hp::pipeline
