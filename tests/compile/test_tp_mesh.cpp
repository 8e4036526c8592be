// Graph mode on a device mesh (issue 16, seed 002's test_tpsp), float64
// against plain autograd / single-process eager training: the TP operators'
// forward and backward, their capture and replay; FSDP over a 2-rank
// subgroup of a 4-rank world; tp = 2 x dp = 2 as threads and as 4 real
// processes (tp_mesh_worker); mesh errors before any work; graph mode with
// checkpointed blocks (--graph --recompute).
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>

#include "hp/compile/capture.h"
#include "hp/compile/graph_trainer.h"
#include "hp/compile/tp_ops.h"
#include "hp/core/memory.h"
#include "hp/distributed/mesh.h"
#include "hp/launch/launcher.h"
#include "hp/models/tp_models.h"
#include "tests/common/threads_as_ranks.h"
#include "tests/compile/test_models.h"
#include "tests/compile/tp_mesh_case.h"

using namespace hp::compile;
using hp::distributed::Comm;
using hp::distributed::DeviceMesh;
using hp::distributed::MeshShape;
using hp_test::expect_close;
using hp_test::kF64;

namespace {

std::string temp_dir(const std::string& stem) {
  static int counter = 0;
  auto p = std::filesystem::temp_directory_path() / ("hp-tp-mesh-" + std::to_string(::getpid()) +
                                                     "-" + stem + "-" + std::to_string(counter++));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

// ---------------------------------------------------------------------------
// The TP operators

// A two-layer MLP split Megatron's way over a TP group: fc1 column-parallel
// (rows of W1), fc2 row-parallel (columns of W2), x -> f -> fc1 -> tanh ->
// fc2 -> g. With rank = 0 and size = 1 it is the whole MLP.
struct TpMlpImpl : torch::nn::Module {
  TpMlpImpl(const torch::Tensor& w1, const torch::Tensor& w2, int64_t rank, int64_t size,
            std::string group)
      : group(std::move(group)), size(size) {
    this->w1 = register_parameter("w1", w1.chunk(size, 0)[rank].clone());
    this->w2 = register_parameter("w2", w2.chunk(size, 1)[rank].contiguous().clone());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto a = size > 1 ? tp_copy(x, group) : x;
    auto y = torch::matmul(torch::tanh(torch::matmul(a, w1.t())), w2.t());
    return size > 1 ? tp_reduce(y, group) : y;
  }
  std::string group;
  int64_t size;
  torch::Tensor w1, w2;
};
TORCH_MODULE(TpMlp);

TEST(TpOps, ForwardBackwardAndReplayMatchAutogradOfTheWholeModel) {
  torch::manual_seed(3);
  auto w1 = torch::randn({8, 5}, kF64) * 0.4, w2 = torch::randn({3, 8}, kF64) * 0.4;
  std::vector<torch::Tensor> xs{torch::randn({4, 5}, kF64), torch::randn({4, 5}, kF64)};
  auto ys = torch::randn({4, 3}, kF64);
  // The oracle: plain autograd on the whole MLP, gradients also wrt x.
  TpMlp whole(w1, w2, 0, 1, "");
  auto loss_of = [&](TpMlp& m, const torch::Tensor& x) {
    return torch::mse_loss(m->forward(x), ys);
  };
  std::vector<torch::Tensor> want_loss, want_w1, want_w2, want_x;
  for (const auto& x0 : xs) {
    auto x = x0.clone().requires_grad_(true);
    auto l = loss_of(whole, x);
    auto g = torch::autograd::grad({l}, {whole->w1, whole->w2, x});
    want_loss.push_back(l.detach());
    want_w1.push_back(g[0]);
    want_w2.push_back(g[1]);
    want_x.push_back(g[2]);
  }
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> comm) {
    const std::string group = "tp-ops-rank" + std::to_string(r);
    register_tp_group(group, comm);
    TpMlp part(w1, w2, r, 2, group);
    // Eager: forward value and every gradient (x's through f's all-reduce).
    auto x = xs[0].clone().requires_grad_(true);
    auto l = loss_of(part, x);
    auto g = torch::autograd::grad({l}, {part->w1, part->w2, x});
    expect_close(l.detach(), want_loss[0], "loss (g's forward all-reduce)");
    expect_close(g[0], want_w1[0].chunk(2, 0)[r], "dW1 shard");
    expect_close(g[1], want_w2[0].chunk(2, 1)[r], "dW2 shard");
    expect_close(g[2], want_x[0], "dx (f's backward all-reduce)");
    // Captured: f and g in the forward; f's backward all-reduce (of dx) is
    // not in the train step's graph, whose input needs no gradient. Replayed
    // on the other batch, the collectives run again.
    TrainFn train = [&](torch::nn::Module& m, const torch::Tensor& in, const torch::Tensor& y) {
      return torch::mse_loss(static_cast<TpMlpImpl&>(m).forward(in), y);
    };
    Graph graph = capture_train_step(*part, train, xs[0], ys);
    EXPECT_EQ(graph.count_calls(kTpCopyOp), 1) << graph.str();
    EXPECT_EQ(graph.count_calls(kTpReduceOp), 1) << graph.str();
    auto outs = replay(graph, placeholder_values(graph, *part, xs[1], ys));
    expect_close(outs[0], want_loss[1], "replayed loss");
    expect_close(outs[1], want_w1[1].chunk(2, 0)[r], "replayed dW1 shard");
    expect_close(outs[2], want_w2[1].chunk(2, 1)[r], "replayed dW2 shard");
    unregister_tp_group(group);
  });
}

