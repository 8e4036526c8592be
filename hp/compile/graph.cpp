// The IR's helpers (def-use queries, lint, printing) and `replay`: boxed
// dispatcher calls under NoGradGuard, collectives through Comm's asynchronous ones.
#include "hp/compile/graph.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "hp/distributed/comm.h"

namespace hp::compile {

Arg Arg::make_constant(c10::IValue v) {
  Arg a;
  a.kind = Kind::Constant;
  a.constant = std::move(v);
  return a;
}

Arg Arg::make_value(int64_t id) {
  Arg a;
  a.kind = Kind::Value;
  a.values = {id};
  return a;
}

Ret Ret::make_value(int64_t id) {
  Ret r;
  r.kind = Kind::Value;
  r.values = {id};
  return r;
}

std::vector<int64_t> Node::inputs() const {
  std::vector<int64_t> out;
  for (const auto& a : args)
    if (a.kind != Arg::Kind::Constant)
      for (int64_t v : a.values)
        if (v >= 0) out.push_back(v);
  return out;
}

std::vector<int64_t> Node::outputs() const {
  std::vector<int64_t> out;
  for (const auto& r : rets)
    for (int64_t v : r.values)
      if (v >= 0) out.push_back(v);
  return out;
}

int Node::replace_input(int64_t from, int64_t to) {
  int n = 0;
  for (auto& a : args)
    if (a.kind != Arg::Kind::Constant)
      for (auto& v : a.values)
        if (v == from) {
          v = to;
          ++n;
        }
  return n;
}

bool Node::is_mutable() const {
  return kind == NodeKind::Call && op && op->schema().is_mutable();
}

namespace {

const char* role_name(PlaceholderRole r) {
  switch (r) {
    case PlaceholderRole::Parameter:
      return "param";
    case PlaceholderRole::Buffer:
      return "buffer";
    case PlaceholderRole::Input:
      return "input";
  }
  return "?";
}

const char* collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllReduce:
      return "all_reduce";
  }
  return "?";
}

std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i)
    os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

void print_constant(std::ostream& os, const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (!t.defined())
      os << "undefined";
    else
      os << "const " << c10::toString(t.scalar_type()) << shape_str(t.sizes());
  } else if (v.isNone()) {
    os << "None";
  } else {
    os << v;
  }
}

std::string ids(const std::vector<int64_t>& vs) {
  std::ostringstream os;
  for (size_t i = 0; i < vs.size(); ++i)
    os << (i ? ", " : "") << (vs[i] < 0 ? std::string("None") : "%" + std::to_string(vs[i]));
  return os.str();
}

}  // namespace

std::string Node::str() const {
  std::ostringstream os;
  auto rets_str = [&] {
    std::vector<std::string> parts;
    for (const auto& r : rets) {
      if (r.kind == Ret::Kind::Value)
        parts.push_back(r.values[0] < 0 ? "_" : "%" + std::to_string(r.values[0]));
      else if (r.kind == Ret::Kind::ValueList)
        parts.push_back("[" + ids(r.values) + "]");
      else
        parts.push_back("_");
    }
    std::string s;
    for (size_t i = 0; i < parts.size(); ++i)
      s += (i ? ", " : "") + parts[i];
    return s;
  };
  auto args_str = [&] {
    std::ostringstream a;
    for (size_t i = 0; i < args.size(); ++i) {
      a << (i ? ", " : "");
      const auto& arg = args[i];
      if (arg.kind == Arg::Kind::Constant)
        print_constant(a, arg.constant);
      else if (arg.kind == Arg::Kind::Value)
        a << "%" << arg.values[0];
      else
        a << "[" << ids(arg.values) << "]";
    }
    return a.str();
  };
  switch (kind) {
    case NodeKind::Placeholder:
      os << rets_str() << " = placeholder[" << role_name(role) << "] " << name << " "
         << c10::toString(dtype) << shape_str(shape);
      for (const auto& a : aliases)
        os << " (also " << a << ")";
      break;
    case NodeKind::Call:
      os << rets_str() << " = " << name << (overload.empty() ? "" : "." + overload) << "("
         << args_str() << ")";
      break;
    case NodeKind::Collective:
      os << rets_str() << " = " << collective_name(collective) << "[degree=" << degree
         << ", tag=" << tag << "](" << args_str() << ")";
      break;
    case NodeKind::Wait:
      os << rets_str() << " = wait(" << args_str() << ")";
      break;
    case NodeKind::Output: {
      os << "return (";
      auto in = inputs();
      for (size_t i = 0; i < in.size(); ++i)
        os << (i ? ", " : "") << (i < output_names.size() ? output_names[i] : "?") << "=%" << in[i];
      os << ")";
      break;
    }
  }
  return os.str();
}

