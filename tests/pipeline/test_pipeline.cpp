// The pipeline runtime against its oracle: for every schedule, ranks as
// threads over real Gloo (a FileStore rendezvous; p = 2), and through the
// stream-ordered transport (p = 2 and 4), train a float64 model; losses and
// final parameters must equal single-process gradient accumulation, and each
// rank must run exactly its action list.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "hp/distributed/comm.h"
#include "hp/distributed/mesh.h"
#include "hp/pipeline/executor.h"
#include "hp/pipeline/stage.h"
#include "hp/recompute/session.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/train/trainer.h"
#include "tests/common/forwarding_comm.h"
#include "tests/common/threads_as_ranks.h"
#include "tests/pipeline/tiny_train.h"

using hp::testing::expect_copies_equal_the_reference;
using hp::testing::run_threads;
using hp::testing::tiny;
using hp::train::TrainConfig;
using hp::train::TrainResult;

namespace {

// Runs every rank of `config` on its own thread; rethrows a rank's error.
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
      // Stage 1's F0 waits for its input: its compute starts when its
      // receive's wait ended (same clock, the same mark), and across ranks
      // it starts after rank 0's F0 ended, up to how far apart the ranks'
      // clocks start (each rank starts its clock when it leaves a barrier:
      // within a few milliseconds on a loaded machine).
      double recv_end = -1, producer = -1;
      for (const auto& e : tl.events) {
        if (e.rank == 1 && e.action.op == hp::schedule::Op::RECV_F && e.action.microbatch == 0)
          recv_end = e.end;
        if (e.rank == 0 && e.action.op == hp::schedule::Op::F && e.action.microbatch == 0)
          producer = e.end;
      }
      EXPECT_GT(first_f_start, 0.0);
      EXPECT_GE(first_f_start, recv_end);
      EXPECT_LT(first_f_start, recv_end + 1e-5);  // nothing runs between them
      EXPECT_GT(first_f_start + 10e-3, producer);
    }
  }
}

// NOTE [Receives posted ahead]: a Comm that records the receive buffers'
// shapes of each batch it is given, in order, and passes everything to Gloo.
class RecvRecorder : public hp::testing::ForwardingComm {
 public:
  RecvRecorder(std::shared_ptr<Comm> inner, bool free)
      : ForwardingComm(std::move(inner)), free_(free) {}
  std::string backend_name() const override { return inner_->backend_name() + "+recorded"; }
  bool early_receives_are_free() const override { return free_; }
  std::vector<hp::distributed::Work> batch(
      const std::vector<hp::distributed::P2POp>& ops) override {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& op : ops)
      if (op.kind == hp::distributed::P2POp::Kind::Recv) shapes.push_back(op.tensor.sizes().vec());
    batches.push_back(shapes);
    return inner_->batch(ops);
  }
  std::vector<std::vector<std::vector<int64_t>>> batches;  // each batch's receive shapes

 private:
  bool free_;
};

// A chain of stages s = 0, 1, ...: tanh(x @ w_s) with w_s of shape
// [8 + s, 9 + s], so that a buffer's shape names its stage; microbatch mb has
// 1 + mb rows, so that it names its microbatch too.
torch::Tensor chain_weight(int s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s);
  return (at::randn({8 + s, 9 + s}, gen, torch::kFloat64) / 3).requires_grad_(true);
}
torch::Tensor chain_input(int mb) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + mb);
  return at::randn({1 + mb, 8}, gen, torch::kFloat64);
}
std::vector<int64_t> chain_shape(int stage, int mb) {
  return {1 + mb, 9 + stage};
}

// Rank r's stages of the chain (their weights in `w`), the loss the mean
// over m microbatches of sum(y^2), and the executor's options for it.
struct ChainRank {
  std::map<int, torch::Tensor> w;
  hp::pipeline::PipelineStage stage;
  ChainRank(const hp::schedule::Schedule& sched, int r, int m)
      : stage(modules(sched, r, w),
              [m](const torch::Tensor& y, int) { return y.pow(2).sum() / m; }) {}
  static hp::pipeline::ExecutorOptions options() {
    hp::pipeline::ExecutorOptions opts;
    opts.input = chain_input;
    opts.activation_shape = chain_shape;
    opts.dtype = torch::kFloat64;
    return opts;
  }

