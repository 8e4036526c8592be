// checkpoint(): the block (saved inputs, RNG state), its backward node
// (CheckpointBackward, the joining node of the dx/dw split), the recompute and
// the block's own split, prefetch handles and the handle collector.
#include "hp/recompute/checkpoint.h"

#include <ATen/Context.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>

#include "hp/autograd/grad_function.h"
#include "hp/recompute/session_registry.h"

namespace hp::recompute {

using hp::autograd::GradFunction;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// NOTE [One recompute for dx and dw]
// A checkpointed block's backward node (CheckpointBackward) has one next edge
// per block input, then one per weight. hp::autograd's split therefore sees it
// as a joining node: dx asks it (task_should_compute_output) only for input
// slots, dw (rooted at the gradients captured at this node during dx) only for
// weight slots, and a plain backward for all of them. The node answers each
// request from a *recomputed block*: `fn` re-run with grad enabled on fresh
// leaves aliasing the saved inputs, with the real weights:
//  * dx and dw at once (fused): GradFunction(...)() on the recomputed graph;
//  * dx: GradFunction::compute_input_grad; when the current session retains
//    (SessionOptions::retain_on_unpack) the GradFunction stays in the session,
//    keyed by block id, for the dw request;
//  * dw: the retained GradFunction's compute_weight_grad, or, when none is
//    retained, a new recompute and a dw-only backward.
// Where a request finds its recomputed block, in order: the current session's
// cache (prefetched or retained), the block's own prefetch slot (a handle
// recomputed outside any session), else it recomputes now. Without a session
// a split backward therefore recomputes twice (once for dx, once for dw), like
// an ordinary checkpoint under two backward calls; a retaining session makes it
// once, and the FLOPs of dx + dw are one forward plus one fused backward.
// Reentrancy: the inner GradFunction runs LibTorch's engine from inside this
// node's apply (a reentrant backward, supported on the CPU engine's thread
// and on a device thread alike). The current session is found on whichever
// thread runs the node (NOTE [Sessions reach the engine's threads]).

// NOTE [Weight gradients are accumulated once]
// GradFunction accumulates the dw it computes into each weight's .grad (as
// backward() does), but here the *outer* backward owns that: the dw this node
// returns reaches the weights' AccumulateGrad (plain backward) or the outer
// GradFunction (split). So around every inner dw computation GradShield moves
// each weight's .grad aside and puts it back afterwards (even on throw), and
// the inner accumulation lands in a throw-away slot. (The alternative, running
// the recompute on detached weight aliases, would need `fn` to take its
// weights as arguments; blocks usually capture their parameters.) The shield
// assumes nothing else writes these weights' .grad while the node runs, which
// holds while one thread runs the block's part of the graph: the engine runs
// the nodes of CPU tensors one at a time on the calling thread, and those of
// a device's tensors one at a time on that device's thread.

namespace detail {

/// A block recomputed for backward: its graph, alive as long as this is.
struct Recomputed {
  TensorList outputs;                 ///< recomputed outputs that require grad
  std::vector<size_t> output_slots;   ///< the node input slot (differentiable output) of each
  TensorList inputs;                  ///< fresh leaves, one per block input (undefined: no dx)
  TensorList weights;                 ///< the block's weights that require grad
  std::vector<size_t> weight_index;   ///< index in the block's weight list of each
  std::optional<GradFunction> split;  ///< set when dx ran and the session retains it for dw
};

}  // namespace detail

namespace {

std::atomic<uint64_t> next_block_id{1};

struct ThreadState {
  std::vector<HandleCollector*> collectors;
  int recompute_depth = 0;  // > 0 while a block recomputes: its nested blocks are not collected
};
ThreadState& tls() {
  static thread_local ThreadState state;
  return state;
}

struct RecomputeDepth {
  RecomputeDepth() { tls().recompute_depth++; }
  ~RecomputeDepth() { tls().recompute_depth--; }
};

// See NOTE [Weight gradients are accumulated once].
class GradShield {
 public:
  explicit GradShield(const TensorList& weights) {
    for (const auto& w : weights) {
      torch::Tensor alias = w;
      saved_.emplace_back(alias, alias.grad());
      alias.mutable_grad() = torch::Tensor();
    }
  }
  ~GradShield() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it)
      it->first.mutable_grad() = std::move(it->second);
  }
  GradShield(const GradShield&) = delete;
  GradShield& operator=(const GradShield&) = delete;

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> saved_;
};

using RngStates = std::vector<std::pair<c10::Device, torch::Tensor>>;

