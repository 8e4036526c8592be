// run_graph_rank: GraphTrainer over the reference models, data parallel with
// FSDP, and the measurements `hp train --graph` reports.
#include "hp/train/graph_train.h"

#include <chrono>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "hp/compile/graph_trainer.h"
#include "hp/core/memory.h"
#include "hp/distributed/collectives.h"
#include "hp/models/data.h"
#include "hp/recompute/checkpoint.h"
#include "hp/schedule/text.h"
#include "hp/train/progress.h"
#include "hp/train/report.h"

namespace hp::train {
namespace {

using Clock = std::chrono::steady_clock;

// NOTE [Graph mode trace]
// The Chrome trace of `hp train --graph` shows per rank two lanes: "compute"
// (every operator call of the replay, and the waits, named after their
// collective) and "comm" (each collective from its issue to the end of its
// wait). With the overlap pass the comm lane runs under the compute lane;
// without it every transfer sits between two calls as a wait.
std::string chrome_trace(const compile::Graph& graph,
                         const std::vector<std::vector<double>>& packed_by_rank) {
  nlohmann::json events = nlohmann::json::array();
  for (size_t r = 0; r < packed_by_rank.size(); ++r) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"name", "compute"}}}});
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 1},
                      {"args", {{"name", "comm"}}}});
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"name", "rank " + std::to_string(r)}}}});
    const auto& v = packed_by_rank[r];
    for (size_t k = 0; k + 3 < v.size(); k += 4) {
      const int kind = static_cast<int>(v[k]);
      const auto& node = graph.nodes().at(static_cast<size_t>(v[k + 1]));
      std::string name = node.name;
      if (kind == 2) {
        const auto& coll = graph.nodes().at(graph.def_index(node.args[0].values[0]));
        name = "wait " + coll.name;
      }
      events.push_back({{"name", name},
                        {"cat", kind == 0   ? "call"
                                : kind == 1 ? "collective"
                                            : "wait"},
                        {"ph", "X"},
                        {"pid", r},
                        {"tid", kind == 1 ? 1 : 0},
                        {"ts", v[k + 2] * 1e6},
                        {"dur", (v[k + 3] - v[k + 2]) * 1e6}});
    }
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n";
}

// (kind, node, start, end) per span: 0 call, 1 collective in flight, 2 wait.
std::vector<double> pack(const compile::ReplayTrace& t) {
  std::vector<double> v;
  const std::vector<compile::ReplayTrace::Span>* lists[] = {&t.calls, &t.in_flight, &t.waits};
  for (int kind = 0; kind < 3; ++kind)
    for (const auto& s : *lists[kind])
      v.insert(v.end(), {double(kind), double(s.node), s.start, s.end});
  return v;
}

}  // namespace

