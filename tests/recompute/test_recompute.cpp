// Tests of checkpoint with recompute sessions: every gradient is checked
// against plain torch::autograd on the same data in float64, and every
// promise (one recompute for dx + dw, prefetch, retain/clear, nothing left
// behind, FLOPs, memory) is measured, not assumed.
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <torch/torch.h>
#include "tests/common/flop_counter.h"
#include "tests/common/oracle.h"

#include <functional>
#include <string>
#include <thread>

#include "hp/autograd/grad_function.h"
#include "hp/recompute/checkpoint.h"

using hp::autograd::GradFunction;
using hp::recompute::BlockFn;
using hp::recompute::checkpoint;
using hp::recompute::CheckpointOptions;
using hp::recompute::clear_session;
using hp::recompute::HandleCollector;
using hp::recompute::RecomputeCounters;
using hp::recompute::RecomputeSession;
using hp::recompute::session_stats;
using hp::recompute::SessionOptions;
using hp::recompute::TensorList;

namespace {

using hp::testing::expect_close;
using hp::testing::kF64;
using hp::testing::param;
const auto kRetain = SessionOptions().retain_on_unpack(true);
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

size_t alive(const std::vector<WeakStorage>& storages) {
  size_t n = 0;
  for (const auto& s : storages)
    n += s.expired() ? 0 : 1;
  return n;
}

// A stack of residual blocks x + (tanh(a) * a) W2 with a = x W1 + b1, each
// block's function counting its runs and recording weak pointers to its three
// intermediates that backward saves: a and tanh(a) (needed by dx only) and
// g = tanh(a) * a (needed by dw too, for W2's gradient).
struct Model {
  std::vector<TensorList> w;  // per block: W1, b1, W2
  int64_t calls = 0;
  std::vector<WeakStorage> activations;  // intermediates of every block run so far
  size_t peak_alive = 0;                 // most intermediates alive at a block's end
  std::function<void()> on_call;         // test hook (e.g. throw)

  Model(size_t blocks, int64_t d, int64_t hidden) {
    for (size_t k = 0; k < blocks; ++k)
      w.push_back({param({d, hidden}), param({hidden}), param({hidden, d})});
  }
  TensorList weights() const {
    TensorList all;
    for (const auto& ws : w)
      all.insert(all.end(), ws.begin(), ws.end());
    return all;
  }
  BlockFn block(size_t k) {
    return [this, k](const TensorList& in) {
      calls++;
      if (on_call) on_call();
      auto a = torch::addmm(w[k][1], in[0], w[k][0]);
      auto h = torch::tanh(a);
      auto g = h * a;
      activations.push_back(a.storage().getWeakStorageImpl());
      activations.push_back(h.storage().getWeakStorageImpl());
      activations.push_back(g.storage().getWeakStorageImpl());
      peak_alive = std::max(peak_alive, alive(activations));
      return TensorList{in[0] + g.mm(w[k][2])};
    };
  }
  torch::Tensor forward(const torch::Tensor& x, bool ckpt) {
    auto h = x;
    for (size_t k = 0; k < w.size(); ++k)
      h = ckpt ? checkpoint(block(k), {h}, w[k])[0] : block(k)({h})[0];
    return h;
  }
  void zero_grad() {
    for (auto& t : weights())
      t.mutable_grad() = torch::Tensor();
  }
};

// Gradients of the model without checkpoint, via torch::autograd::grad.
struct Reference {
  torch::Tensor out, dx;
  TensorList dw;
};
Reference reference(Model& m, const torch::Tensor& x, const torch::Tensor& sens) {
  auto xi = x.detach().requires_grad_(true);
  Reference r;
  r.out = m.forward(xi, false);
  TensorList wrt{xi};
  for (auto& t : m.weights())
    wrt.push_back(t);
  auto g = torch::autograd::grad({r.out}, wrt, {sens});
  r.dx = g[0];
  r.dw.assign(g.begin() + 1, g.end());
  return r;
}

void expect_weight_grads(Model& m, const TensorList& dw, const Reference& ref,
                         const std::string& what) {
  auto ws = m.weights();
  ASSERT_EQ(dw.size(), ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    expect_close(dw[i], ref.dw[i], what + " dw " + std::to_string(i));
    expect_close(ws[i].grad(), ref.dw[i], what + " .grad (exactly once) " + std::to_string(i));
  }
}

// One microbatch of a pipeline stage under the split: forward, then dx and dw.
struct Microbatch {
  explicit Microbatch(torch::Tensor input) : x(std::move(input)) {}
  torch::Tensor x, out, sens;
  std::optional<GradFunction> gf;
  void forward(Model& m, bool ckpt) {
    out = m.forward(x, ckpt);
    gf.emplace(TensorList{out}, TensorList{x}, m.weights());
  }
};

using hp::testing::FlopCounter;

using hp::testing::expect_error;

class RecomputeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(1234);
    hp::recompute::clear_all_sessions();
    hp::recompute::reset_counters();
  }
  void TearDown() override { hp::recompute::clear_all_sessions(); }
  static RecomputeCounters global() { return hp::recompute::counters(); }
};

}  // namespace