TEST(TpOps, UnknownGroupIsAClearError) {
  auto x = torch::ones({2}, kF64);
  auto m = error_of([&] { tp_reduce(x, "no-such-group"); });
  EXPECT_HAS(m, "TP group 'no-such-group' is not registered");
  EXPECT_HAS(m, "register_tp_group");
  EXPECT_HAS(error_of([&] { tp_copy(x, "no-such-group"); }), "is not registered");
}

// ---------------------------------------------------------------------------
// FSDP over a subgroup

// A 4-rank world as a dp = 2 x rep = 2 mesh: FSDP over each rank's dp slice
// ({0, 2} and {1, 3}), two independent replicas trained on the same batches.
// Each must equal single-process eager training, with shards of 1/2 (the
// subgroup), not 1/4 (the world).
TEST(FsdpSubgroup, TwoRankSlicesOfAFourRankWorldMatchEager) {
  torch::manual_seed(21);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  for (int s = 0; s < 3; ++s)
    data.emplace_back(torch::randn({8, 6}, kF64), torch::randn({8, 4}, kF64));
  OptimizerConfig opt;
  opt.lr = 0.01;
  opt.grad_clip = 0.05;
  auto fn = hp_test::mse_fn<hp_test::MlpImpl>();
  torch::manual_seed(15);
  hp_test::Mlp ref(6, 16, 4);
  std::vector<double> want;
  {
    torch::optim::Adam adam(ref->parameters(), torch::optim::AdamOptions(opt.lr));
    for (const auto& [x, y] : data) {
      adam.zero_grad();
      auto l = fn(*ref, x, y);
      l.backward();
      torch::nn::utils::clip_grad_norm_(ref->parameters(), opt.grad_clip);
      adam.step();
      want.push_back(l.item<double>());
    }
  }
  std::vector<hp_test::Mlp> models;
  for (int r = 0; r < 4; ++r) {
    torch::manual_seed(15);
    models.emplace_back(6, 16, 4);
  }
  struct Out {
    std::vector<double> losses;
    int dp = 0;
    int64_t degree = 0;
    std::vector<int64_t> collective_degrees;
  };
  std::vector<Out> outs(4);
  hp::testing::run_ranks_as_threads(4, [&](int r, std::shared_ptr<Comm> world) {
    auto mesh = std::make_shared<DeviceMesh>(world, MeshShape{{"dp", "rep"}, {2, 2}});
    MeshContext ctx;
    ctx.fsdp = mesh->group("dp");
    ctx.mesh = mesh;
    GraphTrainer trainer(models[r].ptr(), fn, PassConfig{}, std::nullopt, opt, ctx);
    const int d = mesh->coordinate("dp");
    for (const auto& [x, y] : data) {
      outs[r].losses.push_back(trainer.train_step(x.narrow(0, d * 4, 4), y.narrow(0, d * 4, 4)));
      trainer.optimizer_step();
    }
    outs[r].dp = d;
    outs[r].degree = trainer.config().fsdp_degree.value_or(0);
    for (const auto& n : trainer.graph().nodes())
      if (n.kind == NodeKind::Collective) outs[r].collective_degrees.push_back(n.degree);
  });
  // Slices {0, 2} and {1, 3}: dp coordinates 0 and 1 in each.
  EXPECT_EQ(outs[0].dp, 0);
  EXPECT_EQ(outs[2].dp, 1);
  EXPECT_EQ(outs[1].dp, 0);
  EXPECT_EQ(outs[3].dp, 1);
  auto ref_params = ref->parameters();
  for (int lo : {0, 1}) {
    const int hi = lo + 2;
    EXPECT_EQ(outs[lo].degree, 2);
    EXPECT_FALSE(outs[lo].collective_degrees.empty());
    for (int64_t deg : outs[lo].collective_degrees)
      EXPECT_EQ(deg, 2);
    for (size_t s = 0; s < want.size(); ++s)
      EXPECT_NEAR((outs[lo].losses[s] + outs[hi].losses[s]) / 2, want[s], 1e-12)
          << "slice " << lo << " step " << s;
    auto a = models[lo]->parameters(), b = models[hi]->parameters();
    for (size_t i = 0; i < ref_params.size(); ++i) {
      EXPECT_EQ(a[i].size(0) * 2, ref_params[i].size(0)) << "a shard is half of dim 0";
      expect_close(torch::cat({a[i], b[i]}, 0), ref_params[i],
                   "slice " + std::to_string(lo) + " param " + std::to_string(i), 1e-10);
    }
  }
}

