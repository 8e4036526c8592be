// Passes and GraphTrainer against eager torch::autograd + torch::optim::Adam
// (float64): pipeline assembly by config, DCE, canonicalize, world-of-one
// FSDP, the trainer loop and accumulation, and FSDP + overlap on 2 ranks as
// threads (collectives where the plan says, shard sizes, waits really moved,
// training equal to single-process eager).
#include <gtest/gtest.h>

#include <torch/torch.h>
#include "tests/common/threads_as_ranks.h"

#include <filesystem>
#include <thread>

#include "hp/compile/graph_trainer.h"
#include "hp/compile/passes.h"
#include "hp/distributed/comm.h"
#include "test_models.h"

using namespace hp::compile;
using hp_test::expect_close;
using hp_test::kF64;

namespace {

std::string temp_path(const std::string& stem) {
  static int counter = 0;
  auto p =
      std::filesystem::temp_directory_path() / ("hp-compile-test-" + std::to_string(::getpid()) +
                                                "-" + stem + "-" + std::to_string(counter++));
  std::filesystem::remove_all(p);
  return p.string();
}

TEST(PassPipeline, AssemblyByConfig) {
  PassConfig c;
  EXPECT_EQ(PassPipeline::from_config(c).names(),
            (std::vector<std::string>{"dce", "canonicalize", "fsdp", "auto_overlap"}));
  c.enable_overlap = false;
  EXPECT_EQ(PassPipeline::from_config(c).names(),
            (std::vector<std::string>{"dce", "canonicalize", "fsdp"}));
  c.fsdp_enabled = false;
  c.enable_overlap = true;
  EXPECT_EQ(PassPipeline::from_config(c).names(),
            (std::vector<std::string>{"dce", "canonicalize", "auto_overlap"}));
  c.tp_size = 0;
  EXPECT_THROW(PassPipeline::from_config(c), std::invalid_argument);
}

TEST(Passes, DceAndCanonicalizeKeepResults) {
  torch::manual_seed(10);
  hp_test::Mlp mlp(4, 8, 2);
  TrainFn fn = [](torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    auto unused = torch::exp(x) * 3;  // dead
    return torch::mse_loss(static_cast<hp_test::MlpImpl&>(m).forward(x.detach()), y);
  };
  auto x = torch::randn({5, 4}, kF64), y = torch::randn({5, 2}, kF64);
  Graph g = capture_train_step(*mlp, fn, x, y);
  auto before = replay(g, placeholder_values(g, *mlp, x, y));
  ASSERT_EQ(g.count_calls("aten::exp"), 1);
  ASSERT_GE(g.count_calls("aten::detach"), 1);
  PassContext ctx;
  DeadCodeElimination().run(g, ctx);
  g.lint();
  EXPECT_EQ(g.count_calls("aten::exp"), 0);
  EXPECT_EQ(g.count_calls("aten::mul"), 0) << g.str();  // only the dead `* 3` was a mul
  CanonicalizeGraph().run(g, ctx);
  g.lint();
  EXPECT_EQ(g.count_calls("aten::detach"), 0) << g.str();
  int64_t defined = 0;
  for (const auto& n : g.nodes())
    defined += static_cast<int64_t>(n.outputs().size());
  EXPECT_EQ(g.num_values(), defined);  // dense ids
  EXPECT_EQ(g.nodes()[0].rets[0].values[0], 0);
  auto after = replay(g, placeholder_values(g, *mlp, x, y));
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i)
    expect_close(after[i], before[i], g.output().output_names[i], 0.0);
}

TEST(Passes, FsdpOnWorldOfOneLeavesGraphUnsharded) {
  torch::manual_seed(11);
  hp_test::Mlp mlp(4, 8, 3);  // dim 0 of 3 would not divide by 2; here it need not
  auto x = torch::randn({5, 4}, kF64), y = torch::randn({5, 3}, kF64);
  Graph g = capture_train_step(*mlp, hp_test::mse_fn<hp_test::MlpImpl>(), x, y);
  const std::string text = g.str();
  auto comm = hp::distributed::Comm::from_file_store(temp_path("one"), 0, 1);
  PassContext ctx;
  ctx.model = mlp.get();
  ctx.comm = comm.get();
  FSDPPass().run(g, ctx);
  EXPECT_EQ(g.str(), text);
  EXPECT_TRUE(ctx.sharded.empty());
  EXPECT_EQ(mlp->fc1->weight.sizes(), (std::vector<int64_t>{8, 4}));
}

