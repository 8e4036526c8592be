// hp/moe against the same layer with every expert on one rank: routing,
// dispatch and combine over an expert-parallel group of 2 ranks (threads of
// this process over a FileStore Gloo group), forward, the fused backward and
// the dx/dw split, in float64.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "hp/autograd/grad_function.h"
#include "hp/core/compat.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/lanes.h"
#include "hp/moe/all_to_all.h"
#include "hp/moe/dispatch.h"
#include "hp/moe/moe_layer.h"
#include "hp/moe/router.h"

namespace {

using hp::distributed::Comm;
using namespace hp::moe;

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/hp_moe_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
};

/// Runs `body(rank, group)` on `n` threads; returns each one's error ("" if none).
std::vector<std::string> on_ranks(int n,
                                  const std::function<void(int, std::shared_ptr<Comm>)>& body) {
  TempDir dir;
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        hp::distributed::CommOptions o;
        o.timeout = std::chrono::seconds(20);
        body(r, Comm::from_file_store(dir.path + "/s", r, n, o));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts)
    t.join();
  return errors;
}

bool close(const torch::Tensor& a, const torch::Tensor& b, double tol = 1e-12) {
  return a.sizes() == b.sizes() && (a - b).abs().max().item<double>() <= tol;
}

TEST(Router, SoftmaxTopKAndNormalizedWeights) {
  auto logits = torch::tensor({{1.0, 3.0, 2.0, 0.0}, {0.0, 0.5, -1.0, 4.0}}, torch::kDouble);
  RouterOptions o;
  o.num_experts = 4;
  o.top_k = 2;
  auto r = route(logits, o);
  EXPECT_TRUE(torch::equal(r.experts, torch::tensor({{1, 2}, {3, 1}}, torch::kLong)));
  auto p = logits.softmax(-1);
  auto w0 = torch::stack({p[0][1], p[0][2]});
  EXPECT_TRUE(close(r.weights[0], w0 / w0.sum()));
  o.normalize = false;
  EXPECT_TRUE(close(route(logits, o).weights[0], w0));
}

TEST(Router, SigmoidGroupLimitedWithBiasAndScale) {
  // Four groups of two; the best single expert (index 7, 0.95) sits in a
  // group whose sum of two is the lowest, so group-limited routing to two
  // groups cannot choose it. The bias moves expert 2 ahead of expert 3 for
  // the choice only.
  auto s = torch::tensor({{0.60, 0.58, 0.50, 0.55, 0.10, 0.12, 0.01, 0.95}}, torch::kDouble);
  auto logits = torch::log(s / (1 - s));
  RouterOptions o;
  o.num_experts = 8;
  o.top_k = 2;
  o.scoring = "sigmoid";
  o.groups = 4;
  o.top_groups = 2;
  o.scale = 2.5;
  auto bias = torch::tensor({0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0}, torch::kDouble);
  auto r = route(logits, o, bias);
  auto chosen = std::get<0>(r.experts.sort(-1));
  EXPECT_TRUE(torch::equal(chosen, torch::tensor({{0, 2}}, torch::kLong))) << r.experts;
  auto w = torch::stack({s[0][0], s[0][2]});
  auto got = r.weights.gather(1, std::get<1>(r.experts.sort(-1)))[0];
  EXPECT_TRUE(close(got, w / w.sum() * 2.5));
  o.groups = 3;
  EXPECT_THROW(route(logits, o), c10::Error);
}

TEST(Dispatch, OneRankRoundTripSumsEveryExpertByWeight) {
  TokenDispatcher d(nullptr, 4);
  auto x = torch::randn({5, 3}, torch::kDouble);
  auto experts = torch::tensor({{0, 1}, {3, 2}, {1, 0}, {2, 3}, {0, 3}}, torch::kLong);
  auto w = torch::rand({5, 2}, torch::kDouble);
  auto out = d.dispatch(x, experts);
  EXPECT_EQ(out.tokens_per_expert, (std::vector<int64_t>{3, 2, 2, 3}));
  auto back = d.combine(out.tokens * 2.0, out, w);  // "experts" that double
  EXPECT_TRUE(close(back, x * 2.0 * w.sum(1, true)));
}

TEST(Dispatch, CapacityDropsTheLatestTokensAndCountsThem) {
  DispatchOptions o;
  o.capacity_factor = 1.0;  // 6 pairs over 2 experts: 3 each
  TokenDispatcher d(nullptr, 2, o);
  auto x = torch::arange(6, torch::kDouble).view({6, 1});
  auto experts = torch::zeros({6, 1}, torch::kLong);  // every token to expert 0
  auto out = d.dispatch(x, experts);
  EXPECT_EQ(out.dropped, 3);
  EXPECT_EQ(out.tokens_per_expert, (std::vector<int64_t>{3, 0}));
  auto back = d.combine(out.tokens, out, torch::ones({6, 1}, torch::kDouble));
  EXPECT_TRUE(
      close(back.view({-1}), torch::tensor({0.0, 1.0, 2.0, 0.0, 0.0, 0.0}, torch::kDouble)));
}