 private:
  static std::map<int, hp::pipeline::StageModule> modules(const hp::schedule::Schedule& sched,
                                                          int r, std::map<int, torch::Tensor>& w) {
    std::map<int, hp::pipeline::StageModule> out;
    for (int s : sched.stages_of_rank(r)) {
      torch::Tensor ws = w[s] = chain_weight(s);
      out[s] = {[ws](const torch::Tensor& x) { return torch::tanh(x.matmul(ws)); }, {ws}, {}};
    }
    return out;
  }
};

// The receive shapes of each batch the executor should post with `lookahead`:
// a batch's own actions not posted yet, then the receives of the next
// `lookahead` batches not posted yet (NOTE [Receives posted ahead]).
std::vector<std::vector<std::vector<int64_t>>> expected_batches(const hp::schedule::Schedule& s,
                                                                int rank, int lookahead) {
  using hp::schedule::Op;
  const auto& acts = s.actions[rank];
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < acts.size();) {
    size_t j = i;
    while (j < acts.size() && hp::schedule::is_comm(acts[j].op))
      ++j;
    if (j > i) runs.emplace_back(i, j);
    i = std::max(j, i + 1);
  }
  auto shape = [&](const hp::schedule::Action& a) {
    const bool fwd = a.op == Op::RECV_F;
    return chain_shape(fwd ? s.prev_stage(a.stage, a.microbatch) : a.stage, a.microbatch);
  };
  auto is_recv = [](const hp::schedule::Action& a) {
    return a.op == Op::RECV_F || a.op == Op::RECV_B;
  };
  std::set<size_t> posted;
  std::vector<std::vector<std::vector<int64_t>>> out;
  for (size_t b = 0; b < runs.size(); ++b) {
    std::vector<size_t> call;
    for (size_t k = runs[b].first; k < runs[b].second; ++k)
      if (!posted.count(k)) call.push_back(k);
    for (size_t ahead = b + 1; ahead <= b + lookahead && ahead < runs.size(); ++ahead)
      for (size_t k = runs[ahead].first; k < runs[ahead].second; ++k)
        if (is_recv(acts[k]) && posted.insert(k).second) call.push_back(k);
    if (call.empty()) continue;
    std::vector<std::vector<int64_t>> shapes;
    for (size_t k : call)
      if (is_recv(acts[k])) shapes.push_back(shape(acts[k]));
    out.push_back(shapes);
  }
  return out;
}

// Receives posted ahead change only when a receive is posted: each channel's
// receives keep their list order, every batch posts exactly what it should,
// and two steps of training give the gradients of plain autograd (twice: the
// second step starts over). Two ranks as threads over Gloo; schedules with one
// and two stages per rank, a rank receiving both directions' messages from
// one peer (zbv, interleaved-1f1b).
TEST(Executor, ReceivesPostedAheadKeepEveryChannelsOrder) {
  const int m = 6;
  for (const std::string name : {"zb-h1", "zbv", "interleaved-1f1b"}) {
    const auto sched = hp::schedule::lower(hp::schedule::build(name, 2, m));
    const int S = sched.num_stages;
    // Plain autograd: the whole chain, the mean over microbatches of sum(y^2).
    std::vector<torch::Tensor> ref_w, ref_grad;
    for (int s = 0; s < S; ++s)
      ref_w.push_back(chain_weight(s));
    torch::Tensor loss = torch::zeros({}, torch::kFloat64);
    for (int mb = 0; mb < m; ++mb) {
      torch::Tensor h = chain_input(mb);
      for (int s = 0; s < S; ++s)
        h = torch::tanh(h.matmul(ref_w[s]));
      loss = loss + h.pow(2).sum() / m;
    }
    for (auto& g : torch::autograd::grad({loss}, ref_w))
      ref_grad.push_back(g);
    for (int lookahead : {0, 1, 3}) {
      SCOPED_TRACE(name + " lookahead " + std::to_string(lookahead));
      std::vector<std::vector<std::vector<std::vector<int64_t>>>> recorded(2);
      std::map<int, torch::Tensor> grads;
      std::vector<double> loss_sums(2, 0.0);
      std::mutex mu;
      hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<hp::distributed::Comm> c) {
        auto rec = std::make_shared<RecvRecorder>(c, true);
        ChainRank chain(sched, r, m);
        hp::pipeline::ExecutorOptions opts = chain.options();
        opts.receive_lookahead = lookahead;
        hp::pipeline::Executor executor(sched, r, chain.stage, rec, opts);
        double l = 0;
        for (int step = 0; step < 2; ++step) {
          rec->batches.clear();
          l += executor.run_step().loss_sum;
        }
        std::lock_guard<std::mutex> lock(mu);
        recorded[r] = rec->batches;  // the second step's
        loss_sums[r] = l;
        for (auto& [s, ws] : chain.w)
          grads[s] = ws.grad();
      });
      for (int r = 0; r < 2; ++r)
        EXPECT_EQ(recorded[r], expected_batches(sched, r, lookahead)) << "rank " << r;
      EXPECT_NEAR(loss_sums[0] + loss_sums[1], 2 * loss.item<double>(), 1e-12);
      ASSERT_EQ(int(grads.size()), S);
      for (int s = 0; s < S; ++s)
        EXPECT_TRUE(torch::allclose(grads[s], 2 * ref_grad[s], 1e-12, 1e-12)) << "stage " << s;
    }
  }
}