// ---------------------------------------------------------------------------
// tp = 2 x dp = 2

// Puts every rank's local tensors back together (FSDP shards along dim 0 in
// dp order, then TP shards by the model's layout) and compares with the
// eager oracle; losses: the mean of the dp ranks' losses.
void expect_matches_reference(const hp_test::TpMeshCase& c,
                              const std::vector<hp_test::TpMeshRank>& ranks) {
  const auto ref = hp_test::tp_mesh_reference(c);
  ASSERT_EQ(int(ranks.size()), c.tp * c.dp);
  auto at = [&](int dp, int tp) -> const hp_test::TpMeshRank& {
    for (const auto& r : ranks)
      if (r.dp_rank == dp && r.tp_rank == tp) return r;
    throw std::runtime_error("no rank at dp " + std::to_string(dp) + ", tp " + std::to_string(tp));
  };
  for (const auto& r : ranks) {
    EXPECT_EQ(r.fsdp_degree, c.dp);
    EXPECT_EQ(r.tp_size, c.tp);
    // f before qkv and fc, g after proj and fc2 (forward), f's all-reduce
    // in the backward; a checkpointed block runs its forward twice, but its
    // recomputed g after fc2 makes only the block's output, which no
    // backward reads, so dead-code elimination drops it: one g per block.
    const int64_t L = c.spec.layers;
    EXPECT_EQ(r.tp_copy_calls, 2 * L * (c.recompute ? 2 : 1));
    EXPECT_EQ(r.tp_reduce_calls, 2 * L + (c.recompute ? L : 0) + 2 * L);
    for (size_t s = 0; s < ref.losses.size(); ++s)
      EXPECT_NEAR(r.losses[s], at(r.dp_rank, 0).losses[s], 1e-12) << "TP ranks agree";
  }
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    double mean = 0;
    for (int d = 0; d < c.dp; ++d)
      mean += at(d, 0).losses[s] / c.dp;
    EXPECT_NEAR(mean, ref.losses[s], 1e-9 * std::abs(ref.losses[s])) << "step " << s;
  }
  const std::set<std::string> sharded(ranks[0].sharded.begin(), ranks[0].sharded.end());
  EXPECT_FALSE(sharded.empty());
  EXPECT_FALSE(sharded.count("embed.wte")) << "the plan shards the blocks only";
  for (const auto& [name, want] : ref.params) {
    std::vector<torch::Tensor> tp_shards;
    for (int t = 0; t < c.tp; ++t) {
      std::vector<torch::Tensor> pieces;
      for (int d = 0; d < c.dp; ++d) {
        const auto& p = at(d, t).params.at(name);
        if (!sharded.count(name)) {
          expect_close(p, at(0, t).params.at(name), name + " replicas over dp", 0.0);
          pieces = {p};
          break;
        }
        pieces.push_back(p);
      }
      tp_shards.push_back(torch::cat(pieces, 0));
    }
    const auto split = hp::models::tp_split(name);
    if (split == hp::models::TpSplit::Replicated)
      for (int t = 1; t < c.tp; ++t)
        expect_close(tp_shards[t], tp_shards[0], name + " replicas over tp", 1e-13);
    expect_close(hp::models::tp_unshard(tp_shards, split), want, name, 1e-9);
  }
}

