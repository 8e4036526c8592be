// GradFunction: runs the dx and dw passes planned by plan_split on LibTorch's
// engine (capture pre-hooks in dx, edge masks in dw) and accumulates dw into
// the weights' .grad(); forward_and_gradfn wraps a function around it.
#include "hp/autograd/grad_function.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_set>

#include "hp/autograd/split_plan.h"

namespace hp::autograd {

using torch::autograd::Engine;
using torch::autograd::FunctionPreHook;
using torch::autograd::variable_list;

std::vector<int64_t> GradPosition::resolve(size_t num_inputs) const {
  std::vector<int64_t> out;
  switch (kind_) {
    case Kind::All:
      for (size_t i = 0; i < num_inputs; ++i)
        out.push_back(static_cast<int64_t>(i));
      return out;
    case Kind::None:
      return out;
    case Kind::List:
      break;
  }
  std::unordered_set<int64_t> seen;
  for (int64_t p : positions_) {
    TORCH_CHECK(p >= 0 && p < static_cast<int64_t>(num_inputs), "grad_position index ", p,
                " is out of range for ", num_inputs, " inputs; use an index in [0, ", num_inputs,
                ")");
    TORCH_CHECK(seen.insert(p).second, "grad_position lists input ", p,
                " twice; list each input once");
    out.push_back(p);
  }
  return out;
}

namespace {

// Records a node's incoming gradients (one per input slot) during dx.
struct CaptureHook : FunctionPreHook {
  CaptureHook(std::shared_ptr<std::vector<variable_list>> sink, size_t index)
      : sink_(std::move(sink)), index_(index) {}
  variable_list operator()(const variable_list& grads) override {
    (*sink_)[index_] = grads;
    return grads;
  }
  std::shared_ptr<std::vector<variable_list>> sink_;
  size_t index_;
};

// Installs capture hooks for the lifetime of the guard (removed even on throw).
class CaptureHooks {
 public:
  CaptureHooks(const std::vector<std::shared_ptr<Node>>& nodes,
               const std::shared_ptr<std::vector<variable_list>>& sink) {
    for (size_t j = 0; j < nodes.size(); ++j) {
      auto hook = std::make_unique<CaptureHook>(sink, j);
      installed_.emplace_back(nodes[j].get(), hook.get());
      nodes[j]->add_pre_hook(std::move(hook));
    }
  }
  ~CaptureHooks() {
    for (auto& [node, hook] : installed_) {
      auto& hooks = node->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                 [hook = hook](const auto& h) { return h.get() == hook; }),
                  hooks.end());
    }
  }
  CaptureHooks(const CaptureHooks&) = delete;
  CaptureHooks& operator=(const CaptureHooks&) = delete;

 private:
  std::vector<std::pair<Node*, FunctionPreHook*>> installed_;
};

// NOTE [Edge masking]
// dw prunes a joining node's edges that stay inside the dx closure by
// replacing them with an invalid Edge for the duration of one engine call and
// restoring them after (even on throw). `Node::set_next_edge` cannot be used:
// it asserts the node has no parent yet (it maintains topological_nr), while
// writing through `next_edges()` does not. Removing edges only lowers the set
// of reachable nodes, so topological_nr stays a valid upper bound. The graph
// must not run elsewhere during dw, as with any backward of the same graph.
class EdgeMask {
 public:
  void mask(Node* node, size_t slot) {
    saved_.push_back({node, slot, node->next_edges()[slot]});
    node->next_edges()[slot] = Edge();
  }
  ~EdgeMask() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it)
      it->node->next_edges()[it->slot] = std::move(it->edge);
  }

 private:
  struct Saved {
    Node* node;
    size_t slot;
    Edge edge;
  };
  std::vector<Saved> saved_;
};

void accumulate_grad(const torch::Tensor& weight, const torch::Tensor& grad) {
  torch::NoGradGuard no_grad;
  auto& slot = const_cast<torch::Tensor&>(weight).mutable_grad();
  if (!slot.defined()) {
    slot = grad.detach().clone();
  } else {
    slot.add_(grad);
  }
}

