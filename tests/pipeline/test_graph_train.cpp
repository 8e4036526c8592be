// Graph mode as the training driver runs it (run_graph_rank): ranks as
// threads over real Gloo, FSDP over the ranks; per-step losses and the final
// parameters (shards put back together) must equal single-process eager
// training (train_reference) in float64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "hp/train/graph_train.h"
#include "hp/train/trainer.h"
#include "tests/common/oracle.h"
#include "tests/common/threads_as_ranks.h"

namespace {

using hp::train::TrainConfig;
using hp::train::TrainResult;

TrainConfig graph_config(const std::string& model, int p, bool tied) {
  TrainConfig c;
  c.graph = true;
  c.model.kind = model;
  c.model.layers = 2;
  c.model.d_model = 16;
  c.model.heads = 2;
  c.model.seq_len = 8;
  c.model.in_features = 8;
  c.model.dtype = torch::kFloat64;
  c.model.tied_head = tied;
  c.nproc = p;
  c.microbatches = 2 * p;
  c.microbatch_size = 2;
  c.steps = 3;
  c.lr = 1e-2;
  c.weight_decay = 0.01;
  c.seed = 5;
  c.progress = false;
  return c;
}

std::vector<TrainResult> run(const TrainConfig& c) {
  std::vector<TrainResult> results(c.nproc);
  hp::testing::run_ranks_as_threads(c.nproc,
                                    [&](int rank, std::shared_ptr<hp::distributed::Comm> comm) {
                                      results[rank] = hp::train::run_graph_rank(c, comm);
                                    });
  return results;
}

// Losses, checksum and every parameter (shards concatenated in rank order).
void expect_equals_reference(const TrainConfig& c, const std::vector<TrainResult>& got) {
  TrainResult ref = hp::train::train_reference(c);
  ASSERT_EQ(got[0].losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s)
    EXPECT_NEAR(got[0].losses[s], ref.losses[s], 1e-9 * std::abs(ref.losses[s])) << "step " << s;
  EXPECT_NEAR(got[0].checksum, ref.checksum, 1e-9 * std::max(1.0, std::abs(ref.checksum)));
  std::set<std::string> sharded(got[0].sharded.begin(), got[0].sharded.end());
  ASSERT_EQ(got[0].parameters.size(), ref.parameters.size());
  for (const auto& [name, want] : ref.parameters) {
    torch::Tensor have;
    if (sharded.count(name)) {
      std::vector<torch::Tensor> shards;
      for (const auto& r : got)
        shards.push_back(r.parameters.at(name));
      EXPECT_EQ(shards[0].size(0) * c.nproc, want.size(0)) << name;
      have = torch::cat(shards);
    } else {
      have = got[0].parameters.at(name);
      for (const auto& r : got)  // replicated: every rank the same
        EXPECT_TRUE(torch::equal(r.parameters.at(name), have)) << name;
    }
    hp::testing::expect_close(have, want, name, 1e-9);
  }
}

TEST(GraphTrain, GptWithFsdpOnTwoRanksEqualsSingleProcessTraining) {
  TrainConfig c = graph_config("gpt", 2, /*tied=*/false);
  auto got = run(c);
  EXPECT_FALSE(got[0].sharded.empty());
  expect_equals_reference(c, got);
  // Rank 0 gathered every rank's measurements; every parameter is sharded, so
  // each rank holds half of them.
  ASSERT_EQ(got[0].rank_param_bytes.size(), 2u);
  EXPECT_EQ(got[0].rank_param_bytes[0], got[0].rank_param_bytes[1]);
  const double whole = hp::models::parameter_count(c.model) * sizeof(double);
  EXPECT_NEAR(got[0].rank_param_bytes[0], whole / 2, 1.0);
}

TEST(GraphTrain, TiedHeadAndNoOverlapStillEqualTheReference) {
  TrainConfig c = graph_config("gpt", 2, /*tied=*/true);
  c.overlap = false;
  expect_equals_reference(c, run(c));
}

TEST(GraphTrain, SgdOnTheMlpEqualsTheReference) {
  TrainConfig c = graph_config("mlp", 2, false);
  c.optimizer = "sgd";
  c.lr = 0.1;
  expect_equals_reference(c, run(c));
}

TEST(GraphTrain, DataParallelWithoutShardingEqualsTheReference) {
  TrainConfig c = graph_config("mlp", 2, false);
  c.shard = false;
  auto got = run(c);
  EXPECT_TRUE(got[0].sharded.empty());
  EXPECT_EQ(got[0].rank_param_bytes[0], got[0].rank_param_bytes[1]);
  expect_equals_reference(c, got);
}

TEST(GraphTrain, OneProcessEqualsTheReference) {
  TrainConfig c = graph_config("gpt", 1, true);
  auto got = run(c);
  EXPECT_TRUE(got[0].sharded.empty());
  expect_equals_reference(c, got);
}

// --graph --recompute: checkpointed blocks captured (their forward twice) and
// replayed with FSDP on two ranks still train as the eager reference.
TEST(GraphTrain, CheckpointedBlocksEqualTheReference) {
  TrainConfig c = graph_config("gpt", 2, true);
  c.recompute = true;
  auto got = run(c);
  expect_equals_reference(c, got);
}

TEST(GraphTrain, ParametersThatDoNotDivideStayReplicated) {
  // d_model 18 on 4 ranks: [18]-sized norms and biases stay whole, the
  // 256-row embedding is sharded.
  TrainConfig c = graph_config("gpt", 4, false);
  c.model.d_model = 18;
  c.model.heads = 2;
  c.steps = 2;
  auto got = run(c);
  std::set<std::string> sharded(got[0].sharded.begin(), got[0].sharded.end());
  EXPECT_TRUE(sharded.count("embed.wte"));
  EXPECT_LT(sharded.size(), got[0].parameters.size());
  expect_equals_reference(c, got);
}

TEST(GraphTrain, BadConfigurationsSayWhatToChange) {
  TrainConfig c = graph_config("gpt", 2, false);
  c.microbatches = 3;
  hp::testing::expect_error([&] { c.validate(); }, "does not divide by --nproc");
  c = graph_config("gpt", 2, false);
  c.save_every = 1;
  c.checkpoint_dir = "x";
  hp::testing::expect_error([&] { c.validate(); }, "does not save checkpoints");
}

}  // namespace