// Eager training with torch::optim::Adam (and clip_grad_norm_), full batches.
using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

/// Plain autograd and a LibTorch optimizer (`make`; default Adam(lr)).
std::vector<double> eager_train(torch::nn::Module& model, const TrainFn& fn,
                                const std::vector<std::pair<torch::Tensor, torch::Tensor>>& data,
                                double lr, double clip, const MakeOptimizer& make = {}) {
  auto optim = make ? make(model.parameters())
                    : std::make_unique<torch::optim::Adam>(model.parameters(),
                                                           torch::optim::AdamOptions(lr));
  std::vector<double> losses;
  for (const auto& [x, y] : data) {
    optim->zero_grad();
    auto loss = fn(model, x, y);
    loss.backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(model.parameters(), clip);
    optim->step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> mlp_data(int steps, int64_t batch) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  torch::manual_seed(99);
  for (int s = 0; s < steps; ++s)
    data.emplace_back(torch::randn({batch, 6}, kF64), torch::randn({batch, 4}, kF64));
  return data;
}

TEST(GraphTrainer, SingleProcessMatchesEagerAdamWithClipping) {
  auto data = mlp_data(4, 8);
  auto fn = hp_test::mse_fn<hp_test::MlpImpl>();
  for (double clip : {0.0, 0.05}) {
    torch::manual_seed(12);
    hp_test::Mlp ref(6, 16, 4);
    torch::manual_seed(12);
    hp_test::Mlp mlp(6, 16, 4);
    OptimizerConfig opt;
    opt.lr = 0.01;
    opt.grad_clip = clip;
    GraphTrainer trainer(mlp.ptr(), fn, PassConfig{}, std::nullopt, opt);
    EXPECT_FALSE(trainer.compiled());
    std::vector<int64_t> logged;
    auto losses = trainer.train(data, /*max_steps=*/3, /*log_interval=*/2,
                                [&](int64_t step, double) { logged.push_back(step); });
    EXPECT_TRUE(trainer.compiled());
    EXPECT_EQ(logged, std::vector<int64_t>{1});
    auto want = eager_train(*ref, fn, {data.begin(), data.begin() + 3}, 0.01, clip);
    ASSERT_EQ(losses.size(), 3u);
    for (size_t s = 0; s < 3; ++s)
      EXPECT_NEAR(losses[s], want[s], 1e-12) << "clip " << clip << " step " << s;
    auto a = mlp->parameters(), b = ref->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      expect_close(a[i], b[i], "param " + std::to_string(i) + " clip " + std::to_string(clip),
                   1e-10);
    for (auto& p : mlp->parameters())
      EXPECT_FALSE(p.grad().defined());  // zero_grad after the step
  }
}

TEST(GraphTrainer, AccumulatesByFqnAndRejectsCountMismatch) {
  torch::manual_seed(13);
  hp_test::Tied tied(5, 6);
  auto fn = hp_test::mse_fn<hp_test::TiedImpl>();
  torch::manual_seed(14);
  auto x1 = torch::randn({4, 5}, kF64), y1 = torch::randn({4, 5}, kF64);
  auto x2 = torch::randn({4, 5}, kF64), y2 = torch::randn({4, 5}, kF64);
  // Eager: the sum of the two batches' gradients.
  auto l = fn(*tied, x1, y1) + fn(*tied, x2, y2);
  auto params = tied->parameters();  // enc.weight, mid.weight, mid.bias, dec.weight (= enc)
  auto want = torch::autograd::grad({l}, params);
  GraphTrainer trainer(tied.ptr(), fn);
  trainer.train_step(x1, y1);
  trainer.train_step(x2, y2);
  expect_close(tied->enc->weight.grad(), want[0], "shared weight (added once per step)");
  expect_close(tied->mid->weight.grad(), want[1], "mid.weight");
  expect_close(tied->mid->bias.grad(), want[2], "mid.bias");
  trainer.zero_grad();
  tied->register_parameter("extra", torch::zeros({2}, kF64));
  try {
    trainer.train_step(x1, y1);
    FAIL() << "expected a count mismatch";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("returns 4 gradients but the model has 5"),
              std::string::npos)
        << e.what();
  }
}

struct RankResult {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  Graph graph;
  std::vector<std::string> sharded;
};