torch::Tensor or_zeros(const torch::Tensor& grad, const torch::Tensor& like) {
  return grad.defined() ? grad : torch::zeros_like(like);
}

// A set of nodes for one walk: open addressing over a table that only grows
// and is cleared slot by slot, so a walk allocates nothing once warm.
class NodeSet {
 public:
  /// True when `n` was not in the set.
  bool insert(const Node* n) {
    if (2 * (used_.size() + 1) > slots_.size()) grow();
    size_t i = slot_of(n);
    if (slots_[i] == n) return false;
    slots_[i] = n;
    used_.push_back(i);
    return true;
  }
  bool contains(const Node* n) const { return !slots_.empty() && slots_[slot_of(n)] == n; }
  void clear() {
    for (size_t i : used_)
      slots_[i] = nullptr;
    used_.clear();
  }

 private:
  size_t slot_of(const Node* n) const {
    const size_t mask = slots_.size() - 1;
    size_t i = (reinterpret_cast<uintptr_t>(n) >> 4) * 0x9E3779B97F4A7C15ull & mask;
    while (slots_[i] && slots_[i] != n)
      i = (i + 1) & mask;
    return i;
  }
  void grow() {
    std::vector<const Node*> old;
    for (size_t i : used_)
      old.push_back(slots_[i]);
    slots_.assign(std::max<size_t>(64, slots_.size() * 2), nullptr);
    used_.clear();
    for (const Node* n : old)
      insert(n);
  }
  std::vector<const Node*> slots_;
  std::vector<size_t> used_;
};

// NOTE [An unlimited engine call where limits change nothing]
// backward_into_grad limits the engine to the wanted edges (the inputs' and
// weights' AccumulateGrad nodes), as backward(inputs=...) does. The engine
// pays for the limit: a walk of the whole graph that marks what leads to a
// wanted edge (GraphTask::init_to_execute, a hash map entry per node), then a
// lookup per node and per output edge of each node as it runs (profiled on
// the peer benchmark's 1F1B last stage, overhead setting: about 2.3 % of the
// rank's CPU). Where every sink the graph reaches - a node with no valid next
// edge, such as a leaf's AccumulateGrad - is a wanted one, every node leads
// to a wanted edge and the limited call runs all of them; then the engine
// runs unlimited instead (loss.backward()'s path): the same nodes in the same
// order, the same .grad bit for bit. This walk costs a fraction of the
// engine's: one visit per node in a flat set. A graph that reaches a leaf
// outside the inputs and weights (a tensor the stage does not train, whose
// .grad must stay as it is) keeps the limited call.
bool reaches_only(const std::vector<Edge>& roots, const std::vector<Edge>& wanted) {
  thread_local NodeSet allowed, seen;
  thread_local std::vector<Node*> stack;
  allowed.clear();
  seen.clear();
  stack.clear();
  for (const auto& e : wanted)
    allowed.insert(e.function.get());
  for (const auto& e : roots)
    if (e.is_valid() && seen.insert(e.function.get())) stack.push_back(e.function.get());
  bool only = true;
  while (only && !stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (allowed.contains(n)) continue;
    bool sink = true;
    for (const auto& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      sink = false;
      if (seen.insert(e.function.get())) stack.push_back(e.function.get());
    }
    only = !sink;
  }
  return only;
}

}  // namespace

struct GradFunction::Impl {
  enum class State { Fresh, InputDone, Done };

  TensorList outputs, inputs, weights;
  // Shapes and options of the outputs at construction: a pipeline stage may
  // release an output's storage once it is sent (see PipelineStage).
  std::vector<std::vector<int64_t>> output_sizes;
  std::vector<torch::TensorOptions> output_options;
  std::vector<Edge> output_edges, input_edges, weight_edges;
  State state = State::Fresh;
  bool separate_dw_calls = false;
  size_t next_group = 0;  // the first weight group dw has not run (NOTE [dw in parts])

