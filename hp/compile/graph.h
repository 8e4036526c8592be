// hp/compile's IR: `Graph`, a list of nodes in execution order (placeholders,
// ATen operator calls by schema name, collectives and their waits, one output),
// over SSA values; its printer and checker; and `replay`, which runs it through
// c10::Dispatcher boxed calls under NoGradGuard.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hp::distributed {
class Comm;
}

namespace hp::compile {

// NOTE [Graph values]
// Every node defines fresh value ids (ints) and reads ids defined by earlier
// nodes: the graph is SSA even for in-place ATen ops (an in-place op's result
// gets a new id; at replay it is the same tensor as its mutated input). Passes
// may therefore reason on def-use chains, with one caveat: a Call whose schema
// is mutable (`Tensor(a!)`) has effects beyond its results, so DCE keeps it and
// no pass reorders Calls among themselves. Only Wait nodes move.

/// What a node is.
enum class NodeKind { Placeholder, Call, Collective, Wait, Output };
/// What a placeholder stands for.
enum class PlaceholderRole { Parameter, Buffer, Input };
/// The collectives a Collective node can issue (over the replay's Comm).
enum class CollectiveKind { AllGather, ReduceScatter, AllReduce };

/// One boxed argument of a node: a constant IValue, a value, or a list of
/// values (`Tensor[]`, or `Tensor?[]` where -1 is None).
struct Arg {
  enum class Kind { Constant, Value, ValueList, OptionalValueList };
  Kind kind = Kind::Constant;
  c10::IValue constant;
  std::vector<int64_t> values;

  static Arg make_constant(c10::IValue v);
  static Arg make_value(int64_t id);
};

/// One returned IValue of a node: a tensor value, a list of tensor values, or
/// something the graph does not track (an int, an undefined tensor: id -1).
struct Ret {
  enum class Kind { Value, ValueList, Ignored };
  Kind kind = Kind::Ignored;
  std::vector<int64_t> values;

  static Ret make_value(int64_t id);
};

/// One step of the graph.
struct Node {
  NodeKind kind = NodeKind::Call;
  /// Placeholder: its FQN ("layers.0.weight") or input name ("input", "label").
  /// Call: the operator's schema name ("aten::mm"). Collective: "all_gather", ...
  std::string name;
  /// Call: the schema overload ("" for the default one, "Tensor", "out", ...).
  std::string overload;
  /// Call: the operator, resolved once.
  std::optional<c10::OperatorHandle> op;
  /// Placeholder: what it stands for, its other FQNs (a parameter shared
  /// under several names) and the shape and dtype replay insists on.
  PlaceholderRole role = PlaceholderRole::Input;
  std::vector<std::string> aliases;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  /// Collective: which one, over how many ranks, and its number among the
  /// graph's collectives (they are issued in that order on every rank).
  CollectiveKind collective = CollectiveKind::AllGather;
  int64_t degree = 1;
  int64_t tag = 0;
  /// Output: one name per returned value ("loss", then parameter FQNs).
  std::vector<std::string> output_names;

  std::vector<Arg> args;
  std::vector<Ret> rets;

  /// Every value id this node reads (in argument order, with repeats).
  std::vector<int64_t> inputs() const;
  /// Every value id this node defines (-1s left out).
  std::vector<int64_t> outputs() const;
  /// Replaces reads of `from` by `to`; returns how many it replaced.
  int replace_input(int64_t from, int64_t to);
  /// True for a Call whose schema mutates an argument.
  bool is_mutable() const;
  /// The one-line text form used by Graph::str().
  std::string str() const;
};

/// A captured train step: placeholders first (parameters, buffers, then
/// inputs), then calls, collectives and waits, and last one Output node that
/// returns the loss then one gradient per parameter FQN.
class Graph {
 public:
  std::vector<Node>& nodes() { return nodes_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  /// A fresh value id.
  int64_t new_value() { return num_values_++; }
  /// One more than the largest value id in use.
  int64_t num_values() const { return num_values_; }
  void set_num_values(int64_t n) { num_values_ = n; }

  /// Indices of the placeholders, in order.
  std::vector<size_t> placeholders() const;
  /// The Output node (the last node).
  const Node& output() const;
  Node& output();
  /// Index of the node defining `value` (throws when none does).
  size_t def_index(int64_t value) const;
  /// Replaces reads of `from` by `to` in nodes [start, end).
  void replace_uses(int64_t from, int64_t to, size_t start = 0);
  /// Counts Call nodes named `name` (e.g. "aten::mm").
  int64_t count_calls(const std::string& name) const;
  /// Indices of nodes of `kind`, in order.
  std::vector<size_t> find(NodeKind kind) const;

  /// Throws (TORCH_CHECK) unless: placeholders come first, one Output comes
  /// last, every read value was defined earlier, no value is defined twice.
  void lint() const;
  /// The readable text form, one node per line.
  std::string str() const;

 private:
  std::vector<Node> nodes_;
  int64_t num_values_ = 0;
};

/// Where one replay spent its time, node by node (seconds from the start of
/// the replay). A collective is "in flight" from the moment it is posted to
/// the end of its wait; the time the replay spent blocked is the wait's own span.
struct ReplayTrace {
  struct Span {
    size_t node = 0;  ///< index into Graph::nodes()
    double start = 0, end = 0;
  };
  std::vector<Span> calls;      ///< every Call node
  std::vector<Span> in_flight;  ///< every Collective: issue .. its wait's end
  std::vector<Span> waits;      ///< every Wait node
  double total = 0;             ///< the whole replay

  /// Seconds spent in operator calls / blocked in waits / with at least one
  /// collective in flight (the union of the in-flight spans).
  double call_seconds() const;
  double wait_seconds() const;
  double in_flight_seconds() const;
  /// Share of the collectives' in-flight time the replay did not block on
  /// (1: fully overlapped with compute; 0: every transfer waited for; 1 when
  /// there were none).
  double hidden_comm_fraction() const;
};

/// Runs `graph` on `placeholders` (one tensor per placeholder, in order;
/// shapes and dtypes must be the captured ones) under NoGradGuard and returns
/// the Output's tensors. `comm` is needed only when the graph has collectives.
/// With `trace`, records the time of every call, collective and wait.
std::vector<at::Tensor> replay(const Graph& graph, const std::vector<at::Tensor>& placeholders,
                               hp::distributed::Comm* comm = nullptr, ReplayTrace* trace = nullptr);

}  // namespace hp::compile
