// A Pipeline agrees once (NOTE [Ranks agree on the pipeline] in
// hp/pipeline/agreement.cpp): the collectives its construction makes, counted
// on the pipeline's group and on the data-parallel group, and the ranks'
// common failure when one rank could not make its pipeline or its executor.
// And the step's owner hooks (PipelineOptions::before_step / after_step):
// where a step calls them, and on a failed step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/pipeline.h"
#include "hp/schedule/generators.h"
#include "tests/common/forwarding_comm.h"
#include "tests/common/threads_as_ranks.h"

namespace {

using hp::distributed::Comm;

// Counts what a group is asked to do; point-to-point goes through batch().
class CountingComm : public hp::testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  std::vector<hp::distributed::Work> batch(
      const std::vector<hp::distributed::P2POp>& ops) override {
    ++batches;
    return ForwardingComm::batch(ops);
  }
  void all_reduce(const at::Tensor& t, hp::distributed::ReduceOp op) override {
    ++collectives;
    ForwardingComm::all_reduce(t, op);
  }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    ++collectives;
    ForwardingComm::all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override {
    ++collectives;
    ForwardingComm::broadcast(t, root);
  }
  void barrier() override {
    ++collectives;
    ForwardingComm::barrier();
  }
  std::atomic<int> collectives{0};
  std::atomic<int> batches{0};
};

// A two-chunk float64 model: chunk c is x -> tanh(x W_c).
std::map<int, hp::pipeline::ChunkModule> chunks_of(const hp::schedule::Schedule& s, int rank) {
  std::map<int, hp::pipeline::ChunkModule> chunks;
  for (int st : s.stages_of_rank(rank)) {
    const int c = s.stage_chunk[st];
    torch::manual_seed(c);
    auto w = torch::randn({4, 4}, torch::kFloat64).requires_grad_();
    hp::pipeline::ChunkModule m;
    m.forward = [w](const torch::Tensor& x) { return torch::tanh(x.matmul(w)); };
    m.parameters = {w};
    chunks[c] = m;
  }
  return chunks;
}

hp::pipeline::PipelineOptions options_of() {
  hp::pipeline::PipelineOptions o;
  o.dtype = torch::kFloat64;
  o.p2p = "group";  // the rings would add their own agreement (NOTE [Ranks agree on the rings])
  o.input = [](int mb) { return torch::full({2, 4}, 0.1 * (mb + 1), torch::kFloat64); };
  o.activation_shape = [](int, int) { return std::vector<int64_t>{2, 4}; };
  return o;
}

hp::pipeline::LossFn loss_of() {
  return [](const torch::Tensor& out, int) { return out.pow(2).sum(); };
}

TEST(PipelineAgreement, ConstructionAgreesOnceOverTheGroupAndOnceOverDp) {
  const auto sched = hp::schedule::build("1f1b", 2, 4);
  // pp 2 x dp 2 as four threads: pipelines {0, 1} and {2, 3}, copies {0, 2}
  // and {1, 3}.
  std::vector<int> group_collectives(4), dp_collectives(4), group_batches(4);
  hp::testing::run_ranks_as_threads(4, [&](int r, std::shared_ptr<Comm> world) {
    const int pp_rank = r % 2, copy = r / 2;
    auto group = std::make_shared<CountingComm>(world->split({2 * copy, 2 * copy + 1}));
    auto dp = std::make_shared<CountingComm>(world->split({pp_rank, pp_rank + 2}));
    auto options = options_of();
    options.dp = dp;
    hp::pipeline::Pipeline pipeline(sched, group, chunks_of(sched, pp_rank), loss_of(), options);
    group_collectives[r] = group->collectives;
    dp_collectives[r] = dp->collectives;
    group_batches[r] = group->batches;
    // The pipeline so made trains: the step's loss is the same on every rank.
    const double loss = pipeline.step().loss;
    EXPECT_GT(loss, 0.0);
  });
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    // The agreement, and the exchange of parameter names (which says too
    // whether each rank made its executor): no third collective.
    EXPECT_EQ(group_collectives[r], 2);
    EXPECT_EQ(dp_collectives[r], 1);  // the copies' agreement only
    EXPECT_EQ(group_batches[r], 0);   // no point-to-point before the first step
  }
}