  SplitPlan plan;
  SplitStats stats;
  TensorList sens;       // per output, kept for dw roots on outputs
  TensorList dx;         // per input, kept for dw roots on inputs
  TensorList anchor_dx;  // per plan.anchor_edges, kept for dw roots on anchors (NOTE [Anchors])
  std::shared_ptr<std::vector<variable_list>> captured;  // per join node

  TensorList resolve_sens(const TensorList& given) const {
    if (given.empty()) {
      TensorList ones;
      for (const auto& o : outputs)
        ones.push_back(torch::ones_like(o));
      return ones;
    }
    TORCH_CHECK(given.size() == outputs.size(), "sens has ", given.size(),
                " tensors but there are ", outputs.size(),
                " differentiated outputs; pass one gradient per output (or none for ones)");
    for (size_t i = 0; i < given.size(); ++i) {
      TORCH_CHECK(given[i].defined(), "sens[", i, "] is undefined; pass a gradient for output ", i);
      TORCH_CHECK(given[i].sizes() == c10::IntArrayRef(output_sizes[i]), "sens[", i, "] has shape ",
                  given[i].sizes(), " but output ", i, " has shape ",
                  c10::IntArrayRef(output_sizes[i]));
      TORCH_CHECK(given[i].scalar_type() == c10::typeMetaToScalarType(output_options[i].dtype()),
                  "sens[", i, "] has dtype ", given[i].scalar_type(), " but output ", i,
                  " has dtype ", c10::typeMetaToScalarType(output_options[i].dtype()));
      TORCH_CHECK(given[i].device() == output_options[i].device(), "sens[", i, "] is on ",
                  given[i].device(), " but output ", i, " is on ", output_options[i].device());
    }
    return given;
  }

  std::vector<Edge> valid_input_edges() const {
    std::vector<Edge> edges;
    for (const auto& e : input_edges)
      if (e.is_valid()) edges.push_back(e);
    return edges;
  }

  TensorList finish_input_grads(const variable_list& grads) const {
    TensorList out(inputs.size());
    size_t k = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!input_edges[i].is_valid()) continue;
      out[i] = or_zeros(grads[k++], inputs[i]);
    }
    return out;
  }

  void release() {
    state = State::Done;
    plan = SplitPlan();
    sens.clear();
    dx.clear();
    anchor_dx.clear();
    captured.reset();
  }
};

GradFunction::GradFunction(TensorList outputs, TensorList inputs, TensorList weights)
    : impl_(std::make_shared<Impl>()) {
  auto& m = *impl_;
  TORCH_CHECK(!outputs.empty(), "GradFunction needs at least one output to differentiate");
  size_t num_inputs = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    TORCH_CHECK(inputs[i].requires_grad(), "input ", i,
                " does not require grad, so it has no dx; call requires_grad_(true) on it "
                "before the forward or leave it out of the inputs");
    num_inputs++;
  }
  TORCH_CHECK(num_inputs > 0 || !weights.empty(),
              "no weights and no input positions: nothing to differentiate; pass weights or "
              "select at least one input");
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].defined(), "output ", i, " is undefined");
    TORCH_CHECK(outputs[i].requires_grad(), "output ", i,
                " does not require grad: it depends on no input or weight that requires grad "
                "(did the forward run under NoGradGuard?)");
    m.output_edges.push_back(torch::autograd::impl::gradient_edge(outputs[i]));
    m.output_sizes.push_back(outputs[i].sizes().vec());
    m.output_options.push_back(outputs[i].options());
  }
  for (const auto& x : inputs)
    m.input_edges.push_back(x.defined() ? torch::autograd::impl::gradient_edge(x) : Edge());
  for (size_t i = 0; i < weights.size(); ++i) {
    TORCH_CHECK(weights[i].defined(), "weight ", i, " is undefined");
    TORCH_CHECK(weights[i].requires_grad(), "weight ", i,
                " does not require grad; call requires_grad_(true) on it or drop it from weights");
    m.weight_edges.push_back(torch::autograd::impl::gradient_edge(weights[i]));
    for (size_t j = 0; j < inputs.size(); ++j) {
      TORCH_CHECK(!m.input_edges[j].is_valid() || m.input_edges[j] != m.weight_edges.back(),
                  "weight ", i, " is also input ", j,
                  "; a tensor is either differentiated as an input (dx) or as a weight (dw)");
    }
  }
  m.outputs = std::move(outputs);
  m.inputs = std::move(inputs);
  m.weights = std::move(weights);
}