// Two ranks, four experts: rank 0 sends every token to expert 0 (its own),
// rank 1 every token to experts 2 and 3 (its own too), so no row crosses;
// then the crossing case. The round trip through doubling experts gives
// each token 2 x its weight sum either way.
// Over a plain group (the counts, then the rows) and over one in lanes (the
// counts at the head of the rows: NOTE [Counts at the head of the rows]).
TEST(Dispatch, TwoRanksRoundTripIncludingEmptyExchanges) {
  for (int lanes : {1, int(hp::distributed::kPairLanes)}) {
    auto errors = on_ranks(2, [lanes](int r, std::shared_ptr<Comm> plain) {
      auto g = hp::distributed::with_lanes(plain, lanes);
      TokenDispatcher d(g, 4);
      auto x = torch::randn({4, 3}, torch::kDouble) + r;
      for (int crossing = 0; crossing < 2; ++crossing) {
        torch::Tensor experts = r == 0 ? torch::zeros({4, 1}, torch::kLong)
                                       : torch::full({4, 1}, 2 + crossing, torch::kLong);
        if (crossing) experts = torch::full({4, 1}, r == 0 ? 3 : 0, torch::kLong);
        auto w = torch::rand({4, 1}, torch::kDouble);
        auto out = d.dispatch(x, experts);
        auto back = d.combine(out.tokens * 2.0, out, w);
        TORCH_CHECK(close(back, x * 2.0 * w), "round trip, crossing=", crossing);
      }
    });
    EXPECT_EQ(errors[0], "") << lanes << " lanes";
    EXPECT_EQ(errors[1], "") << lanes << " lanes";
  }
}