RngStates save_rng(const TensorList& inputs) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto& x : inputs)  // CUDA's generators too; other backends keep none here
    if (x.defined() && x.device().is_cuda() &&
        std::find(devices.begin(), devices.end(), x.device()) == devices.end())
      devices.push_back(x.device());
  RngStates states;
  for (const auto& d : devices) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.emplace_back(d, gen.get_state());
  }
  return states;
}

void set_rng(const RngStates& states) {
  for (const auto& [d, state] : states) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

// Replays the forward's RNG state for the recompute, then restores the current one.
class RngReplay {
 public:
  explicit RngReplay(const RngStates& forward) {
    if (forward.empty()) return;
    std::vector<c10::Device> devices;
    for (const auto& s : forward)
      devices.push_back(s.first);
    for (const auto& d : devices) {
      auto gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      current_.emplace_back(d, gen.get_state());
    }
    set_rng(forward);
  }
  ~RngReplay() { set_rng(current_); }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  RngStates current_;
};

bool differentiable(const torch::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

}  // namespace

/// A checkpointed block: what its recompute needs. Owned by its backward node
/// (so it lives as long as the graph); handles hold it weakly.
struct Block {
  uint64_t id = 0;
  BlockFn fn;
  CheckpointOptions options;
  size_t num_inputs = 0;
  TensorList inputs;  // detached aliases of the inputs (cleared by release)
  std::vector<bool> input_requires_grad;
  std::vector<int64_t> input_versions;
  TensorList weights;
  std::vector<int64_t> weight_versions;
  size_t num_outputs = 0;
  std::vector<size_t> diff_outputs;  // fn output index of each node input slot
  RngStates rng;

  std::mutex mutex;                  // guards the two below
  detail::RecomputedPtr prefetched;  // recomputed outside any session
  bool released = false;

  detail::RecomputedPtr recompute();
  variable_list backward(const variable_list& grads, const std::vector<bool>& want, bool retain);
  void release();
};

detail::RecomputedPtr Block::recompute() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    TORCH_CHECK(!released, "checkpointed block ", id,
                ": its saved inputs were freed by an earlier backward that did not keep the "
                "graph; keep the graph (keep_graph / retain_graph) to run its backward again");
  }
  if (options.check_versions()) {
    for (size_t i = 0; i < inputs.size(); ++i)
      TORCH_CHECK(!inputs[i].defined() || inputs[i]._version() == input_versions[i],
                  "checkpointed block ", id, ": input ", i,
                  " was modified in place after the forward, so its recompute would differ; "
                  "do not modify a checkpointed block's inputs before its backward (or clone "
                  "them)");
    for (size_t i = 0; i < weights.size(); ++i)
      TORCH_CHECK(weights[i]._version() == weight_versions[i], "checkpointed block ", id,
                  ": weight ", i,
                  " was modified in place after the forward (an optimizer step?), so its "
                  "recompute would differ; run the block's backward before updating weights");
  }
  RecomputeDepth depth;
  std::optional<RngReplay> replay;
  if (options.preserve_rng_state()) replay.emplace(rng);
  torch::AutoGradMode grad_mode(true);

  auto r = std::make_shared<detail::Recomputed>();
  TensorList fn_inputs(inputs.size());
  r->inputs.resize(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (input_requires_grad[i]) {
      fn_inputs[i] = inputs[i].detach().requires_grad_(true);
      r->inputs[i] = fn_inputs[i];
    } else {
      fn_inputs[i] = inputs[i];
    }
  }
  TensorList outs = fn(fn_inputs);
  TORCH_CHECK(outs.size() == num_outputs, "checkpointed block ", id, ": the recompute returned ",
              outs.size(), " tensors but the forward returned ", num_outputs,
              "; a checkpointed function must return the same outputs every time");
  for (size_t slot = 0; slot < diff_outputs.size(); ++slot) {
    const auto& o = outs[diff_outputs[slot]];
    if (o.defined() && o.requires_grad()) {
      r->outputs.push_back(o);
      r->output_slots.push_back(slot);
    }
  }
  for (size_t j = 0; j < weights.size(); ++j) {
    if (weights[j].requires_grad()) {
      r->weights.push_back(weights[j]);
      r->weight_index.push_back(j);
    }
  }
  return r;
}