GradFunction& GradFunction::separate_dw_calls(bool on) {
  impl_->separate_dw_calls = on;
  return *this;
}

size_t GradFunction::num_inputs() const {
  return impl_->inputs.size();
}
size_t GradFunction::num_weights() const {
  return impl_->weights.size();
}
SplitStats GradFunction::stats() const {
  return impl_->stats;
}

TensorList GradFunction::compute_input_grad(const TensorList& sens) {
  auto& m = *impl_;
  TORCH_CHECK(m.state == Impl::State::Fresh,
              m.state == Impl::State::InputDone
                  ? "compute_input_grad was already called: dx runs once per forward; call "
                    "compute_weight_grad next"
                  : "this GradFunction's graph was already freed by a backward without "
                    "keep_graph; run the forward again");
  m.sens = m.resolve_sens(sens);
  m.plan = plan_split(m.output_edges, m.input_edges, m.weight_edges);
  m.stats = {m.plan.num_nodes, m.plan.num_dx_nodes, m.plan.join_nodes.size(), m.plan.groups.size()};
  m.captured = std::make_shared<std::vector<variable_list>>(m.plan.join_nodes.size());

  variable_list grads;
  std::vector<Edge> wanted = m.valid_input_edges();
  const size_t num_wanted_inputs = wanted.size();
  wanted.insert(wanted.end(), m.plan.anchor_edges.begin(), m.plan.anchor_edges.end());
  if (!wanted.empty()) {
    CaptureHooks hooks(m.plan.join_nodes, m.captured);
    grads = Engine::get_default_engine().execute(m.output_edges, m.sens, /*keep_graph=*/true,
                                                 /*create_graph=*/false,
                                                 /*accumulate_grad=*/false, wanted);
  }
  // The anchors' gradients, after the inputs' (NOTE [Anchors] in split_plan.h).
  m.anchor_dx.assign(grads.begin() + static_cast<std::ptrdiff_t>(num_wanted_inputs), grads.end());
  grads.resize(num_wanted_inputs);
  // What only dx needed is not needed any more: free it now, not after dw.
  for (const auto& node : m.plan.dx_only_nodes)
    node->release_variables();
  m.plan.dx_only_nodes.clear();

  m.dx = m.finish_input_grads(grads);
  m.state = Impl::State::InputDone;
  return m.dx;
}

TensorList GradFunction::compute_weight_grad(bool keep_graph) {
  return run_weight_grad(keep_graph, /*into_grad=*/false);
}

// NOTE [dw into .grad]
// W of a training step wants dw only in .grad (the pipeline's executor
// never reads what compute_weight_grad returns). Asked for as engine
// outputs, dw is captured and then added in: the first microbatch's
// gradients are copied (the returned tensor must not alias .grad), and a
// Python node that asks the engine whether a weight's node will run
// (torch._C._will_engine_execute_node, as a graph stage does) gets an error
// for a captured leaf, which costs ~0.15 ms to raise and catch. So, as the
// fused backward does (NOTE [Fused backward into .grad]), the engine runs in
// accumulating mode, limited to the weights' edges: each AccumulateGrad node
// takes its gradient as it is made (the first one without a copy) and runs
// the weight's hooks as loss.backward() does. Same values, bit for bit.
// Weights that are not leaves (no AccumulateGrad node) keep the captured
// path.
void GradFunction::weight_grad_into_grad(bool keep_graph) {
  auto& m = *impl_;
  bool leaves = true;
  for (const auto& w : m.weights)
    leaves = leaves && w.is_leaf();
  run_weight_grad(keep_graph, /*into_grad=*/leaves);
}

