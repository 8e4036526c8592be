// The capture mechanism, all of it: a boxed fallback on a mode dispatch key
// that records every top-level ATen call of a train step (forward and autograd
// backward) into a Graph, and the placeholder/output bookkeeping around it.
#include "hp/compile/capture.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <map>
#include <tuple>
#include <unordered_map>

namespace hp::compile {

// NOTE [Capture through a mode key]
// `TESTING_ONLY_GenericMode` sits above Autograd in dispatch order. While a
// capture runs, the key is added to the thread's included set
// (IncludeDispatchKeyGuard), so every operator call on this thread, including
// those the autograd engine makes while running backward on the caller's
// thread (CPU graphs), first reaches `capture_fallback`. The fallback records
// the call (schema, arguments as values or constants), redispatches below the
// key, and records the results as new values.
//
// Which calls are "top level": a call made while another recorded call is
// running (depth > 0) is an implementation detail of it and is not recorded.
// A CompositeImplicitAutograd operator (linear, matmul, layer_norm, ...) is
// transparent instead (NOTE [Which kernel autograd runs]): it is not recorded and its children are,
// because autograd differentiates the children and saves *their* tensors for backward; recording
// the composite would leave those saved tensors (e.g. native_layer_norm's mean/rstd) unknown to the
// graph.
//
// Tensor identity: a value is found by TensorImpl first. Autograd saves an
// op's outputs as `tensor_data()` shallow copies (a new TensorImpl over the
// same storage), so a miss is looked up by (storage, offset, sizes, strides,
// dtype), then, if only the storage is known, rebuilt as an `as_strided` view
// of the latest value on that storage. A tensor known by none of these (made
// outside the capture) is baked into the graph as a constant. Every recorded
// tensor is kept alive until the capture ends so that no address is reused.
//
// Gradients: AccumulateGrad is never asked to write into a parameter's .grad
// for the graph: capture takes torch::autograd::grad of the loss (or, when
// train_fn called backward() itself, reads the recorded .grad values) and
// returns the gradients as graph outputs. The .grads are restored afterwards.

namespace {

using AliasKey = std::tuple<const void*, int64_t, std::vector<int64_t>, std::vector<int64_t>, int>;

struct Recorder {
  Graph graph;
  std::unordered_map<const c10::TensorImpl*, int64_t> by_impl;
  std::map<AliasKey, int64_t> by_alias;
  std::unordered_map<const void*, int64_t> by_storage;
  std::vector<at::Tensor> tensors;  // by value id; keeps every recorded tensor alive
  int depth = 0;

  static AliasKey key(const at::Tensor& t) {
    return AliasKey{t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.sizes().vec(),
                    t.strides().vec(), static_cast<int>(t.scalar_type())};
  }

  int64_t bind(const at::Tensor& t) {
    const int64_t id = graph.new_value();
    tensors.resize(id + 1);
    tensors[id] = t;
    by_impl[t.unsafeGetTensorImpl()] = id;
    if (t.has_storage()) {
      by_alias[key(t)] = id;
      by_storage[t.storage().unsafeGetStorageImpl()] = id;
    }
    return id;
  }

  std::optional<int64_t> lookup(const at::Tensor& t) {
    if (auto it = by_impl.find(t.unsafeGetTensorImpl()); it != by_impl.end()) return it->second;
    if (!t.has_storage()) return std::nullopt;
    if (auto it = by_alias.find(key(t)); it != by_alias.end()) {
      by_impl[t.unsafeGetTensorImpl()] = it->second;
      return it->second;
    }
    auto it = by_storage.find(t.storage().unsafeGetStorageImpl());
    if (it == by_storage.end()) return std::nullopt;
    // Recorded like any other call (we are at depth 0): a view of the base.
    at::Tensor view;
    {
      torch::NoGradGuard no_grad;
      view = at::as_strided(tensors[it->second], t.sizes(), t.strides(), t.storage_offset());
    }
    auto vid = by_impl.find(view.unsafeGetTensorImpl());
    TORCH_INTERNAL_ASSERT(vid != by_impl.end(), "capture: as_strided was not recorded");
    by_impl[t.unsafeGetTensorImpl()] = vid->second;
    return vid->second;
  }

  Arg record_arg(const c10::IValue& v) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) return Arg::make_constant(v);
      if (auto id = lookup(t)) return Arg::make_value(*id);
      return Arg::make_constant(v);
    }
    if (v.isTensorList()) {
      Arg a;
      a.kind = Arg::Kind::ValueList;
      for (const at::Tensor& t : v.toTensorVector()) {
        auto id = t.defined() ? lookup(t) : std::nullopt;
        if (!id) return Arg::make_constant(v);
        a.values.push_back(*id);
      }
      return a;
    }
    if (v.isList()) {
      auto list = v.toListRef();
      bool any_tensor = false, only_tensors_or_none = !list.empty();
      for (const auto& e : list) {
        any_tensor |= e.isTensor();
        only_tensors_or_none &= e.isTensor() || e.isNone();
      }
      if (any_tensor && only_tensors_or_none) {
        Arg a;
        a.kind = Arg::Kind::OptionalValueList;
        for (const auto& e : list) {
          if (e.isNone() || !e.toTensor().defined()) {
            a.values.push_back(-1);
            continue;
          }
          auto id = lookup(e.toTensor());
          if (!id) return Arg::make_constant(v);
          a.values.push_back(*id);
        }
        return a;
      }
    }
    return Arg::make_constant(v);
  }

  Ret record_ret(const c10::IValue& v) {
    Ret r;
    if (v.isTensor()) {
      r.kind = Ret::Kind::Value;
      r.values.push_back(v.toTensor().defined() ? bind(v.toTensor()) : -1);
    } else if (v.isTensorList()) {
      r.kind = Ret::Kind::ValueList;
      for (const at::Tensor& t : v.toTensorVector())
        r.values.push_back(bind(t));
    }
    return r;
  }
};