std::vector<size_t> Graph::placeholders() const {
  return find(NodeKind::Placeholder);
}

std::vector<size_t> Graph::find(NodeKind kind) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i].kind == kind) out.push_back(i);
  return out;
}

const Node& Graph::output() const {
  TORCH_CHECK(!nodes_.empty() && nodes_.back().kind == NodeKind::Output,
              "graph has no Output node as its last node");
  return nodes_.back();
}

Node& Graph::output() {
  return const_cast<Node&>(static_cast<const Graph*>(this)->output());
}

size_t Graph::def_index(int64_t value) const {
  for (size_t i = 0; i < nodes_.size(); ++i)
    for (int64_t v : nodes_[i].outputs())
      if (v == value) return i;
  TORCH_CHECK(false, "graph: no node defines %", value);
}

void Graph::replace_uses(int64_t from, int64_t to, size_t start) {
  for (size_t i = start; i < nodes_.size(); ++i)
    nodes_[i].replace_input(from, to);
}

int64_t Graph::count_calls(const std::string& name) const {
  int64_t n = 0;
  for (const auto& node : nodes_)
    if (node.kind == NodeKind::Call && node.name == name) ++n;
  return n;
}

void Graph::lint() const {
  std::unordered_set<int64_t> defined;
  bool past_placeholders = false;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (n.kind != NodeKind::Placeholder) past_placeholders = true;
    TORCH_CHECK(n.kind != NodeKind::Placeholder || !past_placeholders, "graph lint: node ", i,
                " is a placeholder after non-placeholder nodes");
    TORCH_CHECK((n.kind == NodeKind::Output) == (i + 1 == nodes_.size()), "graph lint: node ", i,
                (n.kind == NodeKind::Output ? " is an Output before the end"
                                            : " is last but not an Output"));
    for (int64_t v : n.inputs())
      TORCH_CHECK(defined.count(v), "graph lint: node ", i, " (", n.str(), ") reads %", v,
                  " before any node defines it");
    for (int64_t v : n.outputs()) {
      TORCH_CHECK(v < num_values_, "graph lint: node ", i, " defines %", v, " beyond num_values ",
                  num_values_);
      TORCH_CHECK(defined.insert(v).second, "graph lint: %", v, " is defined twice (node ", i, ")");
    }
  }
}

std::string Graph::str() const {
  std::ostringstream os;
  os << "graph(" << num_values_ << " values):\n";
  for (const auto& n : nodes_)
    os << "  " << n.str() << "\n";
  return os.str();
}

// ---------------------------------------------------------------------------
// Replay

namespace {

// NOTE [Collectives at replay]
// A Collective node starts its operation on the Comm (Comm's asynchronous
// collectives: a direct exchange with every other rank, the reduction in
// rank order so every rank adds in the same order) and returns at once; its
// Wait completes it. This is what lets a wait move away from its collective
// (AutoOverlapPass). Bytes moved per rank: all_gather and reduce_scatter
// (w-1)/w of the full tensor, as a ring would; all_reduce (w-1) times the
// tensor (fine for the small replicated parameters it serves). Reductions
// are averages: data-parallel gradients are means over the ranks' batches.
// The Comm is the FSDP group (on a mesh, the rank's dp slice: a subgroup of
// the world) and a collective's degree must be its world size.
struct Pending {
  hp::distributed::Work work;
  at::Tensor result;
  at::Tensor input;  // alive until the wait, whatever the graph still reads
};

Pending issue(const Node& n, const at::Tensor& in_raw, hp::distributed::Comm* comm) {
  TORCH_CHECK(comm, "graph replay: the graph has a ", n.name,
              " collective but no Comm was given; pass the Comm of the FSDP group");
  const int64_t w = comm->world_size();
  TORCH_CHECK(n.degree == w, "graph replay: collective of degree ", n.degree,
              " on a Comm of world size ", w,
              "; pass the Comm of the FSDP group the graph was compiled for (on a mesh: its dp "
              "slice, not the world)");
  at::Tensor in = in_raw.contiguous();
  using hp::distributed::ReduceOp;
  Pending p;
  p.input = in;
  switch (n.collective) {
    case CollectiveKind::AllGather: {
      std::vector<int64_t> shape = in.sizes().vec();
      TORCH_CHECK(!shape.empty(), "all_gather needs a tensor with at least one dimension");
      shape[0] *= w;
      p.result = at::empty(shape, in.options());
      p.work = comm->all_gather_async(p.result, in);
      break;
    }
    case CollectiveKind::ReduceScatter: {
      TORCH_CHECK(in.dim() >= 1 && in.size(0) % w == 0, "reduce_scatter: dim 0 (", in.size(0),
                  ") must divide by the degree ", w);
      p.result = at::empty_like(in.narrow(0, 0, in.size(0) / w));
      p.work = comm->reduce_scatter_async(p.result, in, ReduceOp::Avg);
      break;
    }
    case CollectiveKind::AllReduce: {
      p.result = in.clone();
      p.work = comm->all_reduce_async(p.result, ReduceOp::Avg);
      break;
    }
  }
  return p;
}

at::Tensor finish(Pending& p) {
  p.work.wait();
  return p.result;
}

}  // namespace