// NOTE [dw in parts]
// An overlapped pair fills the waits of its halves with queued W's (NOTE
// [Weight gradients until the message is there] in
// hp/pipeline/overlap.cpp), and a whole W is often longer than the wait it
// fills: the half whose message came meanwhile waits for the W to end. So
// dw can also run in parts: each call runs the next share of the weight
// groups (about 1/parts of them, in the plan's order) in one engine call,
// and the last one gives the zeros and frees the graph as a whole dw does.
// Groups share no node (NOTE [One engine call for dw]), so a part frees
// what its groups alone held and the values are a whole dw's, bit for bit.
// Weights that are not leaves take the whole dw at the first call. A whole
// weight_grad_into_grad after some parts runs the rest (a deferred W begun
// in a pair's waits and ended outside one); compute_weight_grad, which
// returns every weight's dw, is refused then.
bool GradFunction::weight_grad_part_into_grad(int parts) {
  auto& m = *impl_;
  bool leaves = true;
  for (const auto& w : m.weights)
    leaves = leaves && w.is_leaf();
  if (!leaves && m.next_group == 0) {
    run_weight_grad(false, /*into_grad=*/false);
    return true;
  }
  const size_t n = m.state == Impl::State::InputDone ? m.plan.groups.size() : 0;
  const size_t per = (n + size_t(std::max(parts, 1)) - 1) / size_t(std::max(parts, 1));
  run_weight_grad(false, /*into_grad=*/true, std::min(n, m.next_group + per));
  return m.state == Impl::State::Done;
}

TensorList GradFunction::run_weight_grad(bool keep_graph, bool into_grad, size_t end_group) {
  auto& m = *impl_;
  TORCH_CHECK(m.state != Impl::State::Fresh,
              "compute_weight_grad called before compute_input_grad: dw starts from gradients "
              "that dx captures; call compute_input_grad(sens) first, or operator() for a fused "
              "backward");
  TORCH_CHECK(m.state != Impl::State::Done,
              "compute_weight_grad was already called without keep_graph, which freed the "
              "graph; pass keep_graph=true to call it again");
  TORCH_CHECK(into_grad || m.next_group == 0,
              "compute_weight_grad after weight_grad_part_into_grad: the parts already ran "
              "went into .grad only; finish with weight_grad_part_into_grad or "
              "weight_grad_into_grad");
  const size_t first_group = m.next_group;  // NOTE [dw in parts]
  TensorList dw(m.weights.size());
  // Runs the dw of some groups in one engine call. Without keep_graph the
  // captured gradients are moved into the call, so each is freed as soon as
  // its joining node has run.
  auto run_groups = [&](const std::vector<const DwGroup*>& groups) {
    std::vector<Edge> roots, wanted;
    variable_list root_grads;
    std::vector<size_t> wanted_weight;
    for (const DwGroup* group : groups) {
      for (size_t r : group->roots) {
        const DwRoot& root = m.plan.roots[r];
        torch::Tensor g;
        switch (root.source) {
          case DwRoot::Source::Output:
            g = m.sens[root.index];
            break;
          case DwRoot::Source::Input:
            g = m.dx[root.index];
            break;
          case DwRoot::Source::Anchor:
            g = keep_graph ? m.anchor_dx[root.index] : std::move(m.anchor_dx[root.index]);
            break;
          case DwRoot::Source::Captured: {
            auto& slots = (*m.captured)[root.index];
            if (root.edge.input_nr < slots.size())
              g = keep_graph ? slots[root.edge.input_nr] : std::move(slots[root.edge.input_nr]);
            break;
          }
        }
        if (!g.defined()) continue;
        roots.push_back(root.edge);
        root_grads.push_back(std::move(g));
      }
      for (size_t w : group->weights) {
        wanted.push_back(m.weight_edges[w]);
        wanted_weight.push_back(w);
      }
    }
    if (roots.empty()) return;  // no gradient reached these groups: their dw is zeros
    variable_list grads;
    {
      EdgeMask mask;
      for (const DwGroup* group : groups)
        for (size_t j : group->join_nodes)
          for (size_t slot : m.plan.masked_edges[j])
            mask.mask(m.plan.join_nodes[j].get(), slot);
      grads = Engine::get_default_engine().execute(roots, root_grads, keep_graph,
                                                   /*create_graph=*/false, into_grad, wanted);
    }
    if (into_grad) return;
    for (size_t k = 0; k < wanted_weight.size(); ++k)
      dw[wanted_weight[k]] = grads[k];
  };
  // NOTE [One engine call for dw]
  // Groups never share a node, so all of them can run in one engine call: the
  // masks of every joining node are applied together. One call per group
  // frees nothing earlier (the engine drops each captured gradient once its
  // node ran either way) but pays the engine's per-call setup once per group,
  // which on a GPT stage (tens of groups) cost more than the split saved.
  const size_t end = std::min(end_group, m.plan.groups.size());
  if (m.separate_dw_calls) {
    for (size_t k = first_group; k < end; ++k)
      run_groups({&m.plan.groups[k]});
  } else {
    std::vector<const DwGroup*> some;
    for (size_t k = first_group; k < end; ++k)
      some.push_back(&m.plan.groups[k]);
    if (!some.empty()) run_groups(some);
  }
  m.next_group = end;
  if (end < m.plan.groups.size()) return dw;  // a part (NOTE [dw in parts])
  m.next_group = 0;
  for (size_t w = 0; w < dw.size(); ++w) {
    if (into_grad) {  // a weight no gradient reached gets zeros, as backward_into_grad gives
      if (!m.weights[w].grad().defined())
        const_cast<torch::Tensor&>(m.weights[w]).mutable_grad() = torch::zeros_like(m.weights[w]);
      continue;
    }
    dw[w] = or_zeros(dw[w], m.weights[w]);
    accumulate_grad(m.weights[w], dw[w]);
  }
  if (!keep_graph) m.release();
  return dw;
}