TEST_F(RecomputeTest, FeatureOffIsAnOrdinaryCheckpoint) {
  Model m(3, 8, 16);
  auto x = torch::randn({4, 8}, kF64);
  auto sens = torch::randn({4, 8}, kF64);
  auto ref = reference(m, x, sens);
  m.calls = 0;
  m.activations.clear();

  // Plain backward(): one recompute per block, then everything is freed.
  auto xi = x.detach().requires_grad_(true);
  auto out = m.forward(xi, true);
  EXPECT_EQ(m.calls, 3) << "the forward runs each block once";
  EXPECT_EQ(alive(m.activations), 0u) << "the forward keeps no activation";
  expect_close(out, ref.out, "output");
  out.backward(sens);
  EXPECT_EQ(m.calls, 6) << "backward recomputes each block once";
  EXPECT_EQ(global().recomputes, 3);
  EXPECT_EQ(global().consumed, 3);
  EXPECT_EQ(global().reused, 0);
  EXPECT_EQ(alive(m.activations), 0u) << "recomputed activations are freed after backward";
  expect_close(xi.grad(), ref.dx, "dx");
  auto ws = m.weights();
  for (size_t i = 0; i < ws.size(); ++i)
    expect_close(ws[i].grad(), ref.dw[i], ".grad " + std::to_string(i));
  m.zero_grad();

  // A dx-only backward (torch::autograd::grad on the input): one recompute each.
  hp::recompute::reset_counters();
  out = m.forward(xi, true);
  auto dx = torch::autograd::grad({out}, {xi}, {sens});
  expect_close(dx[0], ref.dx, "dx via autograd::grad");
  EXPECT_EQ(global().recomputes, 3);
  for (auto& t : m.weights())
    EXPECT_FALSE(t.grad().defined()) << "a dx-only backward leaves .grad alone";
  EXPECT_EQ(hp::recompute::num_sessions(), 0u);
}

TEST_F(RecomputeTest, SplitWithoutSessionRecomputesTwice) {
  Model m(2, 8, 16);
  Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
  mb.sens = torch::randn({4, 8}, kF64);
  auto ref = reference(m, mb.x, mb.sens);
  mb.forward(m, true);
  auto dx = mb.gf->compute_input_grad({mb.sens});
  EXPECT_EQ(global().recomputes, 2) << "dx recomputes each block";
  EXPECT_EQ(alive(m.activations), 0u) << "without a session dx keeps nothing";
  auto dw = mb.gf->compute_weight_grad();
  EXPECT_EQ(global().recomputes, 4) << "documented: dw recomputes each block again";
  expect_close(dx[0], ref.dx, "dx");
  expect_weight_grads(m, dw, ref, "no session");
  EXPECT_EQ(alive(m.activations), 0u);
}