variable_list Block::backward(const variable_list& grads, const std::vector<bool>& want,
                              bool retain) {
  const size_t n_in = num_inputs;
  bool want_dx = false, want_dw = false;
  for (size_t i = 0; i < want.size(); ++i)
    (i < n_in ? want_dx : want_dw) |= want[i];
  variable_list out(want.size());
  if (!want_dx && !want_dw) return out;

  const detail::CurrentSession* current = detail::current_session();
  std::optional<SessionId> session;
  if (current != nullptr) session = current->id;
  retain = retain && current != nullptr && current->options.retain_on_unpack();
  const SessionId* counted = session ? &*session : nullptr;

  // Find the recomputed block: session cache, own prefetch slot, or recompute now.
  detail::RecomputedPtr r;
  if (session) r = detail::take_cached(*session, id);
  if (!r) {
    std::lock_guard<std::mutex> lock(mutex);
    r = std::move(prefetched);
  }
  // A block whose dx already ran (retained) can only serve dw.
  if (r && r->split && !(want_dw && !want_dx)) {
    detail::record(counted, detail::Event::Clear);
    r.reset();
  }
  const bool reused = r != nullptr;
  if (!r) {
    r = recompute();
    detail::record(counted, detail::Event::Recompute);
  }
  detail::record(counted, detail::Event::Consume);
  if (reused) detail::record(counted, detail::Event::Reuse);
  if (r->outputs.empty()) return out;  // nothing in the block depends on what requires grad

  TensorList sens;
  for (size_t k = 0; k < r->outputs.size(); ++k) {
    const auto& g = grads[r->output_slots[k]];
    sens.push_back(g.defined() ? g : torch::zeros_like(r->outputs[k]));
  }
  auto put_dx = [&](const TensorList& dx) {
    for (size_t i = 0; i < n_in; ++i)
      if (want[i]) out[i] = dx[i];
  };
  auto put_dw = [&](const TensorList& dw) {
    for (size_t k = 0; k < dw.size(); ++k)
      if (want[n_in + r->weight_index[k]]) out[n_in + r->weight_index[k]] = dw[k];
  };

  if (want_dx && want_dw) {
    GradFunction fused(r->outputs, r->inputs, r->weights);
    GradShield shield(r->weights);
    auto g = fused(sens);
    put_dx(g.input_grads);
    put_dw(g.weight_grads);
  } else if (want_dx) {
    if (retain && !r->weights.empty()) {
      GradFunction split(r->outputs, r->inputs, r->weights);
      put_dx(split.compute_input_grad(sens));
      r->split = std::move(split);
      detail::put_cached(*session, id, std::move(r));  // kept for dw
    } else {
      GradFunction dx_only(r->outputs, r->inputs, {});
      put_dx(dx_only(sens).input_grads);
    }
  } else if (r->split) {
    GradShield shield(r->weights);
    put_dw(r->split->compute_weight_grad());
  } else {
    GradFunction dw_only(r->outputs, {}, r->weights);
    GradShield shield(r->weights);
    put_dw(dw_only(sens).weight_grads);
  }
  return out;
}

void Block::release() {
  detail::RecomputedPtr dropped;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(mutex);
  released = true;
  inputs.clear();
  fn = nullptr;
  dropped = std::move(prefetched);
}

namespace {

/// The backward node of one checkpointed block: next edges = inputs, then weights.
struct CheckpointBackward : Node {
  explicit CheckpointBackward(std::shared_ptr<Block> block) : block_(std::move(block)) {}

  variable_list apply(variable_list&& grads) override {
    // Ask the engine first: after the inner backward the current graph task changes.
    std::vector<bool> want(num_outputs());
    bool any_weight_edge = false;
    for (size_t i = 0; i < want.size(); ++i) {
      want[i] = task_should_compute_output(i);
      if (i >= block_->num_inputs) any_weight_edge |= next_edge(i).is_valid();
    }
    return block_->backward(grads, want, /*retain=*/any_weight_edge);
  }
  void release_variables() override { block_->release(); }
  std::string name() const override { return "hp::recompute::CheckpointBackward"; }

  std::shared_ptr<Block> block_;
};

}  // namespace