Grads GradFunction::operator()(const TensorList& sens, bool keep_graph) {
  auto& m = *impl_;
  TORCH_CHECK(m.state == Impl::State::Fresh,
              m.state == Impl::State::InputDone
                  ? "compute_input_grad already ran on this GradFunction; finish with "
                    "compute_weight_grad instead of a fused backward"
                  : "this GradFunction's graph was already freed by a backward without "
                    "keep_graph; run the forward again");
  TensorList full_sens = m.resolve_sens(sens);
  std::vector<Edge> wanted = m.valid_input_edges();
  const size_t num_dx = wanted.size();
  wanted.insert(wanted.end(), m.weight_edges.begin(), m.weight_edges.end());
  variable_list grads = Engine::get_default_engine().execute(m.output_edges, full_sens, keep_graph,
                                                             /*create_graph=*/false,
                                                             /*accumulate_grad=*/false, wanted);
  Grads out;
  out.input_grads = m.finish_input_grads(variable_list(grads.begin(), grads.begin() + num_dx));
  for (size_t w = 0; w < m.weights.size(); ++w) {
    out.weight_grads.push_back(or_zeros(grads[num_dx + w], m.weights[w]));
    accumulate_grad(m.weights[w], out.weight_grads.back());
  }
  if (!keep_graph) m.release();
  return out;
}