TEST_F(RecomputeTest, RetainingSessionRecomputesOnceAndClearLeavesNothing) {
  Model m(2, 8, 16);
  // Two microbatches, dx and dw interleaved as ZB-H1 does: F0 F1 I0 I1 W1 W0.
  Microbatch mb[2] = {Microbatch(torch::randn({4, 8}, kF64).requires_grad_(true)),
                      Microbatch(torch::randn({4, 8}, kF64).requires_grad_(true))};
  Reference ref[2];
  torch::Tensor total_dw_ref[6];
  for (int i = 0; i < 2; ++i) {
    mb[i].sens = torch::randn({4, 8}, kF64);
    ref[i] = reference(m, mb[i].x, mb[i].sens);
  }
  for (int i = 0; i < 2; ++i)
    mb[i].forward(m, true);
  m.activations.clear();
  for (int i = 0; i < 2; ++i) {
    RecomputeSession session(100 + i, kRetain);
    auto dx = mb[i].gf->compute_input_grad({mb[i].sens});
    expect_close(dx[0], ref[i].dx, "dx mb " + std::to_string(i));
  }
  EXPECT_EQ(global().recomputes, 4) << "one recompute per block per microbatch";
  EXPECT_EQ(session_stats(100).cached_blocks, 2u) << "dx kept the recomputed blocks for dw";
  EXPECT_EQ(session_stats(101).cached_blocks, 2u);
  EXPECT_EQ(alive(m.activations), 4u)
      << "the retained recompute keeps what dw needs (g of each block), dx freed the rest";

  TensorList dw[2];
  for (int i : {1, 0}) {
    RecomputeSession session(100 + i, kRetain);
    dw[i] = mb[i].gf->compute_weight_grad();
  }
  EXPECT_EQ(global().recomputes, 4) << "dw reused the retained recompute";
  EXPECT_EQ(global().consumed, 8);
  EXPECT_EQ(global().reused, 4);
  auto s = session_stats(100);
  EXPECT_TRUE(s.exists);
  EXPECT_EQ(s.cached_blocks, 0u) << "dw is the last consumer";
  EXPECT_EQ(s.counters.recomputes, 2);
  EXPECT_EQ(s.counters.consumed, 4);
  EXPECT_EQ(s.counters.reused, 2);
  EXPECT_EQ(alive(m.activations), 0u) << "dw freed the recomputed graphs";
  auto ws = m.weights();
  for (size_t j = 0; j < ws.size(); ++j) {
    expect_close(dw[0][j], ref[0].dw[j], "dw mb0 " + std::to_string(j));
    expect_close(dw[1][j], ref[1].dw[j], "dw mb1 " + std::to_string(j));
    expect_close(ws[j].grad(), ref[0].dw[j] + ref[1].dw[j], ".grad sums both microbatches once");
  }
  EXPECT_EQ(clear_session(100), 0u);
  EXPECT_EQ(clear_session(101), 0u);
  EXPECT_FALSE(session_stats(100).exists);
  EXPECT_EQ(session_stats(100).counters.recomputes, 0);
  EXPECT_EQ(hp::recompute::num_sessions(), 0u);
  EXPECT_EQ(global().cleared, 0);
}

TEST_F(RecomputeTest, SessionWithoutRetainFreesAfterTheFirstConsumer) {
  Model m(2, 8, 16);
  Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
  mb.sens = torch::randn({4, 8}, kF64);
  auto ref = reference(m, mb.x, mb.sens);
  mb.forward(m, true);
  RecomputeSession session(7);  // retain_on_unpack defaults to false
  auto dx = mb.gf->compute_input_grad({mb.sens});
  EXPECT_EQ(session_stats(7).cached_blocks, 0u);
  auto dw = mb.gf->compute_weight_grad();
  EXPECT_EQ(session_stats(7).counters.recomputes, 4);
  expect_close(dx[0], ref.dx, "dx");
  expect_weight_grads(m, dw, ref, "no retain");
}