thread_local Recorder* t_recorder = nullptr;

// NOTE [Which kernel autograd runs]
// An operator is transparent when a CPU tensor's autograd slot runs its
// CompositeImplicitAutograd kernel. Asking hasKernelForDispatchKey is not
// enough: in LibTorch 1.13 aten::matmul and aten::linear report a kernel for
// the Autograd alias (registered for nested tensors), yet dense tensors run
// their composite kernel, and autograd saves the children's tensors (matmul's
// reshaped copy of its second operand, for bmm's backward). Recording matmul
// as one call left that copy unknown, so it was baked in as a constant and
// every later step's backward used the first batch's values. The dispatcher's
// computed table says which kernel the AutogradCPU slot really holds; it is
// read once per operator.
bool is_transparent(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<std::string, bool> cache;
  const std::string name = op.schema().name() + "." + op.schema().overload_name();
  if (auto it = cache.find(name); it != cache.end()) return it->second;
  bool transparent = false;
  const std::string table = "\n" + op.dumpComputedTable();
  const size_t at = table.find("\nAutogradCPU: ");
  if (at != std::string::npos) {
    const std::string line = table.substr(at + 1, table.find('\n', at + 1) - at - 1);
    transparent = line.find("[math kernel]") != std::string::npos;
  } else {
    transparent = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
                  !op.hasKernelForDispatchKey(c10::DispatchKey::AutogradCPU);
  }
  cache.emplace(name, transparent);
  return transparent;
}

struct DepthGuard {
  explicit DepthGuard(Recorder* r) : r_(r) { ++r_->depth; }
  ~DepthGuard() { --r_->depth; }
  Recorder* r_;
};

void capture_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack) {
  const auto below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                              c10::DispatchKey::TESTING_ONLY_GenericMode);
  Recorder* rec = t_recorder;
  if (!rec || (rec->depth == 0 && is_transparent(op))) {
    op.redispatchBoxed(below, stack);
    return;
  }
  if (rec->depth > 0) {
    DepthGuard g(rec);
    op.redispatchBoxed(below, stack);
    return;
  }
  const auto& schema = op.schema();
  Node node;
  node.kind = NodeKind::Call;
  node.name = schema.name();
  node.overload = schema.overload_name();
  node.op = op;
  const size_t nargs = schema.arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nargs);
  for (size_t i = stack->size() - nargs; i < stack->size(); ++i)
    node.args.push_back(rec->record_arg((*stack)[i]));
  {
    DepthGuard g(rec);
    op.redispatchBoxed(below, stack);
  }
  const size_t nrets = schema.returns().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nrets);
  for (size_t i = stack->size() - nrets; i < stack->size(); ++i)
    node.rets.push_back(rec->record_ret((*stack)[i]));
  rec->graph.nodes().push_back(std::move(node));
}

Node placeholder(const std::string& name, PlaceholderRole role, const at::Tensor& t) {
  Node n;
  n.kind = NodeKind::Placeholder;
  n.name = name;
  n.role = role;
  n.shape = t.sizes().vec();
  n.dtype = t.scalar_type();
  return n;
}

struct RecorderScope {
  explicit RecorderScope(Recorder* r) : guard(c10::DispatchKey::TESTING_ONLY_GenericMode) {
    TORCH_CHECK(t_recorder == nullptr,
                "capture_train_step: a capture is already running on this thread (train_fn "
                "must not capture again)");
    t_recorder = r;
  }
  ~RecorderScope() { t_recorder = nullptr; }
  c10::impl::IncludeDispatchKeyGuard guard;
};

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&capture_fallback>());
}

