// Graph passes: the `GraphPass` interface, `PassPipeline` (DeadCodeElimination
// -> CanonicalizeGraph -> [FSDPPass] -> [AutoOverlapPass], chosen by
// PassConfig) and the four passes.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/compile/graph.h"
#include "hp/compile/pass_config.h"

namespace hp::distributed {
class Comm;
}

namespace hp::compile {

/// What passes may read and touch besides the graph.
struct PassContext {
  /// The live model (FSDPPass shards its parameters in place).
  torch::nn::Module* model = nullptr;
  /// The FSDP group (on a mesh: this rank's dp slice, a subgroup of the
  /// world); null or world size 1: no FSDP.
  hp::distributed::Comm* comm = nullptr;
  /// Which modules FSDP shards; null shards every parameter.
  const PassPlan* plan = nullptr;
  PassConfig config;
  /// Filled by FSDPPass: the FQNs (first name of each tensor) it sharded.
  std::vector<std::string> sharded;
};

/// One graph-to-graph transformation.
class GraphPass {
 public:
  virtual ~GraphPass() = default;
  /// A stable name ("dce", "canonicalize", "fsdp", "auto_overlap").
  virtual std::string name() const = 0;
  /// Rewrites `graph` in place; the result must pass Graph::lint().
  virtual void run(Graph& graph, PassContext& ctx) = 0;
};

/// Removes calls, collectives and waits whose results nothing reads (calls
/// that mutate an argument stay, see NOTE [Graph values]).
class DeadCodeElimination : public GraphPass {
 public:
  std::string name() const override { return "dce"; }
  void run(Graph& graph, PassContext& ctx) override;
};

/// Drops pure aliases (aten::detach, aten::alias: the same values without
/// autograd) and renumbers values densely in definition order.
class CanonicalizeGraph : public GraphPass {
 public:
  std::string name() const override { return "canonicalize"; }
  void run(Graph& graph, PassContext& ctx) override;
};

/// FSDP over the FSDP group's ranks (PassContext::comm, whose world size the
/// degree must equal): each planned parameter placeholder becomes its
/// dim-0 shard followed by an all_gather (Shard -> Replicate) and a wait; its
/// gradient output becomes a reduce_scatter (averaged) of the full gradient.
/// Unplanned parameters stay replicated and their gradients are all_reduced
/// (averaged: data parallel). The live model's planned parameters are
/// replaced in place by their local shards. No-op on a world of one rank.
class FSDPPass : public GraphPass {
 public:
  std::string name() const override { return "fsdp"; }
  void run(Graph& graph, PassContext& ctx) override;
};

/// Moves every wait to just before the first node that reads its result, so
/// the collective overlaps the independent compute in between.
class AutoOverlapPass : public GraphPass {
 public:
  std::string name() const override { return "auto_overlap"; }
  void run(Graph& graph, PassContext& ctx) override;
};

/// An ordered list of passes.
class PassPipeline {
 public:
  /// DeadCodeElimination -> CanonicalizeGraph -> [FSDPPass if fsdp_enabled]
  /// -> [AutoOverlapPass if enable_overlap]. Validates the config.
  static PassPipeline from_config(const PassConfig& config);
  /// Appends a pass.
  PassPipeline& add(std::unique_ptr<GraphPass> pass);
  /// The passes' names, in order.
  std::vector<std::string> names() const;
  /// Runs every pass in order, linting the graph after each.
  void run(Graph& graph, PassContext& ctx) const;

 private:
  std::vector<std::shared_ptr<GraphPass>> passes_;
};

}  // namespace hp::compile
