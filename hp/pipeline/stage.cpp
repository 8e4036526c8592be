// PipelineStage: per (stage, microbatch) slots holding the input, the output
// and the GradFunction from F until W; gradients accumulate in .grad().
#include "hp/pipeline/stage.h"

#include <algorithm>
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
autograd::TensorList PipelineStage::seed(const Slot& s, const Message& grad_output, int stage,
                                         int mb) const {
  if (s.is_last) {
    TORCH_CHECK(grad_output.empty(), "stage ", stage, " microbatch ", mb,
                ": its output is the loss; it takes no output gradient");
    if (loss_scale_ == 1.0) return {};
    return {torch::full_like(s.output[0], loss_scale_, torch::MemoryFormat::Contiguous)};
  }
  const size_t want =
      static_cast<size_t>(std::count(s.output_grad.begin(), s.output_grad.end(), true));
  TORCH_CHECK(grad_output.size() == want, "stage ", stage, " microbatch ", mb, ": ",
              grad_output.size(), " output gradients for its ", want,
              " output tensors that take a gradient");
  return grad_output;
}

const StageModule& PipelineStage::held(int stage, int mb) const {
  auto mod = modules_.find(stage);
  TORCH_CHECK(mod != modules_.end(), "stage ", stage, " microbatch ", mb,
              ": this rank does not hold stage ", stage);
  return mod->second;
}

PipelineStage::Slot& PipelineStage::slot(int stage, int mb, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  TORCH_CHECK(it != slots_.end(), "stage ", stage, " microbatch ", mb, ": ", what,
              " before its F; the schedule must run F first");
  return it->second;
}

const Message& PipelineStage::forward(int stage, int mb, const Message& input,
                                      const std::vector<bool>& takes_grad, bool is_last) {
  const StageModule& module = held(stage, mb);
  return forward_computed(stage, mb, input, takes_grad, is_last, [&](const Message& in) {
    Message out =
        module.forward_message ? module.forward_message(in) : Message{module.forward(in.at(0))};
    if (!is_last) return out;
    TORCH_CHECK(out.size() == 1, "stage ", stage, " microbatch ", mb, ": a last stage returns ",
                "one tensor for the loss, not ", out.size());
    return Message{loss_(out[0], mb)};
  });
}

const Message& PipelineStage::forward_computed(
    int stage, int mb, const Message& input, const std::vector<bool>& takes_grad, bool is_last,
    const std::function<Message(const Message& leaves)>& compute) {
  const StageModule& module = held(stage, mb);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!slots_.count({stage, mb}), "stage ", stage, " microbatch ", mb,
                ": F ran twice in one step");
  }
  TORCH_CHECK(takes_grad.empty() || takes_grad.size() == input.size(), "stage ", stage,
              " microbatch ", mb, ": ", takes_grad.size(), " gradient flags for ", input.size(),
              " input tensors");
  Slot s;
  autograd::TensorList grad_inputs;  // the inputs whose gradients travel back
  s.input.reserve(input.size());
  for (size_t i = 0; i < input.size(); ++i) {
    const bool grad = !takes_grad.empty() && takes_grad[i];
    s.input_grad.push_back(grad);
    if (grad) {
      s.input.push_back(input[i].detach().requires_grad_(true));
      grad_inputs.push_back(s.input.back());
    } else {
      s.input.push_back(input[i]);
    }
  }
  auto run = [&]() -> Message { return compute(s.input); };
  s.output = hooks_.around_forward ? hooks_.around_forward(stage, mb, run) : run();
  if (is_last)
    TORCH_CHECK(s.output.size() == 1, "stage ", stage, " microbatch ", mb,
                ": a last stage's forward gives one loss, not ", s.output.size(), " tensors");
  autograd::TensorList grad_outputs;
  s.output_grad.reserve(s.output.size());
  for (size_t i = 0; i < s.output.size(); ++i) {
    torch::Tensor& out = s.output[i];
    TORCH_CHECK(out.defined(), "stage ", stage, " microbatch ", mb, ": output ", i,
                " is undefined");
    // What is sent must be dense. A stage may legally return a strided view
    // (y.t().contiguous().t()); it is copied once, inside the graph, so the
    // copy's backward hands the gradient on and the copy is what gets released.
    if (!is_last && !out.is_contiguous()) out = out.contiguous();
    // NOTE [Releasing the leaves of a message]
    // release_output swaps a sent output's storage for an empty one, which is
    // safe only where nothing in the stage's graph saved that tensor. A lone
    // output is the end of its stage's graph; in a message of several, one
    // leaf may be another's input (hidden states that also make a gate), and
    // a leaf that takes no gradient may be this stage's own input passed on
    // (a mask) or a saved index. So in a message of several tensors each leaf
    // that takes a gradient is copied once, inside the graph (a copy's
    // backward saves nothing), and the copy is what is sent and released;
    // leaves that take none, usually small, are never released. The Python
    // package's packing copied every leaf into one flat tensor for the same
    // reason.
    if (!is_last && s.output.size() > 1 && out.requires_grad()) out = out.clone();
    s.output_grad.push_back(out.requires_grad());
    if (out.requires_grad()) grad_outputs.push_back(out);
  }
  TORCH_CHECK(!grad_outputs.empty(), "stage ", stage, " microbatch ", mb,
              ": no output requires grad (does the stage have parameters?)");
  if (is_last) {
    s.is_last = true;
    const torch::Tensor& loss = s.output[0];
    if (loss.device().is_cpu()) {
      loss_sum_host_ += loss.item<double>() * loss_scale_;
    } else {
      // On the loss's device, in float64 (each float32 loss converts exactly,
      // so the sum has the bits of summing item<double>() values).
      torch::NoGradGuard no_grad;
      torch::Tensor l = loss.detach().to(torch::kFloat64).reshape({}) * loss_scale_;
      loss_sum_ = loss_sum_.defined() ? loss_sum_ + l : l;
    }
  }
  s.grad_fn.emplace(std::move(grad_outputs), std::move(grad_inputs), module.parameters);
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.emplace(std::make_pair(stage, mb), std::move(s)).first->second.output;
}