class TpMeshThreads : public ::testing::TestWithParam<bool> {};

TEST_P(TpMeshThreads, TwoByTwoMatchesSingleProcessEager) {
  hp_test::TpMeshCase c;
  c.recompute = GetParam();
  std::vector<hp_test::TpMeshRank> ranks(4);
  hp::testing::run_ranks_as_threads(4, [&](int r, std::shared_ptr<Comm> world) {
    ranks[r] = hp_test::run_tp_mesh_rank(c, world, "tp-threads-rank" + std::to_string(r));
  });
  expect_matches_reference(c, ranks);
}

INSTANTIATE_TEST_SUITE_P(Recompute, TpMeshThreads, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "recompute" : "plain"; });

// The seed's test_tpsp: four real processes (tp_mesh_worker, started by the
// launcher), each writes its losses and local tensors; put back together
// they equal the eager oracle.
TEST(TpMeshProcesses, TwoByTwoMatchesSingleProcessEager) {
  const std::string dir = temp_dir("procs");
  hp::launch::LaunchOptions o;
  o.nproc = 4;
  o.command = {HP_TP_MESH_WORKER, dir};
  o.run_timeout = std::chrono::seconds(240);
  o.output_dir = dir;
  auto run = hp::launch::launch_local(o);
  if (!run.ok()) {
    std::string logs;
    for (int r = 0; r < 4; ++r) {
      std::ifstream f(dir + "/rank_" + std::to_string(r) + ".log");
      logs += "--- rank " + std::to_string(r) + "\n" +
              std::string(std::istreambuf_iterator<char>(f), {});
    }
    FAIL() << run.summary() << "\n" << logs;
  }
  hp_test::TpMeshCase c;
  std::vector<hp_test::TpMeshRank> ranks;
  for (int r = 0; r < 4; ++r) {
    std::ifstream f(dir + "/result_" + std::to_string(r) + ".pt", std::ios::binary);
    ASSERT_TRUE(f) << "rank " << r << " wrote no result";
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), {});
    auto dict = torch::jit::pickle_load(bytes).toGenericDict();
    hp_test::TpMeshRank out;
    for (const auto& e : dict) {
      const std::string key = e.key().toStringRef();
      const auto t = e.value().toTensor();
      if (key == "meta") {
        out.tp_rank = int(t[0].item<int64_t>());
        out.dp_rank = int(t[1].item<int64_t>());
        out.tp_copy_calls = t[2].item<int64_t>();
        out.tp_reduce_calls = t[3].item<int64_t>();
        out.fsdp_degree = t[4].item<int64_t>();
        out.tp_size = t[5].item<int64_t>();
      } else if (key == "losses") {
        for (int64_t s = 0; s < t.numel(); ++s)
          out.losses.push_back(t[s].item<double>());
      } else if (key.rfind("p:", 0) == 0) {
        out.params[key.substr(2)] = t;
      } else if (key.rfind("s:", 0) == 0) {
        out.sharded.push_back(key.substr(2));
      }
    }
    ranks.push_back(std::move(out));
  }
  expect_matches_reference(c, ranks);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------