// Two ranks as threads: rank r trains on rows [r*b/2, (r+1)*b/2) of each batch.
std::vector<RankResult> run_fsdp(const PassConfig& config, const std::optional<PassPlan>& plan,
                                 const std::vector<std::pair<torch::Tensor, torch::Tensor>>& data,
                                 OptimizerConfig opt, int64_t out_features = 4) {
  const int world = 2;
  std::vector<hp_test::Mlp> models;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(15);
    models.emplace_back(6, 16, out_features);
  }
  std::vector<RankResult> results(world);
  hp::testing::run_ranks_as_threads(world, [&](int r, std::shared_ptr<hp::distributed::Comm> comm) {
    GraphTrainer trainer(models[r].ptr(), hp_test::mse_fn<hp_test::MlpImpl>(), config, plan, opt,
                         comm);
    for (const auto& [x, y] : data) {
      const int64_t half = x.size(0) / world;
      results[r].losses.push_back(
          trainer.train_step(x.narrow(0, r * half, half), y.narrow(0, r * half, half)));
      trainer.optimizer_step();
    }
    results[r].params = models[r]->parameters();
    results[r].graph = trainer.graph();
    results[r].sharded = trainer.sharded_parameters();
  });
  return results;
}

int64_t count_collectives(const Graph& g, CollectiveKind kind) {
  int64_t n = 0;
  for (const auto& node : g.nodes())
    n += node.kind == NodeKind::Collective && node.collective == kind;
  return n;
}

TEST(Fsdp, TwoRanksMatchEagerWithAndWithoutOverlap) {
  auto data = mlp_data(3, 8);
  OptimizerConfig opt;
  opt.lr = 0.01;
  opt.grad_clip = 0.05;
  torch::manual_seed(15);
  hp_test::Mlp ref(6, 16, 4);
  auto fn = hp_test::mse_fn<hp_test::MlpImpl>();
  auto want = eager_train(*ref, fn, data, opt.lr, opt.grad_clip);
  auto ref_params = ref->parameters();
  PassPlan plan;
  plan.add_module("fc1");
  std::vector<Graph> graphs;
  for (bool overlap : {false, true}) {
    PassConfig config;
    config.enable_overlap = overlap;
    auto ranks = run_fsdp(config, plan, data, opt);
    const Graph& g = ranks[0].graph;
    // Collectives where the plan says: fc1's two parameters are sharded,
    // fc2's two are replicated (data parallel all_reduce).
    EXPECT_EQ(ranks[0].sharded, (std::vector<std::string>{"fc1.weight", "fc1.bias"}));
    EXPECT_EQ(count_collectives(g, CollectiveKind::AllGather), 2);
    EXPECT_EQ(count_collectives(g, CollectiveKind::ReduceScatter), 2);
    EXPECT_EQ(count_collectives(g, CollectiveKind::AllReduce), 2);
    for (const auto& n : g.nodes())
      if (n.kind == NodeKind::Collective && n.collective == CollectiveKind::AllGather) {
        const Node& src = g.nodes()[g.def_index(n.args[0].values[0])];
        EXPECT_EQ(src.kind, NodeKind::Placeholder);
        EXPECT_TRUE(src.name == "fc1.weight" || src.name == "fc1.bias") << src.name;
      }
    EXPECT_EQ(g.nodes()[0].shape, (std::vector<int64_t>{8, 6}));  // fc1.weight placeholder: 1/2
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(ranks[r].params[0].sizes(), (std::vector<int64_t>{8, 6}));
      EXPECT_EQ(ranks[r].params[1].sizes(), (std::vector<int64_t>{8}));
      EXPECT_EQ(ranks[r].params[2].sizes(), (std::vector<int64_t>{4, 16}));
    }
    // Training equals single-process eager on the full batches.
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_NEAR((ranks[0].losses[s] + ranks[1].losses[s]) / 2, want[s], 1e-12) << "step " << s;
    for (size_t i = 0; i < ref_params.size(); ++i) {
      auto full =
          i < 2 ? torch::cat({ranks[0].params[i], ranks[1].params[i]}, 0) : ranks[0].params[i];
      expect_close(full, ref_params[i], "param " + std::to_string(i), 1e-10);
      if (i >= 2) expect_close(ranks[1].params[i], ranks[0].params[i], "replica", 0.0);
    }
    // Where the waits are.
    int64_t moved = 0;
    for (size_t k = 0; k < g.nodes().size(); ++k) {
      const Node& n = g.nodes()[k];
      if (n.kind != NodeKind::Wait) continue;
      const size_t issued = g.def_index(n.args[0].values[0]);
      // The first node after it that is not another wait must read it
      // (several waits whose first user is the same node stack up before it).
      size_t u = k + 1;
      while (g.nodes()[u].kind == NodeKind::Wait)
        ++u;
      auto next = g.nodes()[u].inputs();
      const bool next_reads = std::count(next.begin(), next.end(), n.rets[0].values[0]) > 0;
      if (!overlap) {
        EXPECT_EQ(issued + 1, k) << "without overlap a wait follows its collective";
      } else {
        EXPECT_TRUE(next_reads) << "wait not just before its first use: " << n.str();
        int64_t calls_between = 0;
        for (size_t j = issued + 1; j < k; ++j)
          calls_between += g.nodes()[j].kind == NodeKind::Call;
        moved += calls_between > 0;
      }
    }
    if (overlap) EXPECT_GE(moved, 3) << g.str();
    graphs.push_back(g);
  }
}