TensorList checkpoint(const BlockFn& fn, const TensorList& inputs, const TensorList& weights,
                      const CheckpointOptions& options) {
  TORCH_CHECK(static_cast<bool>(fn),
              "checkpoint needs a function to run; pass a non-empty BlockFn");
  for (size_t j = 0; j < weights.size(); ++j)
    TORCH_CHECK(weights[j].defined(), "checkpoint: weight ", j,
                " is undefined; pass only defined tensors as weights");
  bool any_grad = false;
  for (const auto& t : inputs)
    any_grad |= t.defined() && t.requires_grad();
  for (const auto& t : weights)
    any_grad |= t.requires_grad();
  if (!torch::autograd::GradMode::is_enabled() || !any_grad) return fn(inputs);

  auto block = std::make_shared<Block>();
  block->id = next_block_id++;
  block->fn = fn;
  block->options = options;
  block->num_inputs = inputs.size();
  for (const auto& x : inputs) {
    block->inputs.push_back(x.defined() ? x.detach() : torch::Tensor());
    block->input_requires_grad.push_back(x.defined() && x.requires_grad());
    block->input_versions.push_back(x.defined() ? x._version() : 0);
  }
  block->weights = weights;
  for (const auto& w : weights)
    block->weight_versions.push_back(w._version());
  if (options.preserve_rng_state()) block->rng = save_rng(inputs);

  TensorList outs;
  {
    torch::NoGradGuard no_grad;
    outs = fn(inputs);
  }
  TORCH_CHECK(!outs.empty(), "checkpoint: the function returned no tensors; return at least one");
  block->num_outputs = outs.size();

  torch::autograd::edge_list edges;
  for (const auto& t : inputs)
    edges.push_back(t.defined() && t.requires_grad() ? torch::autograd::impl::gradient_edge(t)
                                                     : Edge());
  for (const auto& t : weights)
    edges.push_back(t.requires_grad() ? torch::autograd::impl::gradient_edge(t) : Edge());
  std::shared_ptr<CheckpointBackward> node(new CheckpointBackward(block),
                                           torch::autograd::deleteNode);
  node->set_next_edges(std::move(edges));
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!differentiable(outs[i])) continue;
    outs[i] = outs[i].detach();  // never re-parent a tensor fn returned as is (e.g. an input)
    torch::autograd::create_gradient_edge(outs[i], node);
    block->diff_outputs.push_back(i);
  }

  auto& state = tls();
  if (!state.collectors.empty() && state.recompute_depth == 0)
    state.collectors.back()->handles_.push_back(RecomputeHandle(block, block->id));
  return outs;
}

void RecomputeHandle::recompute() const {
  auto block = block_.lock();
  TORCH_CHECK(alive(), "recompute handle of block ", block_id_,
              ": the block's graph is gone (its last backward ran or its outputs were "
              "dropped); prefetch before the backward that consumes it");
  const detail::CurrentSession* current = detail::current_session();
  if (current != nullptr) {
    const SessionId session = current->id;
    if (detail::has_cached(session, block_id_)) return;
    auto r = block->recompute();
    detail::record(&session, detail::Event::Recompute);
    detail::record(&session, detail::Event::Prefetch);
    detail::put_cached(session, block_id_, std::move(r));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(block->mutex);
    if (block->prefetched) return;
  }
  auto r = block->recompute();
  detail::record(nullptr, detail::Event::Recompute);
  detail::record(nullptr, detail::Event::Prefetch);
  std::lock_guard<std::mutex> lock(block->mutex);
  block->prefetched = std::move(r);
}

bool RecomputeHandle::is_recomputed() const {
  auto block = block_.lock();
  if (!block) return false;
  const detail::CurrentSession* current = detail::current_session();
  if (current != nullptr) return detail::has_cached(current->id, block_id_);
  std::lock_guard<std::mutex> lock(block->mutex);
  return block->prefetched != nullptr;
}

void RecomputeHandle::release() const {
  auto block = block_.lock();
  if (!block) return;
  detail::RecomputedPtr dropped;
  {
    std::lock_guard<std::mutex> lock(block->mutex);
    dropped = std::move(block->prefetched);
  }
  if (dropped) detail::record(nullptr, detail::Event::Clear);
}

bool RecomputeHandle::alive() const {
  auto block = block_.lock();
  if (!block) return false;
  std::lock_guard<std::mutex> lock(block->mutex);
  return !block->released;
}

HandleCollector::HandleCollector() {
  tls().collectors.push_back(this);
}

HandleCollector::~HandleCollector() {
  auto& collectors = tls().collectors;
  TORCH_INTERNAL_ASSERT(!collectors.empty() && collectors.back() == this,
                        "HandleCollectors must close in reverse order of opening");
  collectors.pop_back();
}

std::vector<RecomputeHandle> HandleCollector::take() {
  return std::exchange(handles_, {});
}

void prefetch(const std::vector<RecomputeHandle>& handles) {
  for (const auto& h : handles)
    h.recompute();
}

}  // namespace hp::recompute