TEST_F(RecomputeTest, PrefetchedHandlesServeTheBackward) {
  Model m(3, 8, 16);
  Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
  mb.sens = torch::randn({4, 8}, kF64);
  auto ref = reference(m, mb.x, mb.sens);
  std::vector<hp::recompute::RecomputeHandle> handles;
  {
    HandleCollector collector;
    mb.forward(m, true);
    handles = collector.take();
  }
  ASSERT_EQ(handles.size(), 3u) << "one handle per checkpointed block";
  m.calls = 0;
  {
    RecomputeSession session(42, kRetain);
    for (const auto& h : handles)
      EXPECT_FALSE(h.is_recomputed());
    hp::recompute::prefetch(handles);
    hp::recompute::prefetch(handles);  // a second prefetch finds the results waiting
    for (const auto& h : handles)
      EXPECT_TRUE(h.is_recomputed());
  }
  EXPECT_EQ(m.calls, 3);
  EXPECT_EQ(session_stats(42).counters.prefetches, 3);
  EXPECT_EQ(session_stats(42).cached_blocks, 3u);
  TensorList dx, dw;
  {
    RecomputeSession session(42, kRetain);
    dx = mb.gf->compute_input_grad({mb.sens});
  }
  {
    RecomputeSession session(42, kRetain);
    dw = mb.gf->compute_weight_grad();
  }
  EXPECT_EQ(m.calls, 3) << "backward ran no recompute of its own";
  EXPECT_EQ(global().recomputes, 3);
  EXPECT_EQ(global().reused, 6) << "dx and dw both consumed the prefetch";
  expect_close(dx[0], ref.dx, "dx");
  expect_weight_grads(m, dw, ref, "prefetch");
  clear_session(42);
  for (const auto& h : handles)
    EXPECT_FALSE(h.alive()) << "the graph is gone after dw";
  expect_error([&] { handles[0].recompute(); }, "graph is gone");
  m.zero_grad();

  // Without a session: the handle's result waits on the block, a plain
  // backward consumes it.
  hp::recompute::reset_counters();
  auto xi = mb.x.detach().requires_grad_(true);
  torch::Tensor out;
  {
    HandleCollector collector;
    out = m.forward(xi, true);
    hp::recompute::prefetch(collector.handles());
    EXPECT_TRUE(collector.handles()[1].is_recomputed());
  }
  m.calls = 0;
  out.backward(mb.sens);
  EXPECT_EQ(m.calls, 0);
  EXPECT_EQ(global().recomputes, 3);
  EXPECT_EQ(global().reused, 3);
  expect_close(xi.grad(), ref.dx, "dx after a sessionless prefetch");
  EXPECT_EQ(alive(m.activations), 0u);
}