TEST(PipelineAgreement, ARankThatCannotMakeItsPipelineOrExecutorFailsEveryRank) {
  const auto sched = hp::schedule::build("1f1b", 2, 4);
  for (const std::string what : {"pipeline", "executor"}) {
    SCOPED_TRACE(what);
    std::vector<std::string> errors(2);
    hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> group) {
      auto chunks = chunks_of(sched, r);
      auto options = options_of();
      if (r == 1 && what == "pipeline") chunks.clear();  // no module for its chunk
      if (r == 1 && what == "executor") options.receive_lookahead = -1;
      try {
        hp::pipeline::Pipeline pipeline(sched, group, chunks, loss_of(), options);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
    EXPECT_NE(errors[1].find(what == "pipeline" ? "no module was given for chunk 1"
                                                : "receive_lookahead is -1"),
              std::string::npos)
        << errors[1];
    EXPECT_NE(errors[0].find("rank 0: rank 1 could not make its " + what), std::string::npos)
        << errors[0];
  }
}

// The peers of a pair post alike only where their pairs run alike: ranks
// given other overlap options fail together when the Pipeline is made,
// naming the options of both, over the group and over dp.
TEST(PipelineAgreement, RanksWhosePairsRunOtherwiseFailEveryRank) {
  const auto sched = hp::schedule::build("dualpipev", 2, 4);
  for (const std::string over : {"group", "dp"}) {
    SCOPED_TRACE(over);
    std::vector<std::string> errors(4);
    hp::testing::run_ranks_as_threads(4, [&](int r, std::shared_ptr<Comm> world) {
      const int pp_rank = r % 2, copy = r / 2;
      std::shared_ptr<Comm> group = world->split({2 * copy, 2 * copy + 1});
      auto options = options_of();
      options.dp = world->split({pp_rank, pp_rank + 2});
      options.fb_overlap = true;
      // group: the second rank of each copy; dp: all of copy 1.
      if (over == "group" ? pp_rank == 1 : copy == 1) options.pair_first_ready = true;
      try {
        hp::pipeline::Pipeline pipeline(sched, group, chunks_of(sched, pp_rank), loss_of(),
                                        options);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
    // Rank 0 names its peer (rank 1 of the group, or of dp) by what differs.
    EXPECT_NE(errors[0].find("rank 0: rank 1's pairs run with fb_overlap 1, defer_wgrad 0, "
                             "ready turns 1, W parts 1 where this rank's run with fb_overlap 1, "
                             "defer_wgrad 0, ready turns 0"),
              std::string::npos)
        << errors[0];
    for (int r = 0; r < 4; ++r)
      EXPECT_NE(errors[r].find("every rank must be given the same fb_overlap"), std::string::npos)
          << r << ": " << errors[r];
  }
}

TEST(PipelineStepHooks, AroundEveryStepWithWholeGradientsAndOnAFailedStep) {
  const auto sched = hp::schedule::build("zb-h1", 2, 4);
  std::vector<std::vector<std::string>> log(2);
  std::vector<std::string> errors(2);
  hp::testing::run_ranks_as_threads(
      2,
      [&](int r, std::shared_ptr<Comm> world) {
        auto group = std::make_shared<CountingComm>(world);
        auto chunks = chunks_of(sched, r);
        const torch::Tensor w = chunks.begin()->second.parameters[0];
        std::atomic<bool> fail{false};
        chunks.begin()->second.forward = [w, &fail](const torch::Tensor& x) {
          if (fail) throw std::runtime_error("this forward fails");
          return torch::tanh(x.matmul(w));
        };
        auto options = options_of();
        int collectives_at_after = -1;
        options.before_step = [&] {
          log[r].push_back(w.grad().defined() ? "before, with a gradient" : "before");
        };
        options.after_step = [&](bool ok) {
          collectives_at_after = group->collectives;
          // After the last W: the weight's gradient of every microbatch is in.
          log[r].push_back(std::string(ok ? "after ok" : "after failed") +
                           (w.grad().defined() && w.grad().abs().sum().item<double>() > 0
                                ? ", with a gradient"
                                : ""));
        };
        hp::pipeline::Pipeline pipeline(sched, group, chunks, loss_of(), options);
        for (int step = 0; step < 2; ++step) {
          pipeline.step();
          // The loss's reduction (one all-reduce over the group) comes after.
          EXPECT_EQ(group->collectives, collectives_at_after + 1) << "rank " << r;
          w.mutable_grad() = torch::Tensor();
        }
        fail = true;
        try {
          pipeline.step();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      },
      std::chrono::seconds(5));
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_NE(errors[r], "") << "the step did not fail";
    const std::vector<std::string> want = {"before", "after ok, with a gradient",
                                           "before", "after ok, with a gradient",
                                           "before", "after failed"};
    ASSERT_EQ(log[r].size(), want.size());
    for (size_t k = 0; k < want.size(); ++k)
      EXPECT_EQ(log[r][k].substr(0, want[k].size()), want[k]) << k;
  }
  EXPECT_NE(errors[0].find("this forward fails"), std::string::npos) << errors[0];
}

TEST(PipelineStepHooks, AFailedBeforeStepFailsTheStepWithoutAfterStep) {
  const auto sched = hp::schedule::build("1f1b", 2, 2);
  std::vector<std::string> errors(2);
  std::atomic<int> afters{0};
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> group) {
    auto options = options_of();
    options.before_step = [] { throw std::runtime_error("the owner could not unshard"); };
    options.after_step = [&](bool) { ++afters; };
    hp::pipeline::Pipeline pipeline(sched, group, chunks_of(sched, r), loss_of(), options);
    try {
      pipeline.step();
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
    EXPECT_TRUE(pipeline.broken());
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("the owner could not unshard"), std::string::npos) << errors[r];
  EXPECT_EQ(afters, 0);
}

}  // namespace