// NOTE [Graph mode's optimizer]: any LibTorch optimizer, made over the live
// parameters after FSDP sharded them, steps the shards as it would the whole
// model (RMSprop is elementwise; the clipping is the trainer's global norm).
TEST(Fsdp, AnyLibTorchOptimizerStepsTheShardsAsOnTheWholeModel) {
  auto data = mlp_data(3, 8);
  MakeOptimizer rmsprop = [](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::RMSprop>(
        params, torch::optim::RMSpropOptions(0.01).alpha(0.9).momentum(0.5));
  };
  OptimizerConfig opt;
  opt.grad_clip = 0.05;
  opt.make = rmsprop;
  torch::manual_seed(15);
  hp_test::Mlp ref(6, 16, 4);
  auto want =
      eager_train(*ref, hp_test::mse_fn<hp_test::MlpImpl>(), data, 0.0, opt.grad_clip, rmsprop);
  PassPlan plan;
  plan.add_module("fc1");
  auto ranks = run_fsdp(PassConfig{}, plan, data, opt);
  EXPECT_EQ(ranks[0].sharded, (std::vector<std::string>{"fc1.weight", "fc1.bias"}));
  for (size_t s = 0; s < want.size(); ++s)
    EXPECT_NEAR((ranks[0].losses[s] + ranks[1].losses[s]) / 2, want[s], 1e-12) << "step " << s;
  auto ref_params = ref->parameters();
  for (size_t i = 0; i < ref_params.size(); ++i) {
    auto full =
        i < 2 ? torch::cat({ranks[0].params[i], ranks[1].params[i]}, 0) : ranks[0].params[i];
    expect_close(full, ref_params[i], "param " + std::to_string(i), 1e-10);
  }
}

TEST(GraphTrainer, AnOptimizerOverNoneOfTheModelsParametersIsRefused) {
  torch::manual_seed(12);
  hp_test::Mlp mlp(6, 16, 4);
  auto other = torch::zeros({3}, kF64).requires_grad_(true);
  OptimizerConfig opt;
  opt.make = [&](std::vector<at::Tensor>) {
    return std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{other},
                                               torch::optim::SGDOptions(0.1));
  };
  GraphTrainer trainer(mlp.ptr(), hp_test::mse_fn<hp_test::MlpImpl>(), PassConfig{}, std::nullopt,
                       opt);
  auto data = mlp_data(1, 4);
  trainer.train_step(data[0].first, data[0].second);
  try {
    trainer.optimizer_step();
    FAIL() << "expected the optimizer to be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds none of the model's parameters"), std::string::npos)
        << e.what();
  }
}

TEST(Fsdp, DimZeroNotDivisibleNamesTheParameter) {
  auto data = mlp_data(1, 8);
  for (auto& d : data)
    d.second = d.second.narrow(1, 0, 3).contiguous();
  try {
    run_fsdp(PassConfig{}, std::nullopt, data, OptimizerConfig{}, /*out_features=*/3);
    FAIL() << "expected a divisibility error";
  } catch (const std::invalid_argument& e) {  // refused before any work
    std::string m = e.what();
    EXPECT_NE(
        m.find("parameter 'fc2.weight' has dim 0 of size 3, not divisible by the FSDP degree 2"),
        std::string::npos)
        << m;
  }
}

}  // namespace