// A bad mesh is an error before any work

TEST(TpMeshErrors, BadMeshesAndConfigsFailBeforeAnyWork) {
  hp_test::TpMeshCase c;
  // tp x dp != world size.
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> world) {
    EXPECT_HAS(error_of([&] { DeviceMesh(world, MeshShape{{"dp", "tp"}, {2, 2}}); }), "4");
    auto mesh = std::make_shared<DeviceMesh>(world, MeshShape{{"pp", "tp"}, {2, 1}});
    // Graph mode has no pipeline; dimensions must exist.
    EXPECT_HAS(error_of([&] { MeshContext::from_mesh(mesh, "", "tp"); }),
               "dimension 'pp' has size 2");
    EXPECT_HAS(error_of([&] { MeshContext::from_mesh(mesh, "dp", "tp"); }),
               "has no dimension 'dp'");
    EXPECT_HAS(error_of([&] { MeshContext::from_mesh(mesh, "pp", "pp"); }),
               "cannot both run along mesh dimension 'pp'");
    // A mesh context that disagrees with the config, or with the model.
    auto dp_mesh = std::make_shared<DeviceMesh>(world, MeshShape{{"dp", "tp"}, {2, 1}});
    auto ctx = MeshContext::from_mesh(dp_mesh, "dp", "tp", "tp-err-rank" + std::to_string(r));
    torch::manual_seed(1);
    hp_test::Mlp mlp(6, 16, 4);
    auto fn = hp_test::mse_fn<hp_test::MlpImpl>();
    PassConfig bad_degree;
    bad_degree.fsdp_degree = 4;
    EXPECT_HAS(error_of([&] { GraphTrainer(mlp.ptr(), fn, bad_degree, std::nullopt, {}, ctx); }),
               "fsdp_degree is 4 but the FSDP group has 2 ranks");
    PassConfig bad_tp;
    bad_tp.tp_size = 2;
    EXPECT_HAS(error_of([&] { GraphTrainer(mlp.ptr(), fn, bad_tp, std::nullopt, {}, ctx); }),
               "tp_size is 2 but the mesh's TP group has 1 ranks");
    hp_test::Mlp odd(6, 16, 3);  // fc2's dim 0 is 3
    EXPECT_HAS(error_of([&] { GraphTrainer(odd.ptr(), fn, PassConfig{}, std::nullopt, {}, ctx); }),
               "parameter 'fc2.weight' has dim 0 of size 3, not divisible by the FSDP degree 2");
    auto filled = [&] {
      GraphTrainer t(mlp.ptr(), fn, PassConfig{}, std::nullopt, {}, ctx);
      EXPECT_FALSE(t.compiled());
      EXPECT_EQ(t.config().fsdp_degree.value_or(0), 2);
      EXPECT_EQ(t.config().tp_size, 1);
    };
    filled();
  });
  // TP over a group whose size does not divide the heads or the width.
  hp::models::TensorParallel tp;
  tp.size = 3;
  tp.copy_to_region = tp.reduce_from_region = [](const torch::Tensor& x) { return x; };
  EXPECT_HAS(error_of([&] { hp::models::build_tp_chunk(c.spec, 0, 1, 1, tp); }),
             "a TP size of 3 does not divide the 4 attention heads");
  auto wide = c.spec;
  wide.heads = 6;
  wide.d_model = 18;
  tp.size = 2;
  EXPECT_NO_THROW(tp.check(wide));
  wide.heads = 2;
  wide.d_model = 18;
  tp.size = 2;
  EXPECT_NO_THROW(tp.check(wide));
  tp.size = 4;
  wide.heads = 4;
  wide.d_model = 18;  // not a valid gpt either: d_model % heads
  EXPECT_HAS(error_of([&] { tp.check(wide); }), "does not divide the model width 18");
  hp::models::TensorParallel no_fns;
  no_fns.size = 2;
  EXPECT_HAS(error_of([&] { no_fns.check(c.spec); }),
             "needs copy_to_region and reduce_from_region");
  // Clipping over TP needs to know which parameters TP splits; one name
  // cannot hold two groups.
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> world) {
    auto mesh = std::make_shared<DeviceMesh>(world, MeshShape{{"dp", "tp"}, {1, 2}});
    auto ctx = MeshContext::from_mesh(mesh, "dp", "tp", "tp-clip-rank" + std::to_string(r));
    torch::manual_seed(1);
    hp_test::Mlp mlp(6, 16, 4);
    auto fn = hp_test::mse_fn<hp_test::MlpImpl>();
    OptimizerConfig clip;
    clip.grad_clip = 1.0;
    EXPECT_HAS(
        error_of([&] { GraphTrainer(mlp.ptr(), fn, PassConfig{}, std::nullopt, clip, ctx); }),
        "needs MeshContext::tp_sharded");
    ctx.tp_sharded = {"fc9.weight"};
    EXPECT_HAS(
        error_of([&] { GraphTrainer(mlp.ptr(), fn, PassConfig{}, std::nullopt, clip, ctx); }),
        "names 'fc9.weight', which is no parameter");
    ctx.tp_sharded = {};
    GraphTrainer holder(mlp.ptr(), fn, PassConfig{}, std::nullopt, {}, ctx);
    EXPECT_EQ(find_tp_group(ctx.tp_group_name), ctx.tp);
    auto other = ctx;
    other.tp = mesh->group("dp");  // another Comm under the same name
    EXPECT_HAS(
        error_of([&] { GraphTrainer(mlp.ptr(), fn, PassConfig{}, std::nullopt, {}, other); }),
        "is already registered to another Comm");
  });
}