// all_to_all_sized over 3 ranks: rank r sends rank q (r + q) % 3 rows (none
// to itself from rank 0), row values naming sender, receiver and row, with
// counts [2] per rank; the receiver gets them in rank order with the
// counts, and the backward sends each row's gradient back to its sender.
TEST(Dispatch, CountsAtTheHeadOfTheRowsOverThreeRanks) {
  auto errors = on_ranks(3, [](int r, std::shared_ptr<Comm> g) {
    auto rows_to = [](int from, int to) { return int64_t((from + to) % 3); };
    auto counts = torch::zeros({3, 2}, torch::kLong);
    std::vector<torch::Tensor> parts;
    for (int q = 0; q < 3; ++q) {
      const int64_t n = rows_to(r, q);
      counts[q][0] = n / 2, counts[q][1] = n - n / 2;
      parts.push_back(torch::arange(n, torch::kDouble).unsqueeze(1).repeat({1, 2}) + 100.0 * r +
                      10.0 * q);
    }
    auto x = torch::cat(parts).requires_grad_(true);
    SizedRows got = all_to_all_sized(g, x, counts);
    std::vector<torch::Tensor> want;
    for (int q = 0; q < 3; ++q) {
      const int64_t n = rows_to(q, r);
      TORCH_CHECK(got.counts[q][0].item<int64_t>() == n / 2 &&
                      got.counts[q][1].item<int64_t>() == n - n / 2,
                  "counts from ", q);
      want.push_back(torch::arange(n, torch::kDouble).unsqueeze(1).repeat({1, 2}) + 100.0 * q +
                     10.0 * r);
    }
    TORCH_CHECK(close(got.rows, torch::cat(want)), "rows");
    // Each received row's gradient is its value times 3: x's gradient is 3x.
    torch::autograd::backward({(got.rows.detach() * 3.0 * got.rows).sum()});
    TORCH_CHECK(close(x.grad(), x.detach() * 3.0), "gradient");
    auto bad = torch::zeros({3, 2}, torch::kLong);
    bad[0][0] = 1;
    try {
      all_to_all_sized(g, torch::zeros({3, 2}, torch::kDouble), bad);
      TORCH_CHECK(false, "counts that miss the rows were taken");
    } catch (const c10::Error& e) {
      TORCH_CHECK(
          std::string(e.what()).find("add up to 1 rows but there are 3") != std::string::npos,
          e.what());
    }
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(errors[r], "") << "rank " << r;
}

MoELayerOptions layer_options() {
  MoELayerOptions o;
  o.d_model = 6;
  o.hidden = 10;
  o.router.num_experts = 4;
  o.router.top_k = 2;
  o.shared_experts = 1;
  return o;
}

struct Reference {
  std::vector<torch::Tensor> x, out, dx;
  std::map<std::string, torch::Tensor> grads;                  // summed over both ranks' data
  std::map<std::string, std::vector<torch::Tensor>> grads_of;  // per rank's data
};

// The layer with every expert local, run on each rank's batch in turn.
Reference reference(const MoELayerOptions& o, int ranks) {
  Reference ref;
  MoELayer whole(o, nullptr, 7, 0.3, 0.2);
  whole->to(torch::kDouble);
  for (int r = 0; r < ranks; ++r) {
    for (auto& p : whole->parameters())
      p.mutable_grad() = torch::Tensor();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
    auto x = torch::randn({2, 5, o.d_model}, gen, torch::kDouble).requires_grad_(true);
    auto out = whole->forward(x);
    auto loss = (out * out).sum() + whole->last_balance_loss();
    auto grads = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true);
    torch::autograd::backward({loss});
    ref.x.push_back(x.detach());
    ref.out.push_back(out.detach());
    ref.dx.push_back(grads[0]);
    for (const auto& p : whole->named_parameters()) {
      ref.grads_of[p.key()].push_back(p.value().grad().clone());
    }
  }
  for (const auto& [name, per_rank] : ref.grads_of)
    ref.grads[name] = torch::stack(per_rank).sum(0);
  return ref;
}

// Expert parallelism over 2 ranks equals the local layer: outputs, the
// input's gradient, the router's (from this rank's data) and each held
// expert's (from both ranks' data), with a fused backward and with dx then dw.
/// The input gradient of `loss`; the layer's parameters get theirs in .grad,
/// by one fused backward or by the dx/dw split (dx, then dw).
torch::Tensor backward(const torch::Tensor& loss, const torch::Tensor& x, MoELayerImpl& layer,
                       bool split) {
  if (!split) {
    auto dx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
    torch::autograd::backward({loss});
    return dx;
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : layer.parameters())
    params.push_back(p);
  hp::autograd::GradFunction fn({loss}, {x}, params);
  auto dx = fn.compute_input_grad()[0];
  fn.weight_grad_into_grad();
  return dx;
}

TEST(MoELayer, TwoRanksEqualEveryExpertLocalFusedAndSplit) {
  const auto o = layer_options();
  const Reference ref = reference(o, 2);
  for (int lanes : {1, int(hp::distributed::kPairLanes)})
    for (bool split : {false, true}) {
      auto errors = on_ranks(2, [&](int r, std::shared_ptr<Comm> plain) {
        auto g = hp::distributed::with_lanes(plain, lanes);
        MoELayer mine(o, g, 7, 0.3, 0.2);
        mine->to(torch::kDouble);
        TORCH_CHECK(mine->placement().local() == 2 && mine->expert_parameters().size() == 4);
        auto x = ref.x[r].clone().requires_grad_(true);
        auto out = mine->forward(x);
        TORCH_CHECK(close(out, ref.out[r]), "forward");
        auto dx = backward((out * out).sum() + mine->last_balance_loss(), x, *mine, split);
        TORCH_CHECK(close(dx, ref.dx[r]), "input gradient");
        for (const auto& p : mine->named_parameters()) {
          const bool expert = p.key().rfind("expert", 0) == 0;
          const auto& want = expert ? ref.grads.at(p.key()) : ref.grads_of.at(p.key())[r];
          TORCH_CHECK(p.value().grad().defined() && close(p.value().grad(), want), "gradient of ",
                      p.key());
        }
      });
      EXPECT_EQ(errors[0], "") << (split ? "split" : "fused") << ", " << lanes << " lanes";
      EXPECT_EQ(errors[1], "") << (split ? "split" : "fused") << ", " << lanes << " lanes";
    }
}

// Counts the waits of the thread that installs it.
struct CountWaits : hp::distributed::WaitObserver {
  int waits = 0;
  void before_wait(const hp::distributed::Work&) override { ++waits; }
  void after_wait() override {}
};

// The layer as a first stage (its input takes no gradient): with the dx/dw
// split its exchanges still run in dx, as anchors (NOTE [Anchors] in
// hp/autograd/split_plan.h), and dw waits on nothing, so a deferred W never
// communicates. Gradients equal the reference.
TEST(MoELayer, AFirstStagesSplitExchangesInDxAndNeverInDw) {
  const auto o = layer_options();
  const Reference ref = reference(o, 2);
  auto errors = on_ranks(2, [&](int r, std::shared_ptr<Comm> g) {
    MoELayer mine(o, g, 7, 0.3, 0.2);
    mine->to(torch::kDouble);
    auto out = mine->forward(ref.x[r]);
    std::vector<torch::Tensor> params;
    for (const auto& p : mine->parameters())
      params.push_back(p);
    hp::autograd::GradFunction fn({(out * out).sum() + mine->last_balance_loss()}, {}, params);
    CountWaits counted;
    {
      hp::distributed::WaitObserverScope scope(&counted);
      fn.compute_input_grad();
      TORCH_CHECK(counted.waits > 0, "dx made no exchange");
      const int in_dx = counted.waits;
      fn.weight_grad_into_grad();
      TORCH_CHECK(counted.waits == in_dx, "dw waited ", counted.waits - in_dx, " times");
    }
    for (const auto& p : mine->named_parameters()) {
      const bool expert = p.key().rfind("expert", 0) == 0;
      const auto& want = expert ? ref.grads.at(p.key()) : ref.grads_of.at(p.key())[r];
      TORCH_CHECK(p.value().grad().defined() && close(p.value().grad(), want), "gradient of ",
                  p.key());
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// NOTE [Grouped expert products] in hp/moe/moe_layer.cpp: in float32 the
// grouped product equals the loop over 2 expert-parallel ranks (outputs,
// input gradient, every parameter's gradient, fused and split); float64
// takes the loop under Auto. Where LibTorch has no grouped product (2.6),
// Auto is the loop and Grouped is refused, naming the version.
TEST(MoELayer, GroupedProductsEqualTheLoop) {
  auto o = layer_options();
  o.d_model = 8;  // float32 rows: multiples of 16 bytes
  o.hidden = 12;
  o.router.num_experts = 8;
  const bool have = hp::compat::has_grouped_mm(torch::kFloat, torch::kCPU);
  EXPECT_EQ(have, HP_TORCH_AT_LEAST(2, 9)) << hp::torch_version();
  for (bool split : {false, true}) {
    auto errors = on_ranks(2, [&](int r, std::shared_ptr<Comm> g) {
      auto make = [&](ExpertCompute how, torch::Dtype dtype) {
        auto oo = o;
        oo.experts = how;
        MoELayer layer(oo, g, 11, 0.3, 0.2);
        layer->to(dtype);
        return layer;
      };
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
      auto x0 = torch::randn({2, 7, o.d_model}, gen, torch::kFloat);
      std::vector<torch::Tensor> outs, dxs;
      std::vector<std::map<std::string, torch::Tensor>> grads;
      for (auto how : {ExpertCompute::Loop, ExpertCompute::Grouped}) {
        if (how == ExpertCompute::Grouped && !have) {
          auto layer = make(how, torch::kFloat);
          try {
            layer->forward(x0);
            TORCH_CHECK(false, "Grouped ran without a grouped product");
          } catch (const c10::Error& e) {
            TORCH_CHECK(
                std::string(e.what()).find("need LibTorch 2.9 or later") != std::string::npos,
                e.what());
          }
          return;
        }
        auto layer = make(how, torch::kFloat);
        auto x = x0.clone().requires_grad_(true);
        auto out = layer->forward(x);
        TORCH_CHECK(layer->last_grouped() == (how == ExpertCompute::Grouped), "path taken");
        auto dx = backward((out * out).sum() + layer->last_balance_loss(), x, *layer, split);
        outs.push_back(out.detach());
        dxs.push_back(dx);
        grads.emplace_back();
        for (const auto& p : layer->named_parameters())
          grads.back()[p.key()] = p.value().grad();
      }
      TORCH_CHECK(torch::allclose(outs[0], outs[1], 1e-5, 1e-6), "forward");
      TORCH_CHECK(torch::allclose(dxs[0], dxs[1], 1e-5, 1e-6), "input gradient");
      for (const auto& [name, want] : grads[0]) {
        const auto& got = grads[1].at(name);
        TORCH_CHECK(got.defined() && torch::allclose(got, want, 1e-5, 1e-6), "gradient of ", name);
      }
      // float64 under Auto: the loop.
      auto wide = make(ExpertCompute::Auto, torch::kDouble);
      wide->forward(x0.to(torch::kDouble));
      TORCH_CHECK(!wide->last_grouped(), "float64 took the grouped product");
    });
    EXPECT_EQ(errors[0], "") << (split ? "split" : "fused");
    EXPECT_EQ(errors[1], "") << (split ? "split" : "fused");
  }
  EXPECT_EQ(expert_compute_from_string("grouped"), ExpertCompute::Grouped);
  EXPECT_THROW(expert_compute_from_string("batched"), c10::Error);
}

TEST(MoELayer, ExpertsMustDivideOverTheGroup) {
  auto errors = on_ranks(2, [](int, std::shared_ptr<Comm> g) {
    auto o = layer_options();
    o.router.num_experts = 3;
    o.router.top_k = 1;
    MoELayer bad(o, g, 1, 0.1, 0.1);
  });
  EXPECT_NE(errors[0].find("do not divide over the 2 ranks"), std::string::npos) << errors[0];
}

}  // namespace
