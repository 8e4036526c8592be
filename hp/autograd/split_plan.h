// The graph analysis behind the dx/dw split: walks LibTorch's backward graph
// once and decides which nodes run for dx, where each weight's branch joins
// the dx part, how weights group for dw, and what dw may prune.
#pragma once

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace hp::autograd {

using torch::autograd::Edge;
using torch::autograd::Node;

// NOTE [The dx/dw split]
// Let C ("the dx closure") be the nodes of the backward graph from which an
// input edge can be reached. A dx pass is one `Engine::execute` from the output
// edges with `outputs = input edges`: LibTorch's engine runs exactly C and asks
// every node only for the slots that lead to an input
// (`task_should_compute_output`), so it does the dx share of the work and no
// more.
//
// A weight's branch leaves C through a *joining edge*: an edge from a node
// J in C to a node outside C (or an output edge whose target is outside C, or
// an input edge whose producer leads to a weight). The gradient flowing along
// it is known once J's incoming gradients are known, which a pre-hook on J
// captures during dx. The dw pass then runs, per group, one
// `Engine::execute` rooted at the captured inputs of the group's joining nodes
// with `outputs = the group's weight edges`; the engine again runs only the
// slots that lead to those weights.
//
// Two rules keep dw exact:
//  * Pruning: while dw runs, every edge of a joining node that does not leave
//    C is masked (see NOTE [Edge masking]). Without it, a joining node that is
//    an ancestor of another (`x @ w @ w`) would push a gradient into the other
//    one, which already holds its full captured gradient: double counting.
//  * Grouping: weights whose dw subgraphs share a node (a joining node or a
//    node outside C) form one group (union-find), so a shared node runs once
//    and each group's captured gradients are freed as soon as it finishes.
//
// Nodes outside C never lead into C (such a node would reach an input, so it
// would be in C), so masking the joining nodes' inner edges is all the
// pruning there is.
//
// NOTE [Anchors]
// Some backward nodes must run in dx: a collective such as an expert layer's
// all-to-all, which every peer posts in the same order and whose wait the
// pipeline wants to hide behind compute, not leave to a W that may be deferred
// to any gap (hp/pipeline/overlap.cpp). Such a node derives from AnchorNode.
// Its next edges count as inputs: C grows by the nodes that reach an anchor,
// dx runs the anchor and returns the gradient it produces along each edge
// (SplitPlan::anchor_edges), and dw starts from those gradients (DwRoot::
// Source::Anchor) wherever the edge leads outside C to a weight. On a stage
// whose input takes a gradient the anchors are in C already and nothing
// changes; on a first stage (no input, C empty without anchors) the
// exchanges move from W into I, so W is compute only. An edge into a node
// with several input slots makes the engine run that node's other parents in
// dx too (a captured node is one to execute), for nothing: W runs them again.
// The gradients are those of plain autograd; in float32 the last bits may
// differ where a node sums its incoming gradients in another order.

/// A backward node that dx must run (NOTE [Anchors]): derive a node from it.
class AnchorNode : public Node {
 public:
  using Node::Node;
};

/// A gradient dw starts from: a node's input slot and where its value comes from.
struct DwRoot {
  enum class Source {
    Output,    ///< an output edge: its gradient is the output's sens
    Input,     ///< an input edge: its gradient is that input's dx
    Captured,  ///< an input slot of a joining node, captured by a pre-hook during dx
    Anchor,    ///< an anchor's next edge: its gradient is one dx returned (NOTE [Anchors])
  };
  Source source;
  Edge edge;  ///< (node, input slot) the gradient is fed into
  /// Output: output index; Input: input index; Captured: joining-node index;
  /// Anchor: index into SplitPlan::anchor_edges
  size_t index = 0;
};

/// One dw group: weights whose dw subgraphs touch, run by one engine call.
struct DwGroup {
  std::vector<size_t> weights;     ///< indices into the weight list
  std::vector<size_t> roots;       ///< indices into SplitPlan::roots
  std::vector<size_t> join_nodes;  ///< indices into SplitPlan::join_nodes
};

/// Everything the split needs to know about one backward graph.
struct SplitPlan {
  /// Nodes of C that have a joining edge; their incoming gradients are captured in dx.
  std::vector<std::shared_ptr<Node>> join_nodes;
  /// For each join node, which of its next edges to mask during dw (edges that stay in C).
  std::vector<std::vector<size_t>> masked_edges;
  /// Nodes of C that no dw group needs: their saved tensors can be freed after dx.
  std::vector<std::shared_ptr<Node>> dx_only_nodes;
  std::vector<DwRoot> roots;
  std::vector<DwGroup> groups;
  /// The next edges of anchor nodes (NOTE [Anchors]) that are not input edges:
  /// dx asks the engine for their gradients after the inputs'.
  std::vector<Edge> anchor_edges;
  /// Per weight: its group, or -1 when it has no path to any output (its dw is zeros).
  std::vector<int64_t> weight_group;
  size_t num_nodes = 0;     ///< nodes reachable from the outputs
  size_t num_dx_nodes = 0;  ///< |C|
};

/// Analyses the graph reachable from `output_edges`. `input_edges` and
/// `weight_edges` are the gradient edges of the inputs (dx) and weights (dw);
/// invalid edges (a tensor that does not require grad) are ignored.
SplitPlan plan_split(const std::vector<Edge>& output_edges, const std::vector<Edge>& input_edges,
                     const std::vector<Edge>& weight_edges);

}  // namespace hp::autograd