// ---------------------------------------------------------------------------
// --graph --recompute

// The plain GPT with every block checkpointed (hp::recompute), captured: the
// graph holds each block's forward twice (the forward, and the recompute in
// backward) and replays to eager's loss and gradients; since the replay
// drops values after their last use, the checkpointed graph's peak memory is
// below the plain graph's.
TEST(GraphRecompute, CheckpointedBlocksReplayLikeEagerInLessMemory) {
  hp::install_memory_tracker();
  hp_test::TpMeshCase c;
  c.spec.layers = 4;
  c.spec.d_model = 32;
  c.spec.seq_len = 32;
  c.spec.vocab = 64;
  c.batch = 8;
  c.steps = 2;
  auto data = hp_test::tp_mesh_data(c);
  auto eager = hp::models::build_chunk(c.spec, 0, 1, c.seed);
  struct Run {
    int64_t mm_calls = 0;
    int64_t peak = 0;
  };
  Run runs[2];
  for (bool recompute : {false, true}) {
    auto model = hp::models::build_chunk(c.spec, 0, 1, c.seed);
    auto fn = hp_test::tp_mesh_train_fn(c.spec, recompute);
    Graph g = capture_train_step(*model, fn, data[0].first, data[0].second);
    for (const char* op : {"aten::mm", "aten::bmm", "aten::addmm"})
      runs[recompute].mm_calls += g.count_calls(op);
    for (const auto& [x, y] : data) {
      auto l = hp::models::loss(c.spec, eager->forward(x), y);
      auto want = torch::autograd::grad({l}, eager->parameters());
      auto values = placeholder_values(g, *model, x, y);
      hp::reset_peak_memory();
      const int64_t base = hp::memory_allocated();
      auto outs = replay(g, values);
      runs[recompute].peak = std::max(runs[recompute].peak, hp::peak_memory_allocated() - base);
      expect_close(outs[0], l.detach(), "loss, recompute " + std::to_string(recompute));
      for (size_t i = 0; i < want.size(); ++i)
        expect_close(outs[i + 1], want[i], g.output().output_names[i + 1]);
    }
  }
  // Each block's forward products run twice.
  EXPECT_GT(runs[1].mm_calls, runs[0].mm_calls);
  EXPECT_LT(runs[1].peak, runs[0].peak)
      << "recompute " << runs[1].peak << " B, plain " << runs[0].peak << " B";
  std::cout << "graph replay peak: plain " << runs[0].peak << " B, recompute " << runs[1].peak
            << " B\n";
}

}  // namespace