TEST_F(RecomputeTest, ClearAfterExceptionPartialRunOrEarlyExitLeavesNothing) {
  Model m(2, 8, 16);
  auto sens = torch::randn({4, 8}, kF64);
  auto nothing_left = [&](uint64_t id, size_t expected_dropped) {
    EXPECT_EQ(clear_session(id), expected_dropped);
    EXPECT_FALSE(session_stats(id).exists);
    EXPECT_EQ(hp::recompute::num_sessions(), 0u);
    EXPECT_EQ(alive(m.activations), 0u) << "no recomputed tensor survives clear";
  };
  // 1. The block throws while recomputing inside dx.
  {
    Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
    mb.forward(m, true);
    m.on_call = [&] {
      if (m.calls == 4) throw std::runtime_error("boom in block 1");  // second block's recompute
    };
    m.calls = 2;
    {
      RecomputeSession session(1, kRetain);
      EXPECT_ANY_THROW(mb.gf->compute_input_grad({sens}));
    }
    m.on_call = nullptr;
    EXPECT_TRUE(session_stats(1).exists);
    EXPECT_EQ(session_stats(1).cached_blocks, 1u) << "block 1 ran dx before block 0 threw";
    nothing_left(1, 1);
  }
  // 2. Incomplete consumption: dx ran, dw never does.
  {
    Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
    mb.forward(m, true);
    {
      RecomputeSession session(2, kRetain);
      mb.gf->compute_input_grad({sens});
    }
    EXPECT_EQ(session_stats(2).cached_blocks, 2u);
    EXPECT_EQ(alive(m.activations), 2u) << "g of each block, kept for dw";
    nothing_left(2, 2);
    EXPECT_EQ(global().cleared, 3);
  }
  // 3. Early exit: prefetched, then the step is abandoned (an exception
  //    unwinds the guard before dx).
  {
    Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
    std::vector<hp::recompute::RecomputeHandle> handles;
    {
      HandleCollector collector;
      mb.forward(m, true);
      handles = collector.take();
    }
    try {
      RecomputeSession session(3, kRetain);
      hp::recompute::prefetch(handles);
      throw std::runtime_error("step abandoned");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(alive(m.activations), 6u) << "both blocks fully recomputed";
    nothing_left(3, 2);
    // The guard stack unwound: a new session works normally on this thread.
    RecomputeSession session(4, kRetain);
    mb.gf->compute_input_grad({sens});
    mb.gf->compute_weight_grad();
    EXPECT_EQ(session_stats(4).counters.recomputes, 2);
  }
  clear_session(4);
  m.zero_grad();
  EXPECT_EQ(clear_session(12345), 0u) << "clearing an unknown session is a no-op";
}

TEST_F(RecomputeTest, NestedCheckpoints) {
  auto w = TensorList{param({6, 6}), param({6, 6}), param({6})};
  int64_t outer_calls = 0;
  BlockFn inner0 = [&](const TensorList& in) { return TensorList{torch::tanh(in[0].mm(w[0]))}; };
  BlockFn inner1 = [&](const TensorList& in) {
    return TensorList{torch::sigmoid(in[0].mm(w[1]) + w[2]) * in[0]};
  };
  auto body = [&](const TensorList& in, bool ckpt) {
    auto h = ckpt ? checkpoint(inner0, in, {w[0]})[0] : inner0(in)[0];
    h = ckpt ? checkpoint(inner1, {h}, {w[1], w[2]})[0] : inner1({h})[0];
    return TensorList{h + in[0]};
  };
  BlockFn outer = [&](const TensorList& in) {
    outer_calls++;
    return body(in, true);
  };
  auto x = torch::randn({5, 6}, kF64).requires_grad_(true);
  auto sens = torch::randn({5, 6}, kF64);
  auto ref_out = body({x}, false)[0];
  TensorList wrt{x, w[0], w[1], w[2]};
  auto ref = torch::autograd::grad({ref_out}, wrt, {sens});

  auto check = [&](const TensorList& dx, const TensorList& dw, const std::string& what) {
    expect_close(dx[0], ref[0], what + " dx");
    for (size_t j = 0; j < 3; ++j) {
      expect_close(dw[j], ref[1 + j], what + " dw " + std::to_string(j));
      expect_close(w[j].grad(), ref[1 + j], what + " .grad " + std::to_string(j));
      w[j].mutable_grad() = torch::Tensor();
    }
  };
  // Retaining session, split: the outer block and each inner one recompute once.
  {
    HandleCollector collector;
    auto out = checkpoint(outer, {x}, w)[0];
    EXPECT_EQ(collector.handles().size(), 1u) << "inner blocks run under the outer's NoGrad";
    GradFunction gf({out}, {x}, w);
    TensorList dx, dw;
    {
      RecomputeSession session(9, kRetain);
      dx = gf.compute_input_grad({sens});
    }
    EXPECT_EQ(collector.handles().size(), 1u) << "blocks created by a recompute are not collected";
    EXPECT_EQ(session_stats(9).cached_blocks, 3u) << "outer and both inner blocks retained";
    {
      RecomputeSession session(9, kRetain);
      dw = gf.compute_weight_grad();
    }
    EXPECT_EQ(session_stats(9).counters.recomputes, 3);
    EXPECT_EQ(session_stats(9).counters.reused, 3);
    EXPECT_EQ(session_stats(9).cached_blocks, 0u);
    EXPECT_EQ(outer_calls, 2);
    check(dx, dw, "nested, session");
    clear_session(9);
  }
  // No session, split: dx recomputes outer + 2 inner; dw recomputes the outer
  // again, whose new inner blocks each recompute once more.
  {
    hp::recompute::reset_counters();
    auto out = checkpoint(outer, {x}, w)[0];
    GradFunction gf({out}, {x}, w);
    auto dx = gf.compute_input_grad({sens});
    EXPECT_EQ(global().recomputes, 3);
    auto dw = gf.compute_weight_grad();
    EXPECT_EQ(global().recomputes, 6);
    check(dx, dw, "nested, no session");
  }
  // Plain backward: each block recomputes once.
  {
    hp::recompute::reset_counters();
    auto xi = x.detach().requires_grad_(true);
    checkpoint(outer, {xi}, w)[0].backward(sens);
    EXPECT_EQ(global().recomputes, 3);
    check({xi.grad()}, {w[0].grad(), w[1].grad(), w[2].grad()}, "nested, plain");
  }
}

TEST_F(RecomputeTest, SharedWeightsAndFirstStageInputs) {
  // Two blocks share w; block 1 also uses it twice. The input needs no grad
  // (a first pipeline stage): dx is empty and the blocks are reached by dw only.
  auto w = param({6, 6});
  auto b = param({6});
  BlockFn blk0 = [&](const TensorList& in) { return TensorList{torch::tanh(in[0].mm(w) + b)}; };
  BlockFn blk1 = [&](const TensorList& in) { return TensorList{in[0].mm(w).sin().mm(w)}; };
  auto x = torch::randn({4, 6}, kF64);
  auto sens = torch::randn({4, 6}, kF64);
  auto ref = torch::autograd::grad({blk1(blk0({x}))[0]}, {w, b}, {sens});

  auto h = checkpoint(blk0, {x}, {w, b})[0];
  auto out = checkpoint(blk1, {h}, {w})[0];
  GradFunction gf({out}, {}, {w, b});
  {
    RecomputeSession session(5, kRetain);
    gf.compute_input_grad({sens});
  }
  TensorList dw;
  {
    RecomputeSession session(5, kRetain);
    dw = gf.compute_weight_grad();
  }
  EXPECT_EQ(session_stats(5).counters.recomputes, 2);
  expect_close(dw[0], ref[0], "shared dw");
  expect_close(dw[1], ref[1], "db");
  expect_close(w.grad(), ref[0], "shared .grad once");
  expect_close(b.grad(), ref[1], "b .grad once");
  clear_session(5);

  // The same with an input that needs grad: block 1 is reached by dx and dw.
  w.mutable_grad() = torch::Tensor();
  b.mutable_grad() = torch::Tensor();
  auto xi = x.detach().requires_grad_(true);
  auto ref2 = torch::autograd::grad({blk1(blk0({xi}))[0]}, {xi, w, b}, {sens});
  out = checkpoint(blk1, {checkpoint(blk0, {xi}, {w, b})[0]}, {w})[0];
  GradFunction gf2({out}, {xi}, {w, b});
  RecomputeSession session(6, kRetain);
  auto dx = gf2.compute_input_grad({sens});
  dw = gf2.compute_weight_grad();
  EXPECT_EQ(session_stats(6).counters.recomputes, 2);
  expect_close(dx[0], ref2[0], "dx");
  expect_close(w.grad(), ref2[1], "shared .grad once");
  expect_close(b.grad(), ref2[2], "b .grad once");
}

TEST_F(RecomputeTest, FusedBackwardThroughCheckpointedBlocks) {
  Model m(3, 8, 16);
  auto x = torch::randn({4, 8}, kF64).requires_grad_(true);
  auto sens = torch::randn({4, 8}, kF64);
  auto ref = reference(m, x, sens);
  auto out = m.forward(x, true);
  GradFunction gf({out}, {x}, m.weights());
  RecomputeSession session(8, kRetain);
  auto g = gf({sens});
  EXPECT_EQ(global().recomputes, 3);
  EXPECT_EQ(session_stats(8).cached_blocks, 0u) << "a fused request is the last consumer";
  expect_close(g.input_grads[0], ref.dx, "fused dx");
  expect_weight_grads(m, g.weight_grads, ref, "fused");
}

TEST_F(RecomputeTest, CheckpointKeepsFewerActivationsInForward) {
  const size_t blocks = 4;
  Model plain(blocks, 32, 64);
  auto x = torch::randn({16, 32}, kF64).requires_grad_(true);
  auto out = plain.forward(x, false);
  EXPECT_EQ(alive(plain.activations), 3 * blocks) << "without checkpoint every block keeps 3";
  EXPECT_EQ(plain.peak_alive, 3 * blocks);

  Model ckpt(blocks, 32, 64);
  auto out2 = ckpt.forward(x, true);
  EXPECT_EQ(alive(ckpt.activations), 0u) << "with checkpoint no block keeps its intermediates";
  EXPECT_EQ(ckpt.peak_alive, 3u) << "peak: one block's intermediates at a time";
}

TEST_F(RecomputeTest, RetainedSplitCostsOneForwardPlusOneFusedBackward) {
  Model m(2, 32, 64);
  auto x = torch::randn({16, 32}, kF64).requires_grad_(true);
  auto sens = torch::randn({16, 32}, kF64);
  int64_t forward_flops = 0, fused_flops = 0;
  {
    auto out = m.forward(x, false);  // no checkpoint
    GradFunction gf({out}, {x}, m.weights());
    FlopCounter c;
    gf({sens});
    fused_flops = FlopCounter::flops();
  }
  {
    FlopCounter c;
    m.forward(x, false);
    forward_flops = FlopCounter::flops();
  }
  auto split_flops = [&](bool session) {
    int64_t ckpt_forward = 0, backward = 0;
    torch::Tensor out;
    {
      FlopCounter c;
      out = m.forward(x, true);
      ckpt_forward = FlopCounter::flops();
    }
    EXPECT_EQ(ckpt_forward, forward_flops) << "checkpoint's forward runs each block once";
    GradFunction gf({out}, {x}, m.weights());
    std::optional<RecomputeSession> guard;
    if (session) guard.emplace(77, kRetain);
    FlopCounter c;
    gf.compute_input_grad({sens});
    gf.compute_weight_grad();
    backward = FlopCounter::flops();
    return backward;
  };
  EXPECT_GT(forward_flops, 0);
  EXPECT_GT(fused_flops, forward_flops);
  EXPECT_EQ(split_flops(true), forward_flops + fused_flops);
  // Without a session dx and dw each recompute, and dw also re-runs the part of
  // the block's backward that dx already ran (the gradient into tanh(a) * a).
  EXPECT_GT(split_flops(false), 2 * forward_flops + fused_flops);
  m.zero_grad();
}

TEST_F(RecomputeTest, RecomputeReplaysTheForwardsRandomNumbers) {
  auto w = param({8, 8});
  BlockFn blk = [&](const TensorList& in) {
    return TensorList{torch::dropout(torch::tanh(in[0].mm(w)), 0.5, /*train=*/true).mm(w)};
  };
  auto x = torch::randn({6, 8}, kF64).requires_grad_(true);
  auto sens = torch::randn({6, 8}, kF64);
  torch::manual_seed(7);
  auto ref = torch::autograd::grad({blk({x})[0]}, {x, w}, {sens});
  auto next_after_forward = torch::randn({4}, kF64);

  for (bool preserve : {true, false}) {
    torch::manual_seed(7);
    auto out = checkpoint(blk, {x}, {w}, CheckpointOptions().preserve_rng_state(preserve))[0];
    auto next = torch::randn({4}, kF64);  // the caller's stream moves on before backward
    EXPECT_TRUE(torch::equal(next, next_after_forward));
    GradFunction gf({out}, {x}, {w});
    RecomputeSession session(preserve ? 10 : 11, kRetain);
    auto dx = gf.compute_input_grad({sens});
    auto dw = gf.compute_weight_grad();
    if (preserve) {
      expect_close(dx[0], ref[0], "dx with dropout");
      expect_close(dw[0], ref[1], "dw with dropout");
    } else {
      EXPECT_FALSE(torch::allclose(dx[0], ref[0])) << "a fresh mask gives other gradients";
    }
    w.mutable_grad() = torch::Tensor();
  }
}

TEST_F(RecomputeTest, RecomputeLeavesTheCallersRandomStreamAlone) {
  auto w = param({8, 8});
  BlockFn blk = [&](const TensorList& in) {
    return TensorList{torch::dropout(in[0].mm(w), 0.5, /*train=*/true)};
  };
  auto x = torch::randn({6, 8}, kF64);
  auto out = checkpoint(blk, {x}, {w})[0];
  torch::manual_seed(99);
  auto expected = torch::randn({5}, kF64);
  torch::manual_seed(99);
  out.sum().backward();  // recomputes with the forward's state, then restores ours
  EXPECT_TRUE(torch::equal(torch::randn({5}, kF64), expected));
}

TEST_F(RecomputeTest, SessionsAreThreadLocalAndIndependent) {
  // Two threads, each a "stage" with its own model and session id, run the
  // split concurrently; each session sees exactly its own recomputes.
  auto run = [](uint64_t id, int64_t seed, bool* ok) {
    torch::manual_seed(seed);
    Model m(2, 8, 16);
    Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
    mb.sens = torch::randn({4, 8}, kF64);
    auto ref = reference(m, mb.x, mb.sens);
    mb.forward(m, true);
    TensorList dx, dw;
    {
      RecomputeSession session(id, kRetain);
      dx = mb.gf->compute_input_grad({mb.sens});
    }
    {
      RecomputeSession session(id, kRetain);
      dw = mb.gf->compute_weight_grad();
    }
    *ok = torch::allclose(dx[0], ref.dx, 0, 1e-12);
    for (size_t j = 0; j < dw.size(); ++j)
      *ok = *ok && torch::allclose(dw[j], ref.dw[j], 0, 1e-12);
  };
  bool ok1 = false, ok2 = false;
  std::thread t1(run, 201, 1, &ok1), t2(run, 202, 2, &ok2);
  t1.join();
  t2.join();
  EXPECT_TRUE(ok1);
  EXPECT_TRUE(ok2);
  EXPECT_EQ(session_stats(201).counters.recomputes, 2);
  EXPECT_EQ(session_stats(202).counters.recomputes, 2);
  EXPECT_EQ(global().recomputes, 4);
}

// Runs `f` on a new thread under the thread-local state captured here, as
// LibTorch's engine runs a CUDA backward's nodes on its device thread (each
// graph task captures the caller's at::ThreadLocalState; the device thread
// installs it around every node). `propagate` false: a bare thread.
void on_another_thread(const std::function<void()>& f, bool propagate = true) {
  at::ThreadLocalState state;
  std::exception_ptr error;
  std::thread t([&] {
    try {
      if (propagate) {
        at::ThreadLocalStateGuard guard(state);
        f();
      } else {
        f();
      }
    } catch (...) {
      error = std::current_exception();
    }
  });
  t.join();
  if (error) std::rethrow_exception(error);
}

TEST_F(RecomputeTest, SessionReachesTheThreadThatRunsTheBackward) {
  // NOTE [Sessions reach the engine's threads]: dx and dw run on other threads
  // than the one that opened the session, as on CUDA; the retaining session
  // still recomputes each block once for both.
  Model m(3, 8, 16);
  Microbatch mb(torch::randn({4, 8}, kF64).requires_grad_(true));
  mb.sens = torch::randn({4, 8}, kF64);
  auto ref = reference(m, mb.x, mb.sens);
  m.calls = 0;
  mb.forward(m, true);
  TensorList dx, dw;
  {
    RecomputeSession session(301, kRetain);
    on_another_thread([&] { dx = mb.gf->compute_input_grad({mb.sens}); });
  }
  EXPECT_EQ(session_stats(301).counters.recomputes, 3) << "dx recomputes each block once";
  EXPECT_EQ(session_stats(301).cached_blocks, 3u) << "and retains them for dw";
  {
    RecomputeSession session(301, kRetain);
    on_another_thread([&] { dw = mb.gf->compute_weight_grad(); });
  }
  EXPECT_EQ(session_stats(301).counters.recomputes, 3) << "dw reuses dx's recomputes";
  EXPECT_EQ(session_stats(301).counters.reused, 3);
  EXPECT_EQ(global().recomputes, 3);
  EXPECT_EQ(m.calls, 6) << "one forward and one recompute per block";
  expect_close(dx[0], ref.dx, "dx on another thread");
  expect_weight_grads(m, dw, ref, "dw on another thread");
  EXPECT_EQ(clear_session(301), 0u) << "dw consumed every retained block";

  // The control: a thread that does not carry the caller's state sees no
  // session, and the split recomputes every block twice (what a session kept
  // in a plain thread_local did on CUDA).
  m.zero_grad();
  hp::recompute::reset_counters();
  Microbatch mb2(torch::randn({4, 8}, kF64).requires_grad_(true));
  mb2.forward(m, true);
  {
    RecomputeSession session(302, kRetain);
    on_another_thread([&] { mb2.gf->compute_input_grad({mb.sens}); }, /*propagate=*/false);
    on_another_thread([&] { mb2.gf->compute_weight_grad(); }, /*propagate=*/false);
  }
  EXPECT_EQ(global().recomputes, 6);
  EXPECT_EQ(session_stats(302).counters.recomputes, 0);
}

TEST_F(RecomputeTest, MisuseIsAClearError) {
  auto w = param({4, 4});
  BlockFn blk = [&](const TensorList& in) { return TensorList{in[0].mm(w).tanh()}; };
  auto x = torch::randn({3, 4}, kF64).requires_grad_(true);
  expect_error(
      [&] {
        auto xi = x.detach().clone().requires_grad_(true);
        auto y = xi * 2;
        auto out = checkpoint(blk, {y}, {w})[0];
        y.add_(1);  // modifies the block's input after its forward
        out.sum().backward();
      },
      "modified in place after the forward");
  expect_error(
      [&] {
        auto out = checkpoint(blk, {x}, {w})[0];
        {
          torch::NoGradGuard no_grad;
          w.add_(1);  // an optimizer step before backward
        }
        out.sum().backward();
      },
      "optimizer step");
  expect_error([&] { checkpoint(BlockFn(), {x}, {w}); }, "non-empty BlockFn");
  expect_error([&] { checkpoint([](const TensorList&) { return TensorList{}; }, {x}, {w}); },
               "returned no tensors");
  // Under NoGradGuard checkpoint is plainly fn: nothing to recompute.
  torch::NoGradGuard no_grad;
  auto out = checkpoint(blk, {x}, {w})[0];
  EXPECT_FALSE(out.requires_grad());
  EXPECT_EQ(global().recomputes, 0);
}
