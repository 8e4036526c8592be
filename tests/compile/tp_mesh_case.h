// The tp x dp case of test_tp_mesh (seed 002's test_tpsp), shared by the test
// (ranks as threads, and the oracle) and tp_mesh_worker (ranks as processes):
// the model, the data, one rank's graph-mode training on the mesh, and
// single-process eager training of the plain GPT.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hp/compile/graph_trainer.h"
#include "hp/compile/tp_ops.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/mesh.h"
#include "hp/models/models.h"
#include "hp/models/tp_models.h"
#include "hp/recompute/checkpoint.h"

namespace hp_test {

struct TpMeshCase {
  int tp = 2, dp = 2;
  int steps = 3;
  int64_t batch = 4;  ///< rows of a global batch; dp rank d trains on rows [d*b/dp, (d+1)*b/dp)
  bool recompute = false;
  uint64_t seed = 7;
  hp::models::ModelSpec spec;
  hp::compile::OptimizerConfig opt;

  TpMeshCase() {
    spec.kind = "gpt";
    spec.layers = 2;
    spec.d_model = 16;
    spec.heads = 4;
    spec.vocab = 32;
    spec.seq_len = 8;
    spec.dtype = torch::kFloat64;
    opt.lr = 1e-2;
    opt.weight_decay = 0.01;
    opt.grad_clip = 0.5;
  }
};

/// The global batches: random tokens, the same in every process.
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> tp_mesh_data(const TpMeshCase& c) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1000);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  for (int s = 0; s < c.steps; ++s) {
    auto x = at::randint(c.spec.vocab, {c.batch, c.spec.seq_len}, gen, torch::kLong);
    auto y = at::randint(c.spec.vocab, {c.batch, c.spec.seq_len}, gen, torch::kLong);
    data.emplace_back(x, y);
  }
  return data;
}

/// The train step: the chunk's forward (each block checkpointed with
/// hp::recompute when `recompute`) and the gpt's loss.
inline hp::compile::TrainFn tp_mesh_train_fn(const hp::models::ModelSpec& spec, bool recompute) {
  return [spec, recompute](torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    auto& chunk = static_cast<hp::models::Chunk&>(m);
    if (!recompute) return hp::models::loss(spec, chunk.forward(x), y);
    auto out = chunk.forward_with(x, [](const hp::models::Chunk::BlockForward& block,
                                        torch::nn::Module& module, const torch::Tensor& h) {
      auto fn = [block](const hp::recompute::TensorList& in) {
        return hp::recompute::TensorList{block(in[0])};
      };
      return hp::recompute::checkpoint(fn, {h}, module.parameters())[0];
    });
    return hp::models::loss(spec, out, y);
  };
}

/// What one rank ends with.
struct TpMeshRank {
  int tp_rank = 0, dp_rank = 0;
  std::vector<double> losses;                      ///< this rank's (its dp share's) loss per step
  std::map<std::string, torch::Tensor> params;     ///< its local tensors (TP shard, FSDP shard)
  std::vector<std::string> sharded;                ///< FQNs FSDP sharded
  int64_t tp_copy_calls = 0, tp_reduce_calls = 0;  ///< in the compiled graph
  int64_t fsdp_degree = 0, tp_size = 0;            ///< as the trainer filled them
};

/// One rank of the tp x dp mesh over `world`, graph mode with FSDP over dp:
/// FSDP shards the blocks (PassPlan pattern "block*"); the embeddings and
/// the head stay replicated over dp (their gradients all-reduced).
inline TpMeshRank run_tp_mesh_rank(const TpMeshCase& c,
                                   std::shared_ptr<hp::distributed::Comm> world,
                                   const std::string& tp_group_name) {
  auto mesh = std::make_shared<hp::distributed::DeviceMesh>(
      world, hp::distributed::MeshShape{{"dp", "tp"}, {c.dp, c.tp}});
  hp::models::TensorParallel tp;
  tp.rank = mesh->coordinate("tp");
  tp.size = c.tp;
  tp.copy_to_region = [tp_group_name](const torch::Tensor& x) {
    return hp::compile::tp_copy(x, tp_group_name);
  };
  tp.reduce_from_region = [tp_group_name](const torch::Tensor& x) {
    return hp::compile::tp_reduce(x, tp_group_name);
  };
  std::shared_ptr<torch::nn::Module> model = hp::models::build_tp_chunk(c.spec, 0, 1, c.seed, tp);
  auto ctx = hp::compile::MeshContext::from_mesh(mesh, "dp", "tp", tp_group_name);
  for (const auto& item : model->named_parameters())
    if (hp::models::tp_split(item.key()) != hp::models::TpSplit::Replicated)
      ctx.tp_sharded.push_back(item.key());
  hp::compile::PassPlan plan;
  plan.add_pattern("block*");
  hp::compile::GraphTrainer trainer(model, tp_mesh_train_fn(c.spec, c.recompute),
                                    hp::compile::PassConfig{}, plan, c.opt, ctx);
  TpMeshRank out;
  out.tp_rank = tp.rank;
  out.dp_rank = mesh->coordinate("dp");
  const int64_t rows = c.batch / c.dp;
  for (const auto& [x, y] : tp_mesh_data(c)) {
    out.losses.push_back(trainer.train_step(x.narrow(0, out.dp_rank * rows, rows),
                                            y.narrow(0, out.dp_rank * rows, rows)));
    trainer.optimizer_step();
  }
  for (const auto& item : model->named_parameters())
    out.params[item.key()] = item.value().detach().clone();
  out.sharded = trainer.sharded_parameters();
  out.tp_copy_calls = trainer.graph().count_calls(hp::compile::kTpCopyOp);
  out.tp_reduce_calls = trainer.graph().count_calls(hp::compile::kTpReduceOp);
  out.fsdp_degree = trainer.config().fsdp_degree.value_or(0);
  out.tp_size = trainer.config().tp_size;
  return out;
}

/// The oracle: the plain GPT trained eagerly in one process on the global
/// batches, torch::optim::AdamW and clip_grad_norm_.
struct TpMeshReference {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

inline TpMeshReference tp_mesh_reference(const TpMeshCase& c) {
  auto model = hp::models::build_chunk(c.spec, 0, 1, c.seed);
  torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(c.opt.lr)
                                                    .betas({c.opt.beta1, c.opt.beta2})
                                                    .eps(c.opt.eps)
                                                    .weight_decay(c.opt.weight_decay));
  TpMeshReference ref;
  for (const auto& [x, y] : tp_mesh_data(c)) {
    adam.zero_grad();
    auto loss = hp::models::loss(c.spec, model->forward(x), y);
    loss.backward();
    if (c.opt.grad_clip > 0)
      torch::nn::utils::clip_grad_norm_(model->parameters(), c.opt.grad_clip);
    adam.step();
    ref.losses.push_back(loss.item<double>());
  }
  for (const auto& item : model->named_parameters())
    ref.params[item.key()] = item.value().detach().clone();
  return ref;
}

}  // namespace hp_test