namespace {

double span_sum(const std::vector<ReplayTrace::Span>& spans) {
  double s = 0;
  for (const auto& x : spans)
    s += x.end - x.start;
  return s;
}

}  // namespace

double ReplayTrace::call_seconds() const {
  return span_sum(calls);
}
double ReplayTrace::wait_seconds() const {
  return span_sum(waits);
}
double ReplayTrace::in_flight_seconds() const {
  // The union of the intervals: collectives in flight together count once.
  std::vector<std::pair<double, double>> iv;
  for (const auto& x : in_flight)
    iv.emplace_back(x.start, x.end);
  std::sort(iv.begin(), iv.end());
  double total = 0, start = 0, end = -1;
  for (const auto& [a, b] : iv) {
    if (a > end) {
      if (end > start) total += end - start;
      start = a;
      end = b;
    } else {
      end = std::max(end, b);
    }
  }
  if (end > start) total += end - start;
  return total;
}

double ReplayTrace::hidden_comm_fraction() const {
  const double flight = in_flight_seconds();
  return flight > 0 ? std::max(0.0, 1.0 - wait_seconds() / flight) : 1.0;
}

std::vector<at::Tensor> replay(const Graph& graph, const std::vector<at::Tensor>& placeholders,
                               hp::distributed::Comm* comm, ReplayTrace* trace) {
  // NOTE [Replay below autograd]
  // The graph already holds the backward, so nothing of autograd is needed:
  // dispatch starts below the Autograd and ADInplaceOrView keys, which skips
  // two kernel hops per operator (and the autograd kernels' bookkeeping that
  // NoGradGuard alone still pays).
  torch::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto now = [&t0] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  if (trace) *trace = ReplayTrace{};
  std::unordered_map<int64_t, size_t> flight_of;  // collective value -> in_flight index
  double started = 0;
  std::vector<at::Tensor> env(graph.num_values());
  // NOTE [Values die at their last use]
  // The replay drops its reference to a value right after the last node that
  // reads it (a value nothing reads: right after its definition), as eager
  // execution frees what autograd no longer saves. The peak memory of a step
  // is then the graph's live set, not every value it ever made: what lets a
  // graph captured with checkpointed blocks (their forward's activations read
  // by nothing after the forward, their backward reading the recomputed ones)
  // hold less than one without.
  const auto& nodes = graph.nodes();
  constexpr size_t kNever = static_cast<size_t>(-1);
  std::vector<size_t> last_use(graph.num_values(), kNever);
  for (size_t i = 0; i < nodes.size(); ++i)
    for (const Arg& a : nodes[i].args)
      if (a.kind != Arg::Kind::Constant)
        for (int64_t v : a.values)
          if (v >= 0) last_use[v] = i;
  // Values to drop after node i: free[free_at[i] .. free_at[i + 1]).
  std::vector<int64_t> free;
  std::vector<size_t> free_at{0};
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const Arg& a : nodes[i].args)
      if (a.kind != Arg::Kind::Constant)
        for (int64_t v : a.values)
          if (v >= 0 && last_use[v] == i) free.push_back(v);
    for (const Ret& r : nodes[i].rets)
      for (int64_t v : r.values)
        if (v >= 0 && last_use[v] == kNever) free.push_back(v);
    free_at.push_back(free.size());
  }
  auto release = [&](size_t i) {
    for (size_t k = free_at[i]; k < free_at[i + 1]; ++k)
      env[free[k]].reset();
  };
  std::unordered_map<int64_t, Pending> pending;
  size_t next_placeholder = 0;
  std::vector<at::Tensor> result;
  torch::jit::Stack stack;
  for (const Node& n : graph.nodes()) {
    switch (n.kind) {
      case NodeKind::Placeholder: {
        TORCH_CHECK(next_placeholder < placeholders.size(), "graph replay: got ",
                    placeholders.size(), " placeholder tensors; the graph has more (", n.name,
                    " is missing)");
        const at::Tensor& t = placeholders[next_placeholder++];
        TORCH_CHECK(t.defined(), "graph replay: placeholder ", n.name, " is undefined");
        TORCH_CHECK(t.sizes().vec() == n.shape && t.scalar_type() == n.dtype,
                    "graph replay: placeholder '", n.name, "' was captured as ",
                    c10::toString(n.dtype), shape_str(n.shape), " but got ",
                    c10::toString(t.scalar_type()), shape_str(t.sizes()),
                    "; a captured graph freezes shapes: capture a new graph for the new shape");
        env[n.rets[0].values[0]] = t;
        break;
      }
      case NodeKind::Call: {
        stack.clear();
        for (const Arg& a : n.args) {
          switch (a.kind) {
            case Arg::Kind::Constant:
              stack.emplace_back(a.constant);
              break;
            case Arg::Kind::Value:
              stack.emplace_back(env[a.values[0]]);
              break;
            case Arg::Kind::ValueList: {
              c10::List<at::Tensor> l;
              l.reserve(a.values.size());
              for (int64_t v : a.values)
                l.push_back(env[v]);
              stack.emplace_back(std::move(l));
              break;
            }
            case Arg::Kind::OptionalValueList: {
              c10::List<c10::optional<at::Tensor>> l;
              l.reserve(a.values.size());
              for (int64_t v : a.values)
                l.push_back(v < 0 ? c10::optional<at::Tensor>()
                                  : c10::optional<at::Tensor>(env[v]));
              stack.emplace_back(std::move(l));
              break;
            }
          }
        }
        if (trace) started = now();
        n.op->callBoxed(&stack);
        if (trace) trace->calls.push_back({size_t(&n - graph.nodes().data()), started, now()});
        TORCH_INTERNAL_ASSERT(stack.size() == n.rets.size(), n.str(), " returned ", stack.size(),
                              " values, captured ", n.rets.size());
        for (size_t i = 0; i < n.rets.size(); ++i) {
          const Ret& r = n.rets[i];
          if (r.kind == Ret::Kind::Value) {
            if (r.values[0] >= 0) env[r.values[0]] = stack[i].toTensor();
          } else if (r.kind == Ret::Kind::ValueList) {
            auto l = stack[i].toTensorList();
            TORCH_INTERNAL_ASSERT(l.size() == r.values.size(), n.str());
            for (size_t j = 0; j < l.size(); ++j)
              env[r.values[j]] = l.get(j);
          }
        }
        break;
      }
      case NodeKind::Collective:
        pending.emplace(n.rets[0].values[0], issue(n, env[n.args[0].values[0]], comm));
        if (trace) {  // in flight once posted
          started = now();
          flight_of[n.rets[0].values[0]] = trace->in_flight.size();
          trace->in_flight.push_back({size_t(&n - graph.nodes().data()), started, started});
        }
        break;
      case NodeKind::Wait: {
        auto it = pending.find(n.args[0].values[0]);
        TORCH_INTERNAL_ASSERT(it != pending.end(), "wait on a collective not issued: ", n.str());
        if (trace) started = now();
        env[n.rets[0].values[0]] = finish(it->second);
        pending.erase(it);
        if (trace) {
          const double ended = now();
          trace->waits.push_back({size_t(&n - graph.nodes().data()), started, ended});
          trace->in_flight[flight_of.at(n.args[0].values[0])].end = ended;
        }
        break;
      }
      case NodeKind::Output:
        for (int64_t v : n.inputs())
          result.push_back(env[v]);
        break;
    }
    release(static_cast<size_t>(&n - nodes.data()));
  }
  TORCH_CHECK(next_placeholder == placeholders.size(), "graph replay: got ", placeholders.size(),
              " placeholder tensors for ", next_placeholder, " placeholders");
  TORCH_INTERNAL_ASSERT(pending.empty(), "graph replay: a collective was never waited on");
  if (trace) trace->total = now();
  return result;
}

}  // namespace hp::compile