// NOTE [Fused backward into .grad]
// operator() asks the engine for every weight's gradient as an output and
// then adds each into .grad: the first microbatch's gradients are copied,
// and every add runs after the whole backward, when the gradient is no
// longer in cache. backward() instead lets the engine's AccumulateGrad nodes
// take each gradient as it is made (the first one without a copy). Measured
// on the last stage of the peer benchmark's GPT (d_model 128, seq 64,
// microbatch 4, one thread): 31.7 ms for operator() against 29.1 ms for
// loss.backward() and 30.0 ms for backward(inputs=...) with dx. So the fused
// backward of a training step runs the engine in accumulating mode, limited
// to the input and weight edges (what backward(inputs=...) does): dx lands
// in each input's .grad, is taken from there and the .grad cleared again.
// That needs every input and weight to be a leaf with, for inputs, no .grad
// of its own (a pipeline stage's inputs are detached leaves); otherwise it
// is operator(). Same values, bit for bit: the same sums in the same order.
TensorList GradFunction::backward_into_grad(const TensorList& sens, bool keep_graph) {
  auto& m = *impl_;
  bool leaves = m.state == Impl::State::Fresh;
  for (size_t i = 0; i < m.inputs.size(); ++i)
    if (m.input_edges[i].is_valid())
      leaves = leaves && m.inputs[i].is_leaf() && !m.inputs[i].grad().defined();
  for (const auto& w : m.weights)
    leaves = leaves && w.is_leaf();
  if (!leaves) return (*this)(sens, keep_graph).input_grads;
  TensorList full_sens = m.resolve_sens(sens);
  std::vector<Edge> wanted = m.valid_input_edges();
  wanted.insert(wanted.end(), m.weight_edges.begin(), m.weight_edges.end());
  // NOTE [An unlimited engine call where limits change nothing]
  if (reaches_only(m.output_edges, wanted)) wanted.clear();
  Engine::get_default_engine().execute(m.output_edges, full_sens, keep_graph,
                                       /*create_graph=*/false, /*accumulate_grad=*/true, wanted);
  TensorList dx(m.inputs.size());
  for (size_t i = 0; i < m.inputs.size(); ++i) {
    if (!m.input_edges[i].is_valid()) continue;
    auto& slot = const_cast<torch::Tensor&>(m.inputs[i]).mutable_grad();
    dx[i] = or_zeros(slot, m.inputs[i]);
    slot = torch::Tensor();
  }
  for (const auto& w : m.weights)
    if (!w.grad().defined()) const_cast<torch::Tensor&>(w).mutable_grad() = torch::zeros_like(w);
  if (!keep_graph) m.release();
  return dx;
}

std::pair<TensorList, GradFunction> forward_and_gradfn(
    const std::function<TensorList(const TensorList&)>& fn, const TensorList& inputs,
    const ForwardAndGradOptions& options) {
  std::vector<int64_t> positions = options.grad_position().resolve(inputs.size());
  TORCH_CHECK(!positions.empty() || !options.weights().empty(),
              "no weights and no input positions: nothing to differentiate; pass "
              "ForwardAndGradOptions().weights(...) or select inputs with grad_position");
  for (size_t i = 0; i < options.weights().size(); ++i) {
    const auto& w = options.weights()[i];
    TORCH_CHECK(w.defined(), "weight ", i, " is undefined");
    TORCH_CHECK(w.requires_grad(), "weight ", i,
                " does not require grad; call requires_grad_(true) on it or drop it from weights");
  }
  TensorList fn_inputs = inputs;
  TensorList selected;
  for (int64_t p : positions) {
    const auto& x = inputs[p];
    TORCH_CHECK(x.defined(), "input ", p, " is undefined; leave it out of grad_position");
    TORCH_CHECK(x.is_floating_point() || x.is_complex(), "input ", p, " has dtype ",
                x.scalar_type(),
                ", which has no gradient; leave it out of grad_position (e.g. "
                "GradPosition::indices({...}))");
    if (!x.requires_grad()) fn_inputs[p] = x.detach().requires_grad_(true);
    selected.push_back(fn_inputs[p]);
  }
  TensorList outputs = fn(fn_inputs);
  TORCH_CHECK(!outputs.empty(), "the function returned no tensors; it must return at least one");
  TensorList differentiated = options.has_aux() ? TensorList{outputs[0]} : outputs;
  GradFunction grad_fn(std::move(differentiated), std::move(selected), options.weights());
  return {std::move(outputs), std::move(grad_fn)};
}

}  // namespace hp::autograd