TrainResult run_graph_rank(const TrainConfig& config, std::shared_ptr<distributed::Comm> comm) {
  config.validate();
  TORCH_CHECK(config.graph, "run_graph_rank needs a config with graph set");
  const int rank = comm->rank(), world = comm->world_size();
  TORCH_CHECK(world == config.nproc, "the Comm has ", world,
              " ranks but the config asks for --nproc ", config.nproc);
  install_memory_tracker();
  const int per_rank = config.microbatches / world;

  std::shared_ptr<torch::nn::Module> model = models::build_chunk(config.model, 0, 1, config.seed);
  const models::ModelSpec spec = config.model;
  // --recompute: every block checkpointed. Capture records its forward
  // twice (the recomputed one feeds the backward), and the replay frees each
  // value after its last use, so the step holds one block's activations
  // instead of all of them (NOTE [Values die at their last use]).
  const bool recompute = config.recompute;
  compile::TrainFn train_fn = [spec, recompute](torch::nn::Module& m, const at::Tensor& x,
                                                const at::Tensor& y) {
    auto& chunk = static_cast<models::Chunk&>(m);
    if (!recompute) return models::loss(spec, chunk.forward(x), y);
    auto out = chunk.forward_with(x, [](const models::Chunk::BlockForward& block,
                                        torch::nn::Module& module, const at::Tensor& h) {
      auto fn = [block](const recompute::TensorList& in) {
        return recompute::TensorList{block(in[0])};
      };
      return recompute::checkpoint(fn, {h}, module.parameters())[0];
    });
    return models::loss(spec, out, y);
  };

  // FSDP over every parameter whose dim 0 divides by the ranks; an empty
  // (enabled) plan leaves every parameter replicated: plain data parallel.
  compile::PassConfig pc;
  pc.fsdp_enabled = world > 1;
  pc.fsdp_degree = world;
  pc.enable_overlap = config.overlap;
  compile::PassPlan plan;
  plan.set_enabled(true);
  for (const auto& item : model->named_parameters())
    if (config.shard && item.value().dim() >= 1 && item.value().size(0) % world == 0)
      plan.add_module(item.key());
  compile::OptimizerConfig opt;
  opt.lr = config.lr;
  opt.weight_decay = config.weight_decay;
  opt.sgd = config.optimizer == "sgd";
  compile::GraphTrainer trainer(model, train_fn, pc, plan, opt, world > 1 ? comm : nullptr);
  trainer.record_trace(true);  // a few clock reads per operator call

  models::Dataset data(config.model, config.data, config.microbatch_size, config.seed);
  auto batch_of = [&](int step) {
    std::vector<at::Tensor> xs, ys;
    for (int k = 0; k < per_rank; ++k) {
      auto b = data.get(step, rank * per_rank + k);
      xs.push_back(b.input);
      ys.push_back(b.target);
    }
    return std::make_pair(torch::cat(xs), torch::cat(ys));
  };

  TrainResult result;
  result.items_per_step = data.items_per_microbatch() * config.microbatches;
  {
    auto t0 = Clock::now();
    auto [x, y] = batch_of(0);
    trainer.compile(x, y);  // capture + passes; FSDP shards the model here
    result.compile_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  Progress progress(config.progress && rank == 0, 0, config.steps);
  int64_t peak_bytes = 0;
  for (int step = 0; step < config.steps; ++step) {
    auto [x, y] = batch_of(step);
    comm->barrier();  // aligns the ranks' clocks for the trace
    const int64_t base = memory_allocated();
    reset_peak_memory();
    auto t0 = Clock::now();
    double local = trainer.train_step(x, y);
    peak_bytes = std::max(peak_bytes, std::max<int64_t>(0, peak_memory_allocated() - base));
    trainer.optimizer_step();
    auto loss = torch::tensor({local}, torch::kFloat64);
    comm->all_reduce(loss);
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    result.losses.push_back(loss.item<double>() / world);
    result.step_seconds.push_back(secs);
    progress.update(step, result.losses.back(), result.items_per_step / secs);
  }

  // Final parameters (this rank's shards) and a checksum counting each once.
  std::set<std::string> sharded(trainer.sharded_parameters().begin(),
                                trainer.sharded_parameters().end());
  double shard_sum = 0.0, replicated_sum = 0.0;
  int64_t param_bytes = 0;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model->named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const at::Tensor p = item.value().detach();
    result.parameters[item.key()] = p.clone();
    param_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    (sharded.count(item.key()) ? shard_sum : replicated_sum) +=
        p.to(torch::kFloat64).sum().item<double>();
  }
  result.sharded = trainer.sharded_parameters();
  auto cs = torch::tensor({shard_sum}, torch::kFloat64);
  comm->all_reduce(cs);
  result.checksum = cs.item<double>() + replicated_sum;

  // Per-rank measurements of the last step, gathered everywhere.
  const compile::ReplayTrace& t = trainer.last_trace();
  auto mine = torch::tensor({t.call_seconds(), t.wait_seconds(),
                             std::max(0.0, t.total - t.call_seconds() - t.wait_seconds()),
                             double(peak_bytes), double(param_bytes), t.hidden_comm_fraction()},
                            torch::kFloat64);
  std::vector<torch::Tensor> all(world);
  for (auto& a : all)
    a = torch::empty_like(mine);
  comm->all_gather(all, mine);
  // The trace spans, on rank 0 (every rank replays the same graph: same count).
  std::vector<double> packed = pack(t);
  std::vector<std::vector<double>> by_rank{packed};
  if (!config.trace.empty() && world > 1) {
    auto rows = distributed::gather_rows(*comm, torch::tensor(packed, torch::kFloat64), 0);
    for (int r = 1; r < int(rows.size()); ++r)
      by_rank.emplace_back(rows[r].data_ptr<double>(),
                           rows[r].data_ptr<double>() + rows[r].numel());
  }
  if (rank != 0) return result;
  for (auto& a : all) {
    result.rank_compute.push_back(a[0].item<double>());
    result.rank_comm_wait.push_back(a[1].item<double>());
    result.rank_overhead.push_back(a[2].item<double>());
    result.rank_peak_bytes.push_back(a[3].item<double>());
    result.rank_param_bytes.push_back(a[4].item<double>());
    result.rank_hidden_comm.push_back(a[5].item<double>());
  }
  if (!config.trace.empty())
    schedule::write_text_file(config.trace, chrome_trace(trainer.graph(), by_rank));
  if (!config.report.empty()) write_report(config, result, config.report);
  return result;
}

}  // namespace hp::train