// A failed action's error names the rank and the action and ends with the
// rank's actions around it, the failed one in brackets (NOTE [The actions
// around a failure] in hp/pipeline/executor.cpp); each action is a range that
// torch.profiler sees ("hp::0F1": stage 0's F of microbatch 1).
std::vector<std::string>* g_ranges = nullptr;

TEST(Executor, AFailedActionShowsTheActionsAroundItAndActionsAreProfilerRanges) {
  hp::testing::run_ranks_as_threads(1, [&](int r, std::shared_ptr<hp::distributed::Comm> c) {
    const auto sched = hp::schedule::lower(hp::schedule::build("1f1b", 1, 4));
    int calls = 0;
    bool fail = false;
    std::map<int, hp::pipeline::StageModule> modules;
    torch::Tensor w = chain_weight(0);
    modules[0] = {[&, w](const torch::Tensor& x) {
                    if (fail && ++calls == 3) throw std::runtime_error("the third forward broke");
                    return torch::tanh(x.matmul(w));
                  },
                  {w},
                  {}};
    hp::pipeline::PipelineStage stage(modules,
                                      [](const torch::Tensor& y, int) { return y.pow(2).sum(); });
    hp::pipeline::ExecutorOptions opts;
    opts.input = chain_input;
    opts.activation_shape = chain_shape;
    opts.dtype = torch::kFloat64;
    hp::pipeline::Executor executor(sched, r, stage, c, opts);

    std::vector<std::string> ranges;
    g_ranges = &ranges;
    auto handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                       -> std::unique_ptr<at::ObserverContext> {
          const std::string name = fn.name();
          if (name.rfind("hp::", 0) == 0) g_ranges->push_back(name);
          return nullptr;
        }).scopes({at::RecordScope::USER_SCOPE}));
    const auto stats = executor.run_step();
    at::removeCallback(handle);
    g_ranges = nullptr;
    std::vector<std::string> expected;
    for (const auto& a : stats.executed)
      expected.push_back("hp::" + hp::schedule::to_string(a));
    EXPECT_EQ(ranges, expected);
    EXPECT_EQ(int(ranges.size()), 2 * 4) << "F and B of 4 microbatches";

    fail = true;
    try {
      executor.run_step();
      ADD_FAILURE() << "the broken forward did not fail the step";
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("rank 0 action 0F2: the third forward broke"), std::string::npos) << msg;
      std::string listed = "rank 0's actions ";
      EXPECT_NE(msg.find(listed), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0F2]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("0F1"), std::string::npos) << "the actions before it: " << msg;
    }
  });
}

