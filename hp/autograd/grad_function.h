// The dx/dw split of any backward: `forward_and_gradfn` runs a function and
// returns its outputs with a `GradFunction`, whose dx (compute_input_grad) and
// dw (compute_weight_grad) run at different times on LibTorch's own engine.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace hp::autograd {

using TensorList = std::vector<torch::Tensor>;

/// Which inputs of `forward_and_gradfn` get a gradient (dx): all, none, or a list.
class GradPosition {
 public:
  /// Every input (the default).
  static GradPosition all() { return GradPosition(Kind::All, {}); }
  /// No input: only weights are differentiated.
  static GradPosition none() { return GradPosition(Kind::None, {}); }
  /// The inputs at these indices, in this order.
  static GradPosition indices(std::vector<int64_t> positions) {
    return GradPosition(Kind::List, std::move(positions));
  }
  /// The selected indices for `num_inputs` inputs; checks range and duplicates.
  std::vector<int64_t> resolve(size_t num_inputs) const;

 private:
  enum class Kind { All, None, List };
  GradPosition(Kind kind, std::vector<int64_t> positions)
      : kind_(kind), positions_(std::move(positions)) {}
  Kind kind_;
  std::vector<int64_t> positions_;
};

/// Options of `forward_and_gradfn`.
struct ForwardAndGradOptions {
  /// The tensors differentiated as weights (e.g. a module's parameters).
  TORCH_ARG(TensorList, weights) = {};
  /// Which inputs get dx; default all.
  TORCH_ARG(GradPosition, grad_position) = GradPosition::all();
  /// Only output 0 is differentiated; the others are returned as they are.
  TORCH_ARG(bool, has_aux) = false;
};

/// dx and dw of one fused backward (`GradFunction::operator()`).
struct Grads {
  TensorList input_grads;   ///< one per selected input, in order
  TensorList weight_grads;  ///< one per weight, in order
};

/// What the graph analysis found (for tests, benchmarks and the curious).
struct SplitStats {
  size_t num_nodes = 0;       ///< backward nodes reachable from the outputs
  size_t num_dx_nodes = 0;    ///< nodes that lead to an input (run by dx)
  size_t num_join_nodes = 0;  ///< dx nodes where a weight's branch joins
  size_t num_groups = 0;      ///< weight groups (engine calls dw makes with separate_dw_calls)
};

/// The backward of one forward, split into dx and dw.
///
/// Order: `compute_input_grad` once, then `compute_weight_grad` (again only with
/// `keep_graph = true`). `operator()` instead runs both in one fused backward.
/// dx + dw do the work of one fused backward: each node computes each of its
/// output gradients exactly once (see NOTE [The dx/dw split]).
class GradFunction {
 public:
  /// From an already-run forward: differentiate `outputs` with respect to
  /// `inputs` (dx) and `weights` (dw). Each must require grad; inputs that are
  /// undefined tensors are skipped (their dx is undefined).
  GradFunction(TensorList outputs, TensorList inputs, TensorList weights);

  /// dx for the inputs, in order. `sens` are the output gradients (default:
  /// ones). Captures what dw needs and frees what only dx needed.
  TensorList compute_input_grad(const TensorList& sens = {});

  /// dw, one per weight, also accumulated into each weight's `.grad()` as
  /// `backward()` does. A weight with no path to the outputs gets zeros. With
  /// `keep_graph` it may be called again (and `.grad()` accumulates again).
  TensorList compute_weight_grad(bool keep_graph = false);

  /// compute_weight_grad for a training step: dw goes only into `.grad()`,
  /// through the engine's own accumulation as `backward()` does, and is not
  /// returned (NOTE [dw into .grad]).
  void weight_grad_into_grad(bool keep_graph = false);

  /// weight_grad_into_grad in parts (NOTE [dw in parts]): runs the next of
  /// about `parts` equal shares of the weight groups; true once dw is
  /// complete (the graph is then freed). Values equal a whole dw's;
  /// weight_grad_into_grad after a part runs the rest.
  bool weight_grad_part_into_grad(int parts);

  /// dx and dw in one fused backward (no split), for comparison and for stages
  /// that do not split. Accumulates dw into `.grad()` too.
  Grads operator()(const TensorList& sens = {}, bool keep_graph = false);

  /// The fused backward of a training step: dx as operator() returns it; dw
  /// goes only into `.grad()` (a weight with no path to the outputs gets zeros
  /// there too), through the engine's own accumulation as `backward()` does,
  /// and is not returned (NOTE [Fused backward into .grad]).
  TensorList backward_into_grad(const TensorList& sens = {}, bool keep_graph = false);

  /// Runs dw as one engine call per weight group instead of one call for all
  /// (NOTE [One engine call for dw]); results are identical. Default off.
  GradFunction& separate_dw_calls(bool on);

  size_t num_inputs() const;
  size_t num_weights() const;
  /// Filled by compute_input_grad (the analysis runs there, not at construction).
  SplitStats stats() const;

 private:
  // From the first group not run yet (NOTE [dw in parts]) to end_group.
  TensorList run_weight_grad(bool keep_graph, bool into_grad, size_t end_group = SIZE_MAX);

  struct Impl;
  std::shared_ptr<Impl> impl_;
};

/// Runs `fn(inputs)` recording the graph and returns its outputs with the
/// GradFunction of that forward. Selected inputs that do not require grad are
/// fed to `fn` as fresh leaves that do (dx is the gradient with respect to them).
std::pair<TensorList, GradFunction> forward_and_gradfn(
    const std::function<TensorList(const TensorList&)>& fn, const TensorList& inputs,
    const ForwardAndGradOptions& options = {});

}  // namespace hp::autograd