Graph capture_train_step(torch::nn::Module& model, const TrainFn& train_fn, const at::Tensor& input,
                         const at::Tensor& label) {
  TORCH_CHECK(train_fn, "capture_train_step: train_fn is empty");
  TORCH_CHECK(input.defined() && label.defined(),
              "capture_train_step: input and label must be defined tensors");
  Recorder rec;
  // Parameters (one placeholder per distinct tensor), then buffers, then inputs.
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    params.emplace_back(item.key(), item.value());
  std::vector<at::Tensor> unique;
  std::unordered_map<const c10::TensorImpl*, size_t> node_of;  // impl -> node index
  for (const auto& [fqn, p] : params) {
    auto it = node_of.find(p.unsafeGetTensorImpl());
    if (it != node_of.end()) {
      rec.graph.nodes()[it->second].aliases.push_back(fqn);
      continue;
    }
    Node n = placeholder(fqn, PlaceholderRole::Parameter, p);
    n.rets.push_back(Ret::make_value(rec.bind(p)));
    node_of[p.unsafeGetTensorImpl()] = rec.graph.nodes().size();
    rec.graph.nodes().push_back(std::move(n));
    unique.push_back(p);
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (!item.value().defined() || rec.by_impl.count(item.value().unsafeGetTensorImpl())) continue;
    Node n = placeholder(item.key(), PlaceholderRole::Buffer, item.value());
    n.rets.push_back(Ret::make_value(rec.bind(item.value())));
    rec.graph.nodes().push_back(std::move(n));
  }
  for (const auto& [name, t] :
       {std::pair<std::string, at::Tensor>{"input", input}, {"label", label}}) {
    Node n = placeholder(name, PlaceholderRole::Input, t);
    n.rets.push_back(Ret::make_value(rec.bind(t)));
    rec.graph.nodes().push_back(std::move(n));
  }

  // The .grads are the user's; capture must not leave its own in them.
  std::vector<at::Tensor> saved_grads;
  for (auto& p : unique) {
    saved_grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  std::vector<int64_t> grad_ids(unique.size(), -1);
  int64_t loss_id = -1;
  try {
    RecorderScope scope(&rec);
    at::Tensor loss = train_fn(model, input, label);
    TORCH_CHECK(loss.defined() && loss.numel() == 1,
                "capture_train_step: train_fn must return the scalar loss, got ",
                loss.defined() ? "a tensor of shape " + c10::str(loss.sizes()) : "undefined");
    auto lid = rec.lookup(loss);
    TORCH_CHECK(lid,
                "capture_train_step: the loss was not computed by ATen operators on this "
                "thread during train_fn (was it made outside the capture?)");
    loss_id = *lid;
    bool user_backward = false;
    for (const auto& p : unique)
      user_backward |= p.grad().defined();
    std::vector<at::Tensor> grads(unique.size());
    if (user_backward) {
      for (size_t i = 0; i < unique.size(); ++i)
        grads[i] = unique[i].grad();
    } else {
      TORCH_CHECK(loss.requires_grad(),
                  "capture_train_step: the loss does not require grad; does the model have "
                  "trainable parameters that the loss depends on?");
      std::vector<at::Tensor> wrt;
      std::vector<size_t> where;
      for (size_t i = 0; i < unique.size(); ++i)
        if (unique[i].requires_grad()) {
          wrt.push_back(unique[i]);
          where.push_back(i);
        }
      auto g = torch::autograd::grad({loss}, wrt, {}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < where.size(); ++j)
        grads[where[j]] = g[j];
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < unique.size(); ++i) {
      if (!grads[i].defined()) grads[i] = at::zeros_like(unique[i]);  // recorded
      auto gid = rec.lookup(grads[i]);
      TORCH_INTERNAL_ASSERT(gid, "capture: the gradient of ", params[i].first, " is unknown");
      grad_ids[i] = *gid;
    }
  } catch (...) {
    for (size_t i = 0; i < unique.size(); ++i)
      unique[i].mutable_grad() = saved_grads[i];
    throw;
  }
  for (size_t i = 0; i < unique.size(); ++i)
    unique[i].mutable_grad() = saved_grads[i];

  Node out;
  out.kind = NodeKind::Output;
  out.args.push_back(Arg::make_value(loss_id));
  out.output_names.push_back("loss");
  std::unordered_map<const c10::TensorImpl*, size_t> unique_index;
  for (size_t i = 0; i < unique.size(); ++i)
    unique_index[unique[i].unsafeGetTensorImpl()] = i;
  for (const auto& [fqn, p] : params) {
    out.args.push_back(Arg::make_value(grad_ids[unique_index.at(p.unsafeGetTensorImpl())]));
    out.output_names.push_back(fqn);
  }
  rec.graph.nodes().push_back(std::move(out));
  rec.graph.lint();
  return std::move(rec.graph);
}

std::vector<at::Tensor> placeholder_values(const Graph& graph, torch::nn::Module& model,
                                           const at::Tensor& input, const at::Tensor& label) {
  std::unordered_map<std::string, at::Tensor> state;
  for (const auto& item : model.named_parameters(true))
    state[item.key()] = item.value();
  for (const auto& item : model.named_buffers(true))
    state[item.key()] = item.value();
  std::vector<at::Tensor> out;
  for (size_t i : graph.placeholders()) {
    const Node& n = graph.nodes()[i];
    if (n.role == PlaceholderRole::Input) {
      out.push_back(n.name == "input" ? input : label);
      continue;
    }
    auto it = state.find(n.name);
    TORCH_CHECK(it != state.end(), "graph placeholder '", n.name,
                "' names no parameter or buffer of this model; was the graph captured from "
                "another model?");
    out.push_back(it->second);
  }
  return out;
}

}  // namespace hp::compile