// None are posted ahead by default, and a Comm whose operations may run in
// posting order (NCCL's stream) refuses them when asked for.
TEST(Executor, ReceivesPostedAheadOnlyWhereTheCommSaysFree) {
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<hp::distributed::Comm> c) {
    EXPECT_TRUE(c->early_receives_are_free()) << "Gloo";
    EXPECT_FALSE(hp::distributed::with_stream_ordered_p2p(c)->early_receives_are_free());
    auto rec = std::make_shared<RecvRecorder>(c, false);
    const auto sched = hp::schedule::lower(hp::schedule::build("1f1b", 2, 4));
    std::map<int, hp::pipeline::StageModule> modules;
    torch::Tensor w = chain_weight(r);
    modules[r] = {[w](const torch::Tensor& x) { return torch::tanh(x.matmul(w)); }, {w}, {}};
    hp::pipeline::PipelineStage stage(modules,
                                      [](const torch::Tensor& y, int) { return y.pow(2).sum(); });
    hp::pipeline::ExecutorOptions opts;
    opts.input = chain_input;
    opts.activation_shape = chain_shape;
    opts.dtype = torch::kFloat64;
    hp::pipeline::Executor executor(sched, r, stage, rec, opts);  // default: none ahead
    executor.run_step();
    EXPECT_EQ(rec->batches, expected_batches(sched, r, 0));
    auto free = std::make_shared<RecvRecorder>(c, true);
    hp::pipeline::Executor on_free(sched, r, stage, free, opts);  // free, still none by default
    on_free.run_step();
    EXPECT_EQ(free->batches, expected_batches(sched, r, 0));
    opts.receive_lookahead = 1;
    try {
      hp::pipeline::Executor refused(sched, r, stage, rec, opts);
      ADD_FAILURE() << "receive_lookahead 1 accepted on a Comm that does not say it is free";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("receive_lookahead is 1"), std::string::npos)
          << e.what();
    }
    opts.receive_lookahead = -1;
    EXPECT_THROW(hp::pipeline::Executor(sched, r, stage, c, opts), c10::Error);
  });
}

