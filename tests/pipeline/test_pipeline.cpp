// The pipeline runtime against its oracle: for every schedule, ranks as
// threads over real Gloo (a FileStore rendezvous; p = 2), and through the
// stream-ordered transport (p = 2 and 4), train a float64 model; losses and
// final parameters must equal single-process gradient accumulation, and each
// rank must run exactly its action list.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <thread>

#include "hp/distributed/comm.h"
#include "hp/recompute/session.h"
#include "hp/schedule/generators.h"
#include "hp/train/trainer.h"
#include "tests/common/threads_as_ranks.h"

using hp::train::TrainConfig;
using hp::train::TrainResult;

namespace {

// Runs every rank of `config` on its own thread; rethrows a rank's error.
std::vector<TrainResult> run_threads(const TrainConfig& config) {
  std::vector<TrainResult> results(config.nproc * config.dp);
  hp::testing::run_ranks_as_threads(config.nproc * config.dp,
                                    [&](int r, std::shared_ptr<hp::distributed::Comm> comm) {
                                      results[r] = hp::train::run_rank(config, comm);
                                    });
  return results;
}

void expect_matches_reference(const TrainConfig& config, const std::vector<TrainResult>& ranks) {
  TrainResult ref = hp::train::train_reference(config);
  ASSERT_EQ(ranks[0].losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    double tol = 1e-9 * std::max(1.0, std::abs(ref.losses[s]));
    EXPECT_NEAR(ranks[0].losses[s], ref.losses[s], tol) << "step " << s;
  }
  // Every parameter of the model is held by some rank, and every copy equals the reference.
  std::set<std::string> seen;
  for (const auto& r : ranks)
    for (const auto& [name, p] : r.parameters) {
      ASSERT_TRUE(ref.parameters.count(name)) << name;
      const auto& q = ref.parameters.at(name);
      double scale = std::max(1.0, q.abs().max().item<double>());
      EXPECT_LE((p - q).abs().max().item<double>(), 1e-9 * scale) << name;
      seen.insert(name);
    }
  EXPECT_EQ(seen.size(), ref.parameters.size());
  EXPECT_NEAR(ranks[0].checksum, ref.checksum, 1e-9 * std::max(1.0, std::abs(ref.checksum)));
}

void expect_runs_its_action_list(const TrainConfig& config, const std::vector<TrainResult>& ranks) {
  auto sched = config.build_schedule();
  for (int r = 0; r < config.nproc; ++r) {
    std::vector<hp::schedule::Action> expected;
    for (const auto& a : sched.actions[r])
      if (hp::schedule::is_compute(a.op)) expected.push_back(a);
    EXPECT_EQ(ranks[r].executed, expected) << "rank " << r;
  }
}

TrainConfig tiny(const std::string& schedule, int p, int m, const std::string& model) {
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

struct Case {
  std::string schedule;
  int p;
  int m;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.schedule << " p=" << c.p << " m=" << c.m;
}

class PipelineMatchesReference : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineMatchesReference, Gpt) {
  const Case& k = GetParam();
  TrainConfig c = tiny(k.schedule, k.p, k.m, "gpt");
  auto ranks = run_threads(c);
  expect_matches_reference(c, ranks);
  expect_runs_its_action_list(c, ranks);
}

std::vector<Case> all_cases(std::vector<int> ps = {2, 4}) {
  std::vector<Case> cases;
  for (int p : ps)
    for (const auto& name : hp::schedule::names()) {
      if (name == "afab") continue;  // an alias of gpipe
      int m = 2 * p;
      if (name == "dualpipe" || name == "dualpipev") m = 2 * p + (name == "dualpipe" ? 0 : 2);
      cases.push_back({name, p, m});
    }
  return cases;
}

// Over plain Gloo at p = 2; every schedule at p = 2 and 4 also runs through
// the stream-ordered transport below, which is Gloo with stricter ordering.
INSTANTIATE_TEST_SUITE_P(AllSchedules, PipelineMatchesReference,
                         ::testing::ValuesIn(all_cases({2})),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n =
                               info.param.schedule + "_p" + std::to_string(info.param.p);
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The same training with point-to-point run as NCCL runs it (NOTE
// [Stream-ordered point-to-point]): each rank's batches one after the other
// in posting order, messages matched by order alone, a send finishing only
// with its receive. A schedule whose ranks post in inconsistent orders would
// deadlock here (and fail after the timeout) as it would on NCCL.
class StreamOrderedMatchesReference : public ::testing::TestWithParam<Case> {};

TEST_P(StreamOrderedMatchesReference, Gpt) {
  const Case& k = GetParam();
  TrainConfig c = tiny(k.schedule, k.p, k.m, "gpt");
  std::vector<TrainResult> ranks(c.nproc);
  hp::testing::run_ranks_as_threads(
      c.nproc,
      [&](int r, std::shared_ptr<hp::distributed::Comm> comm) {
        auto ordered = hp::distributed::with_stream_ordered_p2p(comm);
        EXPECT_EQ(ordered->backend_name(), "gloo+ordered");
        ranks[r] = hp::train::run_rank(c, ordered);
      },
      std::chrono::seconds(20));
  expect_matches_reference(c, ranks);
  expect_runs_its_action_list(c, ranks);
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, StreamOrderedMatchesReference,
                         ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n =
                               info.param.schedule + "_p" + std::to_string(info.param.p);
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The measured timeline feeds the simulator and the measured bubble: a
// compute event must hold only compute, a receive's event its wait (NOTE
// [Compute events exclude waits]). Rank 1's first F always waits for rank 0's.
TEST(Pipeline, TimelineSeparatesComputeFromWaiting) {
  TrainConfig c = tiny("1f1b", 2, 4, "gpt");
  auto ranks = run_threads(c);
  const auto& tl = ranks[0].timeline;
  ASSERT_EQ(tl.num_ranks, 2);
  for (int r = 0; r < 2; ++r) {
    double compute = 0, waits = 0, first_f_start = -1;
    std::vector<std::pair<double, double>> spans;
    for (const auto& e : tl.events) {
      if (e.rank != r) continue;
      ASSERT_LE(e.start, e.end);
      if (hp::schedule::is_compute(e.action.op)) {
        compute += e.end - e.start;
        spans.push_back({e.start, e.end});
        if (e.action.op == hp::schedule::Op::F && e.action.microbatch == 0) first_f_start = e.start;
      } else if (e.action.op == hp::schedule::Op::RECV_F ||
                 e.action.op == hp::schedule::Op::RECV_B) {
        waits += e.end - e.start;
      }
    }
    EXPECT_NEAR(compute, ranks[0].rank_compute[r], 1e-6) << "rank " << r;
    EXPECT_LE(waits, ranks[0].rank_comm_wait[r] + 1e-6) << "rank " << r;
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k)
      EXPECT_LE(spans[k - 1].second, spans[k].first + 1e-9) << "rank " << r << " overlaps";
    if (r == 1) {
      EXPECT_GT(waits, 0.0);
      // Stage 1's F0 waits for its input: its receive's wait ends when its
      // compute starts (same clock), and across ranks it starts after rank
      // 0's F0 ended, up to how far apart the ranks' clocks start (each rank
      // starts its clock when it leaves a barrier: within a few milliseconds
      // on a loaded machine).
      double recv_end = -1, producer = -1;
      for (const auto& e : tl.events) {
        if (e.rank == 1 && e.action.op == hp::schedule::Op::RECV_F && e.action.microbatch == 0)
          recv_end = e.end;
        if (e.rank == 0 && e.action.op == hp::schedule::Op::F && e.action.microbatch == 0)
          producer = e.end;
      }
      EXPECT_GT(first_f_start, 0.0);
      EXPECT_GE(first_f_start + 1e-5,
                recv_end);  // the compute start is derived: microseconds apart
      EXPECT_GT(first_f_start + 10e-3, producer);
    }
  }
}

// The same training with point-to-point over shared memory (collectives on
// Gloo): interleaved-zb at p = 4 moves activations between all neighbours.
TEST(Pipeline, SharedMemoryPointToPointTrainsTheSame) {
  for (auto [schedule, p] : {std::make_pair(std::string("interleaved-zb"), 4),
                             std::make_pair(std::string("dualpipev"), 2)}) {
    TrainConfig c = tiny(schedule, p, schedule == "dualpipev" ? 6 : 8, "gpt");
    std::vector<TrainResult> results(p);
    hp::testing::run_ranks_as_threads(p, [&](int r, std::shared_ptr<hp::distributed::Comm> comm) {
      auto shm = hp::distributed::with_shared_memory_p2p(comm);
      EXPECT_EQ(shm->backend_name(), "gloo+shm");
      results[r] = hp::train::run_rank(c, shm);
    });
    expect_matches_reference(c, results);
    expect_runs_its_action_list(c, results);
  }
}

TEST(Pipeline, MlpWithSgdAndTiedGptHead) {
  TrainConfig c = tiny("zb-h1", 2, 4, "mlp");
  c.optimizer = "sgd";
  c.lr = 0.1;
  expect_matches_reference(c, run_threads(c));
  TrainConfig g = tiny("zbv", 2, 4, "gpt");
  g.model.tied_head = true;  // first and last chunk on rank 0: a local replica
  expect_matches_reference(g, run_threads(g));
  TrainConfig h = tiny("1f1b", 2, 4, "gpt");
  h.model.tied_head = true;  // first and last chunk on different ranks
  expect_matches_reference(h, run_threads(h));
}

TEST(Pipeline, RecomputeGivesTheSameTrainingWithOneRecomputePerBlock) {
  for (std::string name : {"zb-h1", "zbv", "1f1b"}) {
    TrainConfig c = tiny(name, 2, 4, "gpt");
    c.recompute = true;
    hp::recompute::reset_counters();
    auto ranks = run_threads(c);
    expect_matches_reference(c, ranks);
    auto counts = hp::recompute::counters();
    // Every block of every microbatch, once per step: never twice.
    const int64_t blocks = c.model.layers * c.microbatches * c.steps;
    EXPECT_EQ(counts.recomputes, blocks) << name;
    EXPECT_EQ(hp::recompute::num_sessions(), 0u) << name << ": sessions left behind";
  }
}

TEST(Pipeline, BadConfigurationsFailBeforeAnyRankStarts) {
  auto expect_invalid = [](TrainConfig c, const std::string& fragment) {
    try {
      c.validate();
      ADD_FAILURE() << "expected an error containing '" << fragment << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  TrainConfig c = tiny("1f1b", 4, 8, "gpt");
  c.model.layers = 2;
  expect_invalid(c, "cuttable layers");
  c = tiny("no-such-schedule", 2, 4, "gpt");
  expect_invalid(c, "no-such-schedule");
  c = tiny("dualpipe", 4, 2, "gpt");
  expect_invalid(c, "microbatches");
  c = tiny("1f1b", 2, 4, "gpt");
  c.optimizer = "lamb";
  expect_invalid(c, "unknown optimizer");
  c = tiny("1f1b", 2, 4, "gpt");
  c.data = "/no/such/file";
  expect_invalid(c, "does not exist");
}

// Pipeline x data parallel (NOTE [Pipeline x data parallel]): p = 2 x dp = 2
// ranks as threads over real Gloo, every schedule; each copy trains on its
// half of the global batch, and losses and every copy's parameters equal one
// process training on all dp x m microbatches.
class DataParallelPipelines : public ::testing::TestWithParam<Case> {};

TEST_P(DataParallelPipelines, EqualOneProcessOnTheGlobalBatch) {
  const Case& k = GetParam();
  TrainConfig c = tiny(k.schedule, k.p, k.m, "gpt");
  c.dp = 2;
  auto ranks = run_threads(c);
  TrainConfig whole = c;
  whole.dp = 1;
  whole.microbatches = c.dp * c.microbatches;
  TrainResult ref = hp::train::train_reference(whole);
  auto sched = c.build_schedule();
  for (int r = 0; r < c.nproc * c.dp; ++r) {
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
    std::vector<hp::schedule::Action> expected;
    for (const auto& a : sched.actions[r % c.nproc])  // its rank in its pipeline
      if (hp::schedule::is_compute(a.op)) expected.push_back(a);
    EXPECT_EQ(ranks[r].executed, expected);
  }
  EXPECT_NEAR(ranks[0].checksum, ref.checksum, 1e-9 * std::max(1.0, std::abs(ref.checksum)));
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, DataParallelPipelines, ::testing::ValuesIn(all_cases({2})),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n = info.param.schedule + "_p2_dp2";
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(DataParallelPipelines, BadMeshesAreRefusedBeforeAnyWork) {
  TrainConfig c = tiny("1f1b", 2, 4, "gpt");
  c.dp = 0;
  EXPECT_THROW(c.validate(), std::invalid_argument);
  c.dp = 5000;
  EXPECT_THROW(c.validate(), std::invalid_argument);
  c.dp = 2;
  c.graph = true;
  try {
    c.validate();
    ADD_FAILURE() << "--graph with --dp must be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("drop --dp"), std::string::npos) << e.what();
  }
  // A world that is not pp x dp: every rank refuses before communicating.
  c.graph = false;
  try {
    hp::testing::run_ranks_as_threads(
        3, [&](int, std::shared_ptr<hp::distributed::Comm> comm) { hp::train::run_rank(c, comm); });
    ADD_FAILURE() << "a world of 3 for pp 2 x dp 2 must be refused";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--pp 2 x --dp 2"), std::string::npos) << e.what();
  }
}

}  // namespace
