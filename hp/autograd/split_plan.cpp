// plan_split: one walk over the backward graph (discovery, post-order,
// closures), then joining edges, union-find grouping and the dx-only set.
// See NOTE [The dx/dw split] in split_plan.h.
#include "hp/autograd/split_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace hp::autograd {
namespace {

struct EdgeKey {
  const Node* node;
  uint32_t slot;
  bool operator==(const EdgeKey& o) const { return node == o.node && slot == o.slot; }
};
struct EdgeKeyHash {
  size_t operator()(const EdgeKey& k) const {
    return std::hash<const void*>()(k.node) * 31u + k.slot;
  }
};
EdgeKey key_of(const Edge& e) {
  return {e.function.get(), e.input_nr};
}

struct UnionFind {
  std::vector<size_t> parent;
  explicit UnionFind(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  size_t find(size_t x) {
    while (parent[x] != x)
      x = parent[x] = parent[parent[x]];
    return x;
  }
  void unite(size_t a, size_t b) { parent[find(a)] = find(b); }
};

// The discovered graph: nodes by index, children by next-edge slot, post-order.
struct Graph {
  std::vector<std::shared_ptr<Node>> nodes;
  std::unordered_map<const Node*, size_t> index;
  std::vector<size_t> post_order;  // children before parents