// The same training with each point-to-point (--p2p; collectives on Gloo):
// interleaved-zb at p = 4 moves activations between all neighbours; "auto"
// (the default, in every other test here) makes the rings as "shm" does.
TEST(Pipeline, EachPointToPointTrainsTheSame) {
  for (auto [schedule, p] : {std::make_pair(std::string("interleaved-zb"), 4),
                             std::make_pair(std::string("dualpipev"), 2)}) {
    for (std::string p2p : {"shm", "group", "auto"}) {
      SCOPED_TRACE(schedule + " --p2p " + p2p);
      TrainConfig c = tiny(schedule, p, schedule == "dualpipev" ? 6 : 8, "gpt");
      c.p2p = p2p;
      std::vector<TrainResult> results(p);
      hp::testing::run_ranks_as_threads(p, [&](int r, std::shared_ptr<hp::distributed::Comm> comm) {
        results[r] = hp::train::run_rank(c, comm);
      });
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(results[r].p2p_backend, p2p == "group" ? "gloo" : "gloo+shm") << "rank " << r;
        EXPECT_EQ(results[r].p2p_note, "") << "rank " << r;
      }
      expect_matches_reference(c, results);
      expect_runs_its_action_list(c, results);
    }
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
// process training on all dp x m microbatches (every rank's parameters, by
// model-wide name, and the whole model's checksum: tiny_train.h).
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
  expect_copies_equal_the_reference(ranks, ref);
  auto sched = c.build_schedule();
  for (int r = 0; r < c.nproc * c.dp; ++r) {
    SCOPED_TRACE("world rank " + std::to_string(r));
    std::vector<hp::schedule::Action> expected;
    for (const auto& a : sched.actions[r % c.nproc])  // its rank in its pipeline
      if (hp::schedule::is_compute(a.op)) expected.push_back(a);
    EXPECT_EQ(ranks[r].executed, expected);
  }
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, DataParallelPipelines, ::testing::ValuesIn(all_cases({2})),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n = info.param.schedule + "_p2_dp2";
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// --model moe --ep 2 (hp/moe): the copies of the pipeline hold different
// experts of every MoE layer, tokens cross between them in each layer's
// all-to-alls, and the result equals one process with every expert local on
// the global batch: losses, every parameter a rank holds (its experts among
// them), the whole model's checksum.
class ExpertParallelPipelines : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertParallelPipelines, EqualOneProcessWithEveryExpertLocal) {
  const Case& k = GetParam();
  TrainConfig c = tiny(k.schedule, k.p, k.m, "gpt");
  c.model.experts = 4;
  c.model.top_k = 2;
  c.dp = c.ep = 2;
  auto ranks = run_threads(c);
  TrainConfig whole = c;
  whole.dp = whole.ep = 1;
  whole.microbatches = c.dp * c.microbatches;
  TrainResult ref = hp::train::train_reference(whole);
  expect_copies_equal_the_reference(ranks, ref);
  for (const auto& rank : ranks) {
    int experts = 0;
    for (const auto& item : rank.parameters)
      experts += item.first.find(".moe.expert") != std::string::npos;
    EXPECT_GT(experts, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, ExpertParallelPipelines,
                         ::testing::Values(Case{"1f1b", 2, 4}, Case{"zb-h1", 2, 4},
                                           Case{"zbv", 2, 4}, Case{"dualpipev", 2, 6},
                                           Case{"interleaved-1f1b", 2, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string n = info.param.schedule + "_p2_ep2";
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// --ep 2 --dp 4: two EP groups of two copies each; the copies holding the
// same experts (one in each EP group) sum their gradients before the
// division by the four copies (NOTE [Expert gradients]).
// With --fsdp (ep 2 x dp 2, and dp 4): the plain parameters sharded over the
// copies, the experts stepped whole.
TEST(ExpertParallelPipelines, FewerExpertRanksThanCopiesAndFsdpEqualOneProcess) {
  struct Run {
    std::string schedule;
    int dp;
    bool fsdp, overlap = false;
  };
  for (const Run& run : {Run{"zb-h1", 4, false}, Run{"dualpipev", 4, false}, Run{"zbv", 2, true},
                         Run{"1f1b", 4, true}, Run{"dualpipev", 2, true, true}}) {
    SCOPED_TRACE(run.schedule + " dp " + std::to_string(run.dp) + (run.fsdp ? " fsdp" : "") +
                 (run.overlap ? " fb-overlap" : ""));
    TrainConfig c = tiny(run.schedule, 2, run.schedule == "dualpipev" ? 6 : 4, "gpt");
    c.model.experts = 4;
    c.model.top_k = 2;
    c.ep = 2;
    c.dp = run.dp;
    c.fsdp = run.fsdp;
    c.fb_overlap = run.overlap;  // FSDP's shards around overlapped pairs
    auto ranks = run_threads(c);
    TrainConfig whole = c;
    whole.dp = whole.ep = 1;
    whole.microbatches = c.dp * c.microbatches;
    expect_copies_equal_the_reference(ranks, hp::train::train_reference(whole));
  }
  TrainConfig bad = tiny("1f1b", 2, 4, "gpt");
  bad.model.experts = 4;
  bad.ep = 2;
  bad.dp = 3;
  try {
    bad.validate();
    ADD_FAILURE() << "--ep 2 --dp 3 must be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("make dp a multiple of ep (--ep, --dp)"),
              std::string::npos)
        << e.what();
  }
}

// NOTE [The training mesh]: hp train's and hyperparallel.pipeline.mesh's.
TEST(TrainingMesh, LaysOutEdpEpPpAndSaysWhatToChange) {
  const auto shape = hp::distributed::training_mesh(16, 2, 8, 4);
  EXPECT_EQ(shape.names, (std::vector<std::string>{"edp", "ep", "pp"}));
  EXPECT_EQ(shape.sizes, (std::vector<int>{2, 4, 2}));
  auto error = [](int world, int pp, int dp, int ep) {
    try {
      hp::distributed::training_mesh(world, pp, dp, ep);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error(6, 2, 3, 2).find("ep 2 does not divide dp 3"), std::string::npos);
  EXPECT_NE(error(8, 2, 2, 1).find("pp 2 x dp 2 is 4 ranks but the world has 8"),
            std::string::npos);
  EXPECT_NE(error(2, 0, 2, 1).find("at least 1"), std::string::npos);
}

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