Message PipelineStage::backward_input(int stage, int mb, const Message& grad_output) {
  Slot& s = slot(stage, mb, "I");
  TORCH_CHECK(!s.input_done, "stage ", stage, " microbatch ", mb, ": I ran twice");
  autograd::TensorList dx;
  auto run = [&] { dx = s.grad_fn->compute_input_grad(seed(s, grad_output, stage, mb)); };
  hooks_.around_backward ? hooks_.around_backward(stage, mb, 'I', run) : run();
  s.input_done = true;
  return dx;
}

void PipelineStage::backward_weight(int stage, int mb) {
  Slot& s = slot(stage, mb, "W");
  TORCH_CHECK(s.input_done, "stage ", stage, " microbatch ", mb, ": W before I");
  auto run = [&] { s.grad_fn->weight_grad_into_grad(); };
  hooks_.around_backward ? hooks_.around_backward(stage, mb, 'W', run) : run();
  finish(stage, mb);
}

bool PipelineStage::backward_weight_part(int stage, int mb, int parts) {
  Slot& s = slot(stage, mb, "W");
  TORCH_CHECK(s.input_done, "stage ", stage, " microbatch ", mb, ": W before I");
  // A hook wraps the whole W (a recompute session runs the forward again
  // around it): it is not cut.
  if (hooks_.around_backward || parts <= 1) {
    backward_weight(stage, mb);
    return true;
  }
  if (!s.grad_fn->weight_grad_part_into_grad(parts)) return false;
  finish(stage, mb);
  return true;
}

Message PipelineStage::backward(int stage, int mb, const Message& grad_output) {
  Slot& s = slot(stage, mb, "B");
  TORCH_CHECK(!s.input_done, "stage ", stage, " microbatch ", mb, ": B after I");
  autograd::TensorList dx;
  auto run = [&] { dx = s.grad_fn->backward_into_grad(seed(s, grad_output, stage, mb)); };
  hooks_.around_backward ? hooks_.around_backward(stage, mb, 'B', run) : run();
  finish(stage, mb);
  return dx;
}

// NOTE [A pair that computes itself]
// DualPipe's overlapped_forward_backward hook runs a pair's two halves
// itself, interleaving the module's parts as it sees fit: it is handed the
// F's input leaves and the B's roots and seeds, and calls the module and the
// engine on them. forward_computed stores what it returns as F would
// (output leaves, the loss summed, the GradFunction for a later I or W that
// will not come). The B it ran accumulated into the weights' .grad as a
// fused B does, and into the .grad of the input leaves that take a gradient
// (leaves the F made with requires_grad): backward_computed reads those as
// the input gradients and ends the slot. The around_backward hook (recompute
// sessions) does not wrap such a B: the engine call is the hook's own.
std::pair<Message, Message> PipelineStage::backward_roots(int stage, int mb,
                                                          const Message& grad_output) {
  Slot& s = slot(stage, mb, "B");
  TORCH_CHECK(!s.input_done, "stage ", stage, " microbatch ", mb, ": B after I");
  Message roots;
  for (size_t i = 0; i < s.output.size(); ++i)
    if (s.is_last || s.output_grad[i]) roots.push_back(s.output[i]);
  return {std::move(roots), seed(s, grad_output, stage, mb)};
}

Message PipelineStage::backward_computed(int stage, int mb) {
  Slot& s = slot(stage, mb, "B");
  TORCH_CHECK(!s.input_done, "stage ", stage, " microbatch ", mb, ": B after I");
  Message dx;
  for (size_t i = 0; i < s.input.size(); ++i) {
    if (!s.input_grad[i]) continue;
    torch::Tensor& leaf = s.input[i];
    dx.push_back(leaf.grad().defined() ? leaf.grad() : torch::zeros_like(leaf));
    leaf.mutable_grad().reset();
  }
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

const Message& PipelineStage::output(int stage, int mb) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  TORCH_CHECK(it != slots_.end(), "stage ", stage, " microbatch ", mb,
              ": its output was asked for before its F ran");
  return it->second.output;
}

bool PipelineStage::has_output(int stage, int mb) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.count({stage, mb}) > 0;
}

std::vector<bool> PipelineStage::output_takes_grad(int stage, int mb) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  TORCH_CHECK(it != slots_.end(), "stage ", stage, " microbatch ", mb,
              ": its output was asked for before its F ran");
  return it->second.output_grad;
}

void PipelineStage::release_output(int stage, int mb) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find({stage, mb});
  if (it == slots_.end()) return;  // already finished: nothing left to free
  // NOTE [Releasing a sent output]
  // After the send, only the output's grad_fn matters: the backward is rooted
  // at its gradient edge, and GradFunction recorded its shape at construction.
  // Swapping in an empty storage frees the activation now instead of at W.
  // If the last op saved its own result (e.g. tanh), autograd holds another
  // reference to the storage and nothing is freed; results never change.
  // NOTE [Releasing the leaves of a message]: those that take a gradient.
  torch::NoGradGuard no_grad;
  for (torch::Tensor& out : it->second.output)
    if (out.requires_grad()) out.set_data(torch::empty({0}, out.options()));
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
