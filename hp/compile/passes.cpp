// The graph passes (DCE, canonicalize, FSDP, auto-overlap) and PassPipeline.
#include "hp/compile/passes.h"

#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "hp/distributed/comm.h"

namespace hp::compile {

void DeadCodeElimination::run(Graph& graph, PassContext&) {
  auto& nodes = graph.nodes();
  std::unordered_set<int64_t> used;
  std::vector<bool> keep(nodes.size(), false);
  for (size_t k = nodes.size(); k-- > 0;) {
    const Node& n = nodes[k];
    bool live = n.kind == NodeKind::Placeholder || n.kind == NodeKind::Output || n.is_mutable();
    for (int64_t v : n.outputs())
      live |= used.count(v) > 0;
    if (!live) continue;
    keep[k] = true;
    for (int64_t v : n.inputs())
      used.insert(v);
  }
  std::vector<Node> out;
  for (size_t k = 0; k < nodes.size(); ++k)
    if (keep[k]) out.push_back(std::move(nodes[k]));
  nodes = std::move(out);
}

void CanonicalizeGraph::run(Graph& graph, PassContext&) {
  auto& nodes = graph.nodes();
  // 1. Pure aliases: reads of the result become reads of the input.
  std::vector<Node> kept;
  std::unordered_map<int64_t, int64_t> forward;
  for (auto& n : nodes) {
    for (const auto& [from, to] : forward)
      n.replace_input(from, to);
    if (n.kind == NodeKind::Call && (n.name == "aten::detach" || n.name == "aten::alias") &&
        n.args.size() == 1 && n.args[0].kind == Arg::Kind::Value && n.rets.size() == 1 &&
        n.rets[0].kind == Ret::Kind::Value) {
      forward[n.rets[0].values[0]] = n.args[0].values[0];
      continue;
    }
    kept.push_back(std::move(n));
  }
  nodes = std::move(kept);
  // 2. Dense ids in definition order.
  std::unordered_map<int64_t, int64_t> id;
  int64_t next = 0;
  for (auto& n : nodes) {
    for (auto& a : n.args)
      if (a.kind != Arg::Kind::Constant)
        for (auto& v : a.values)
          if (v >= 0) v = id.at(v);
    for (auto& r : n.rets)
      for (auto& v : r.values)
        if (v >= 0) {
          id[v] = next;
          v = next++;
        }
  }
  graph.set_num_values(next);
}

namespace {

Node collective(Graph& g, CollectiveKind kind, int64_t input, int64_t degree, int64_t tag) {
  Node n;
  n.kind = NodeKind::Collective;
  n.collective = kind;
  n.name = kind == CollectiveKind::AllGather       ? "all_gather"
           : kind == CollectiveKind::ReduceScatter ? "reduce_scatter"
                                                   : "all_reduce";
  n.degree = degree;
  n.tag = tag;
  n.args.push_back(Arg::make_value(input));
  n.rets.push_back(Ret::make_value(g.new_value()));
  return n;
}

Node wait_for(Graph& g, int64_t handle) {
  Node n;
  n.kind = NodeKind::Wait;
  n.name = "wait";
  n.args.push_back(Arg::make_value(handle));
  n.rets.push_back(Ret::make_value(g.new_value()));
  return n;
}

}  // namespace

// NOTE [FSDP in the graph]
// Placeholders keep standing for the live parameters, which after this pass
// are the local shards (rows [rank*n/w, (rank+1)*n/w) of dim 0), so the
// optimizer and the trainer see only shards. The compute reads the gathered
// full parameter (the wait's result) and the Output returns the local shard
// of the averaged gradient. All ranks run the same graph, so collectives are
// issued in the same order everywhere (their tags are their order).
void FSDPPass::run(Graph& graph, PassContext& ctx) {
  const int64_t world = ctx.comm ? ctx.comm->world_size() : 1;
  if (world == 1) return;
  const int64_t degree = ctx.config.fsdp_degree.value_or(world);
  TORCH_CHECK(degree == world, "FSDPPass: fsdp_degree ", degree, " but the FSDP group has ", world,
              " ranks; pass the Comm of the FSDP group itself (on a mesh: its dp slice, "
              "MeshContext::fsdp) and leave fsdp_degree unset");
  TORCH_CHECK(ctx.model, "FSDPPass: needs the live model to shard its parameters");
  const int64_t rank = ctx.comm->rank();
  std::unordered_map<std::string, at::Tensor> live;
  for (const auto& item : ctx.model->named_parameters(true))
    live[item.key()] = item.value();

  auto& nodes = graph.nodes();
  const auto ph = graph.placeholders();
  std::unordered_map<std::string, bool> planned;  // every FQN of a parameter placeholder
  std::vector<size_t> to_shard;
  for (size_t i : ph) {
    const Node& n = nodes[i];
    if (n.role != PlaceholderRole::Parameter) continue;
    bool on = !ctx.plan || ctx.plan->covers_parameter(n.name);
    if (ctx.plan && !ctx.plan->enabled()) on = false;
    for (const auto& a : n.aliases)
      on = on || (ctx.plan && ctx.plan->enabled() && ctx.plan->covers_parameter(a));
    planned[n.name] = on;
    for (const auto& a : n.aliases)
      planned[a] = on;
    if (!on) continue;
    TORCH_CHECK(!n.shape.empty() && n.shape[0] % degree == 0, "FSDPPass: parameter '", n.name,
                "' has dim 0 of size ", n.shape.empty() ? 0 : n.shape[0],
                ", not divisible by the FSDP degree ", degree,
                "; leave its module out of the PassPlan or change its size");
    to_shard.push_back(i);
  }
  int64_t tag = 0;
  // All-gathers right after the placeholders, in placeholder order.
  std::vector<Node> gathers;
  for (size_t i : to_shard) {
    Node& p = nodes[i];
    const int64_t full = p.rets[0].values[0];
    Node c = collective(graph, CollectiveKind::AllGather, full, degree, tag++);
    Node w = wait_for(graph, c.rets[0].values[0]);
    const int64_t gathered = w.rets[0].values[0];
    graph.replace_uses(full, gathered, ph.back() + 1);
    gathers.push_back(std::move(c));
    gathers.push_back(std::move(w));
    p.shape[0] /= degree;
    ctx.sharded.push_back(p.name);
    // Shard the live parameter in place (same TensorImpl, new data).
    at::Tensor t = live.at(p.name);
    torch::NoGradGuard no_grad;
    t.set_data(t.detach().chunk(degree, 0)[rank].clone());
  }
  nodes.insert(nodes.begin() + static_cast<long>(ph.back() + 1), gathers.begin(), gathers.end());
  // Gradient outputs: reduce_scatter (planned) or all_reduce (replicated).
  Node& out = graph.output();
  std::unordered_map<int64_t, int64_t> done;  // full grad value -> synced value
  std::vector<std::pair<int64_t, CollectiveKind>> todo;
  for (size_t k = 1; k < out.args.size(); ++k) {
    const int64_t v = out.args[k].values[0];
    if (done.count(v)) continue;
    done[v] = -1;
    todo.emplace_back(v, planned.at(out.output_names[k]) ? CollectiveKind::ReduceScatter
                                                         : CollectiveKind::AllReduce);
  }
  for (const auto& [v, kind] : todo) {
    // Right after the gradient's definition (the wait follows at once here;
    // AutoOverlapPass moves it).
    const size_t at = graph.def_index(v) + 1;
    Node c = collective(graph, kind, v, degree, tag++);
    Node w = wait_for(graph, c.rets[0].values[0]);
    done[v] = w.rets[0].values[0];
    nodes.insert(nodes.begin() + static_cast<long>(at), {std::move(c), std::move(w)});
  }
  Node& out2 = graph.output();
  for (size_t k = 1; k < out2.args.size(); ++k)
    out2.args[k].values[0] = done.at(out2.args[k].values[0]);
}

void AutoOverlapPass::run(Graph& graph, PassContext&) {
  auto& nodes = graph.nodes();
  std::vector<int64_t> waits;  // by result value, in order
  for (const auto& n : nodes)
    if (n.kind == NodeKind::Wait) waits.push_back(n.rets[0].values[0]);
  for (int64_t result : waits) {
    size_t i = graph.def_index(result);
    size_t first_use = i + 1;
    while (first_use < nodes.size()) {
      auto in = nodes[first_use].inputs();
      if (std::find(in.begin(), in.end(), result) != in.end()) break;
      ++first_use;
    }
    TORCH_INTERNAL_ASSERT(first_use < nodes.size(), "a wait's result is never read");
    if (first_use == i + 1) continue;
    Node w = std::move(nodes[i]);
    nodes.erase(nodes.begin() + static_cast<long>(i));
    nodes.insert(nodes.begin() + static_cast<long>(first_use - 1), std::move(w));
  }
}

PassPipeline PassPipeline::from_config(const PassConfig& config) {
  config.validate();
  PassPipeline p;
  p.add(std::make_unique<DeadCodeElimination>());
  p.add(std::make_unique<CanonicalizeGraph>());
  if (config.fsdp_enabled) p.add(std::make_unique<FSDPPass>());
  if (config.enable_overlap) p.add(std::make_unique<AutoOverlapPass>());
  return p;
}

PassPipeline& PassPipeline::add(std::unique_ptr<GraphPass> pass) {
  passes_.push_back(std::move(pass));
  return *this;
}

std::vector<std::string> PassPipeline::names() const {
  std::vector<std::string> out;
  for (const auto& p : passes_)
    out.push_back(p->name());
  return out;
}

void PassPipeline::run(Graph& graph, PassContext& ctx) const {
  for (const auto& p : passes_) {
    p->run(graph, ctx);
    graph.lint();
  }
}

}  // namespace hp::compile
