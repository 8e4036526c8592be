// Test helper: a tiny float64 model trained by hp::train::run_rank with ranks
// as threads, and the comparison of every copy with single-process training
// (hp::train::train_reference), for the pipeline tests of this folder.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "hp/train/trainer.h"
#include "tests/common/threads_as_ranks.h"

namespace hp::testing {

using train::TrainConfig;
using train::TrainResult;

/// A float64 gpt (or mlp) on p ranks, m microbatches, 2 AdamW steps.
inline TrainConfig tiny(const std::string& schedule, int p, int m, const std::string& model) {
  TrainConfig c;
  c.model.kind = model;
  c.model.dtype = torch::kFloat64;
  c.model.d_model = 16;
  c.model.heads = 2;
  c.model.seq_len = 8;
  c.model.vocab = 256;
  c.model.in_features = 8;
  c.model.tied_head = false;
  c.nproc = p;
  c.schedule = schedule;
  c.chunks = 2;
  c.microbatches = m;
  c.microbatch_size = 2;
  c.steps = 2;
  c.optimizer = "adamw";
  c.lr = 1e-2;
  c.seed = 7;
  c.progress = false;
  // Enough cuttable layers for the schedule with the most chunks (v * p or 2p).
  c.model.layers = 2 * p;
  return c;
}

/// Every rank of `config` (nproc x dp) run as a thread of this process.
inline std::vector<TrainResult> run_threads(const TrainConfig& config) {
  std::vector<TrainResult> results(config.nproc * config.dp);
  run_ranks_as_threads(config.nproc * config.dp,
                       [&](int r, std::shared_ptr<hp::distributed::Comm> comm) {
                         results[r] = train::run_rank(config, comm);
                       });
  return results;
}

/// Each rank's losses and parameters, and rank 0's checksum, equal `ref` to 1e-9.
inline void expect_copies_equal_the_reference(const std::vector<TrainResult>& ranks,
                                              const TrainResult& ref) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    SCOPED_TRACE("world rank " + std::to_string(r));
    ASSERT_EQ(ranks[r].losses.size(), ref.losses.size());
    for (size_t s = 0; s < ref.losses.size(); ++s)
      EXPECT_NEAR(ranks[r].losses[s], ref.losses[s], 1e-9 * std::max(1.0, std::abs(ref.losses[s])))
          << "step " << s;
    for (const auto& [name, p] : ranks[r].parameters) {
      const auto& q = ref.parameters.at(name);
      EXPECT_LE((p - q).abs().max().item<double>(),
                1e-9 * std::max(1.0, q.abs().max().item<double>()))
          << name;
    }
  }
  EXPECT_NEAR(ranks[0].checksum, ref.checksum, 1e-9 * std::max(1.0, std::abs(ref.checksum)));
}

}  // namespace hp::testing