  size_t child(size_t n, size_t slot) const {
    return index.at(nodes[n]->next_edge(slot).function.get());
  }
};

Graph discover(const std::vector<Edge>& output_edges) {
  Graph g;
  auto add = [&](const std::shared_ptr<Node>& fn) -> bool {
    if (g.index.count(fn.get())) return false;
    g.index.emplace(fn.get(), g.nodes.size());
    g.nodes.push_back(fn);
    return true;
  };
  // Iterative DFS; a frame is (node index, next slot to visit).
  std::vector<std::pair<size_t, size_t>> stack;
  for (const Edge& e : output_edges) {
    if (!e.is_valid() || !add(e.function)) continue;
    stack.emplace_back(g.nodes.size() - 1, 0);
    while (!stack.empty()) {
      auto& [n, slot] = stack.back();
      Node* node = g.nodes[n].get();
      if (slot < node->num_outputs()) {
        const Edge& next = node->next_edge(slot++);
        if (next.is_valid() && add(next.function)) stack.emplace_back(g.nodes.size() - 1, 0);
      } else {
        g.post_order.push_back(n);
        stack.pop_back();
      }
    }
  }
  return g;
}

}  // namespace

SplitPlan plan_split(const std::vector<Edge>& output_edges, const std::vector<Edge>& input_edges,
                     const std::vector<Edge>& weight_edges) {
  SplitPlan plan;
  Graph g = discover(output_edges);
  const size_t n = g.nodes.size();
  plan.num_nodes = n;

  std::unordered_set<EdgeKey, EdgeKeyHash> input_keys;
  for (const Edge& e : input_edges)
    if (e.is_valid()) input_keys.insert(key_of(e));
  // Anchors' next edges count as inputs (NOTE [Anchors] in split_plan.h).
  std::unordered_set<EdgeKey, EdgeKeyHash> dx_keys = input_keys;
  for (size_t v = 0; v < n; ++v) {
    Node* node = g.nodes[v].get();
    if (!dynamic_cast<const AnchorNode*>(node)) continue;
    for (size_t s = 0; s < node->num_outputs(); ++s) {
      const Edge& e = node->next_edge(s);
      if (e.is_valid() && dx_keys.insert(key_of(e)).second) plan.anchor_edges.push_back(e);
    }
  }
  std::vector<char> is_weight_node(n, 0);
  for (const Edge& e : weight_edges) {
    if (!e.is_valid()) continue;
    auto it = g.index.find(e.function.get());
    if (it != g.index.end()) is_weight_node[it->second] = 1;
  }

  // Closures, children first: C = reaches an input edge; L = leads to a weight.
  std::vector<char> in_c(n, 0), leads_w(n, 0);
  for (size_t v : g.post_order) {
    Node* node = g.nodes[v].get();
    leads_w[v] = is_weight_node[v];
    for (size_t s = 0; s < node->num_outputs(); ++s) {
      const Edge& e = node->next_edge(s);
      if (!e.is_valid()) continue;
      size_t c = g.index.at(e.function.get());
      if (dx_keys.count(key_of(e)) || in_c[c]) in_c[v] = 1;
      if (leads_w[c]) leads_w[v] = 1;
    }
  }

  // Joining edges, masks, dx-only nodes, and the union-find over dw subgraphs.
  UnionFind uf(n);
  std::vector<int64_t> join_index(n, -1);
  for (size_t v = 0; v < n; ++v) {
    Node* node = g.nodes[v].get();
    if (in_c[v]) {
      plan.num_dx_nodes++;
      std::vector<size_t> masked;
      bool joins = false;
      for (size_t s = 0; s < node->num_outputs(); ++s) {
        const Edge& e = node->next_edge(s);
        if (!e.is_valid()) continue;
        size_t c = g.index.at(e.function.get());
        if (!dx_keys.count(key_of(e)) && !in_c[c] && leads_w[c]) {
          joins = true;
          uf.unite(v, c);
        } else {
          masked.push_back(s);
        }
      }
      if (joins) {
        join_index[v] = static_cast<int64_t>(plan.join_nodes.size());
        plan.join_nodes.push_back(g.nodes[v]);
        plan.masked_edges.push_back(std::move(masked));
      } else {
        plan.dx_only_nodes.push_back(g.nodes[v]);
      }
    } else if (leads_w[v]) {
      for (size_t s = 0; s < node->num_outputs(); ++s) {
        const Edge& e = node->next_edge(s);
        if (!e.is_valid()) continue;
        size_t c = g.index.at(e.function.get());
        if (leads_w[c]) uf.unite(v, c);
      }
    }
  }

  // Roots of dw: outputs and inputs whose target lies outside C on a weight's
  // path, and every input slot of every joining node.
  auto outside_root = [&](const Edge& e) -> int64_t {
    if (!e.is_valid()) return -1;
    size_t t = g.index.at(e.function.get());
    return (!in_c[t] && leads_w[t]) ? static_cast<int64_t>(t) : -1;
  };
  std::vector<size_t> root_node;  // union-find representative per root
  for (size_t i = 0; i < output_edges.size(); ++i) {
    if (dx_keys.count(key_of(output_edges[i]))) continue;  // its gradient is that input's dx
    int64_t t = outside_root(output_edges[i]);
    if (t < 0) continue;
    plan.roots.push_back({DwRoot::Source::Output, output_edges[i], i});
    root_node.push_back(static_cast<size_t>(t));
  }
  for (size_t i = 0; i < input_edges.size(); ++i) {
    if (!input_edges[i].is_valid() || !g.index.count(input_edges[i].function.get())) continue;
    int64_t t = outside_root(input_edges[i]);
    if (t < 0) continue;
    plan.roots.push_back({DwRoot::Source::Input, input_edges[i], i});
    root_node.push_back(static_cast<size_t>(t));
  }
  for (size_t i = 0; i < plan.anchor_edges.size(); ++i) {
    int64_t t = outside_root(plan.anchor_edges[i]);
    if (t < 0) continue;
    plan.roots.push_back({DwRoot::Source::Anchor, plan.anchor_edges[i], i});
    root_node.push_back(static_cast<size_t>(t));
  }
  for (size_t j = 0; j < plan.join_nodes.size(); ++j) {
    const auto& fn = plan.join_nodes[j];
    size_t v = g.index.at(fn.get());
    for (uint32_t s = 0; s < fn->num_inputs(); ++s) {
      plan.roots.push_back({DwRoot::Source::Captured, Edge(fn, s), j});
      root_node.push_back(v);
    }
  }

  // Groups: components of the union-find that hold at least one weight.
  std::unordered_map<size_t, size_t> group_of_rep;
  plan.weight_group.assign(weight_edges.size(), -1);
  for (size_t w = 0; w < weight_edges.size(); ++w) {
    const Edge& e = weight_edges[w];
    if (!e.is_valid()) continue;
    auto it = g.index.find(e.function.get());
    if (it == g.index.end()) continue;  // no path from any output: dw is zeros
    TORCH_CHECK(!in_c[it->second], "weight ", w,
                " is computed from one of the differentiated inputs, so its gradient "
                "would flow into dx; pass it as an input or detach it from the input");
    size_t rep = uf.find(it->second);
    auto [g_it, inserted] = group_of_rep.emplace(rep, plan.groups.size());
    if (inserted) plan.groups.emplace_back();
    plan.groups[g_it->second].weights.push_back(w);
    plan.weight_group[w] = static_cast<int64_t>(g_it->second);
  }
  for (size_t r = 0; r < plan.roots.size(); ++r) {
    auto it = group_of_rep.find(uf.find(root_node[r]));
    if (it == group_of_rep.end()) continue;
    DwGroup& group = plan.groups[it->second];
    group.roots.push_back(r);
    const DwRoot& root = plan.roots[r];
    if (root.source == DwRoot::Source::Captured &&
        (group.join_nodes.empty() || group.join_nodes.back() != root.index))
      group.join_nodes.push_back(root.index);
  }

  // Run later layers first, as a fused backward would.
  auto latest = [&](const DwGroup& grp) {
    uint64_t best = 0;
    for (size_t r : grp.roots)
      best = std::max(best, plan.roots[r].edge.function->sequence_nr());
    return best;
  };
  std::vector<size_t> order(plan.groups.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<uint64_t> keys(plan.groups.size());
  for (size_t i = 0; i < keys.size(); ++i)
    keys[i] = latest(plan.groups[i]);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return keys[a] > keys[b]; });
  std::vector<DwGroup> sorted;
  sorted.reserve(order.size());
  std::vector<int64_t> new_index(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    new_index[order[i]] = static_cast<int64_t>(i);
    sorted.push_back(std::move(plan.groups[order[i]]));
  }
  plan.groups = std::move(sorted);
  for (auto& wg : plan.weight_group)
    if (wg >= 0) wg = new_index[wg];
  return plan;
}

}  // namespace hp::autograd
