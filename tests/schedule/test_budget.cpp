// tests/schedule/test_budget.cpp: the controllable-memory family (V-Min,
// V-Half, V-ZB) against the paper's formulas, the memory-budget search `auto`
// against every fixed schedule that fits its limit (equal and random costs,
// within its time budget), `recommend`, and the refusals that name a bound.
#include <gtest/gtest.h>

#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "hp/schedule/budget.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/search/heuristics.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/vshape.h"

namespace hs = hp::schedule;

namespace {

hs::SimResult sim(const hs::Schedule& s, const hs::CostModel& c) {
  hs::SimOptions quiet;
  quiet.record_timeline = false;
  return hs::simulate(s, hs::costs_for_cut(c, s), quiet);
}

// The paper's memory count: activations held from F until W (I frees nothing).
hs::CostModel paper_costs() {
  hs::CostModel c;
  c.mem_w = 1.0;
  return c;
}

constexpr double kTol = 1e-9;

// Every fixed generator (not a search) that builds at p, m.
std::vector<std::pair<std::string, hs::Schedule>> fixed_schedules(int p, int m) {
  std::vector<std::pair<std::string, hs::Schedule>> out;
  for (const auto& n : hs::names()) {
    if (n == "zb-auto" || n == "zbv-auto" || n == "auto") continue;
    try {
      out.emplace_back(n, hs::build(n, p, m));
    } catch (const std::invalid_argument&) {
    }
  }
  return out;
}

struct Size {
  int p, m;
};

class VFamily : public ::testing::TestWithParam<Size> {};

// NOTE [V-shape building blocks], at T_F = T_B = T_W = 1 and the paper's
// memory count (mem_b = mem_w = 1: held until W). Asserted exactly:
//   peak memory (microbatches): V-Min (p+4)/3, V-Half (p+2)/2 (integer
//   division, the paper's table), V-ZB p;
//   bubble time, span - 3m (the paper's bubble rate times its span): V-Min in
//   [2p/3, 2p], V-Half in [p/2, 3p/2] (the paper's rates ~2p/3m and ~p/2m
//   are these upper ends divided by 3m), V-ZB exactly 0 (m >= 3p here).
TEST_P(VFamily, MatchesThePapersFormulas) {
  const auto [p, m] = GetParam();
  const hs::CostModel c = paper_costs();
  struct Want {
    hs::VBlock kind;
    double peak, lo, hi;
  };
  for (const Want& w : {Want{hs::VBlock::Min, double((p + 4) / 3), 2.0 * p / 3, 2.0 * p},
                        Want{hs::VBlock::Half, double((p + 2) / 2), p / 2.0, 1.5 * p},
                        Want{hs::VBlock::ZB, double(p), 0.0, 0.0}}) {
    hs::Schedule s = hs::v_block_schedule(w.kind, p, m);
    SCOPED_TRACE(s.name + " p=" + std::to_string(p) + " m=" + std::to_string(m));
    ASSERT_NO_THROW(hs::validate(hs::lower(s)));
    const hs::SimResult r = sim(s, c);
    EXPECT_NEAR(r.max_peak_memory, w.peak, kTol);
    const double bubble = r.span - 3.0 * m;
    EXPECT_NEAR(r.work, 3.0 * m, kTol);
    EXPECT_GE(bubble, w.lo - kTol);
    EXPECT_LE(bubble, w.hi + kTol);
    // The search at the block's own memory is at or below it.
    hs::SearchOptions fast;
    fast.candidate_work = 1'000'000;
    const hs::SimResult a = sim(hs::auto_search(p, m, c, r.max_peak_memory, fast), c);
    EXPECT_LE(a.max_peak_memory, r.max_peak_memory + kTol);
    EXPECT_LE(a.makespan, r.makespan + kTol);
    EXPECT_LE(a.bubble_rate, r.bubble_rate + kTol);
  }
}

// The search at 1/3, 1/2 and 1x of 1F1B's memory (p mem_b) is at or below
// every fixed schedule that fits the same limit: V-Min, V-Half, V-ZB, ZB-H1,
// ZB-H2 and the rest.
TEST_P(VFamily, SearchAtOneThirdHalfAndOneOfOneF1BIsAtOrBelowEveryFit) {
  const auto [p, m] = GetParam();
  const hs::CostModel c = paper_costs();
  const auto fixed = fixed_schedules(p, m);
  for (double frac : {1.0 / 3, 0.5, 1.0}) {
    const double limit = frac * p;
    hs::SearchOptions fast;
    fast.candidate_work = 1'000'000;
    const hs::Schedule a = hs::auto_search(p, m, c, limit, fast);
    ASSERT_NO_THROW(hs::validate(hs::lower(a)));
    const hs::SimResult ra = sim(a, c);
    EXPECT_LE(ra.max_peak_memory, limit + kTol);
    int fits = 0;
    for (const auto& [name, s] : fixed) {
      const hs::SimResult r = sim(s, c);
      if (r.max_peak_memory > limit + kTol) continue;
      ++fits;
      SCOPED_TRACE(name + " limit " + std::to_string(limit));
      EXPECT_LE(ra.makespan, r.makespan + kTol);
      if (name.rfind("v-", 0) == 0 || name.rfind("zb-h", 0) == 0) {
        EXPECT_LE(ra.bubble_rate, r.bubble_rate + kTol);
      }
    }
    EXPECT_GE(fits, 1);  // naive at least
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, VFamily,
                         ::testing::Values(Size{4, 12}, Size{4, 16}, Size{4, 24}, Size{8, 24},
                                           Size{8, 32}, Size{8, 48}, Size{16, 48}, Size{16, 64},
                                           Size{16, 96}),
                         [](const ::testing::TestParamInfo<Size>& i) {
                           return "p" + std::to_string(i.param.p) + "m" + std::to_string(i.param.m);
                         });

// Random per-stage costs (F, B, W in [0.5, 2], transfer in [0, 0.2]) and a
// random limit between the smallest feasible and 2x of 1F1B's: the search is
// never slower than a fixed schedule that fits, and stays within its budget.
TEST(BudgetSearch, NeverWorseThanAFixedScheduleThatFitsOnRandomCosts) {
  std::mt19937 rng(32);
  std::uniform_real_distribution<double> cost(0.5, 2.0), comm(0.0, 0.2), frac(0.0, 1.0);
  for (int trial = 0; trial < 12; ++trial) {
    const int p = trial % 3 == 2 ? 8 : 4;
    const int m = p * (2 + trial % 4);
    hs::CostModel c;
    for (int r = 0; r < p; ++r) {
      c.stage_f.push_back(cost(rng));
      c.stage_b.push_back(cost(rng));
      c.stage_w.push_back(cost(rng));
      c.stage_comm.push_back(comm(rng));
      c.stage_mem_b.push_back(1.0);
      c.stage_mem_w.push_back(0.5);
    }
    const double lo = hs::smallest_feasible_memory(p, m, c);
    const double limit = lo + frac(rng) * (2.0 * p - lo);
    SCOPED_TRACE("trial " + std::to_string(trial) + " p=" + std::to_string(p) +
                 " m=" + std::to_string(m) + " limit=" + std::to_string(limit));
    const std::clock_t t0 = std::clock();
    hs::SearchStats st;
    const hs::Schedule a = hs::auto_search(p, m, c, limit, {}, &st);
    const double cpu = static_cast<double>(std::clock() - t0) / CLOCKS_PER_SEC;
    EXPECT_LT(cpu, 1.0);
    ASSERT_NO_THROW(hs::validate(hs::lower(a)));
    const hs::SimResult ra = sim(a, c);
    EXPECT_LE(ra.max_peak_memory, limit + kTol);
    for (const auto& [name, s] : fixed_schedules(p, m)) {
      const hs::SimResult r = sim(s, c);
      if (r.max_peak_memory > limit + kTol) continue;
      EXPECT_LE(ra.makespan, r.makespan + kTol) << name << " (search took " << st.winner << ")";
    }
  }
}

// NOTE [Budget of the memory search]: under a second at p = 16, m = 8p.
TEST(BudgetSearch, UnderItsTimeBudgetAtP16M128) {
#ifdef NDEBUG
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.5, 2.0), comm(0.0, 0.2);
  hs::CostModel c;
  for (int r = 0; r < 16; ++r) {
    c.stage_f.push_back(cost(rng));
    c.stage_b.push_back(cost(rng));
    c.stage_w.push_back(cost(rng));
    c.stage_comm.push_back(comm(rng));
  }
  for (double frac : {0.34, 1.0}) {
    const std::clock_t t0 = std::clock();
    hs::SearchStats st;
    hs::auto_search(16, 128, c, frac * 16, {}, &st);
    const double cpu = static_cast<double>(std::clock() - t0) / CLOCKS_PER_SEC;
    EXPECT_LT(cpu, 1.0) << frac;
    EXPECT_LE(st.work, hs::kAutoWork * 2) << frac;
  }
#else
  GTEST_SKIP() << "timing is checked in optimised builds";
#endif
}

// The same inputs give the same lists (every rank builds its own copy).
TEST(BudgetSearch, IsDeterministic) {
  hs::CostModel c;
  c.f = 1.3;
  c.w = 0.7;
  c.comm = 0.1;
  const hs::Schedule a = hs::auto_search(4, 12, c, 2.0);
  const hs::Schedule b = hs::auto_search(4, 12, c, 2.0);
  EXPECT_EQ(a.actions, b.actions);
  EXPECT_EQ(a.stage_rank, b.stage_rank);
}

// Bad input: a clear error naming the bound, never an endless search.
TEST(BudgetSearch, RefusesALimitBelowTheSmallestFeasible) {
  hs::CostModel c;
  EXPECT_NEAR(hs::smallest_feasible_memory(8, 24, c), 1.0, kTol);  // one microbatch
  try {
    hs::auto_search(8, 24, c, 0.9);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("below the smallest any schedule reaches (1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("at least 1"), std::string::npos) << msg;
  }
  // At the bound itself the search still finds a schedule.
  const hs::Schedule s = hs::auto_search(8, 24, c, 1.0);
  EXPECT_LE(sim(s, c).max_peak_memory, 1.0 + kTol);
  hs::BuildOptions o;
  o.mem_limit = 0.5;
  EXPECT_THROW(hs::build("auto", 4, 8, o), std::invalid_argument);
}

TEST(BudgetSearch, RefusesCostsThatDoNotDescribeTheCut) {
  hs::CostModel c;
  c.stage_f = {1, 1, 1};  // 3 stages for 4 ranks
  c.stage_b = {1, 1, 1};
  c.stage_w = {1, 1, 1};
  try {
    hs::auto_search(4, 8, c, 4.0);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("stage_f has 3 entries; a p-stage cut needs p=4"),
              std::string::npos)
        << e.what();
  }
  // A cut into 2p stages (e.g. costs made for a V) folds into the p-stage cut.
  hs::CostModel v;
  v.stage_f = {0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5};
  v.stage_b = v.stage_f;
  v.stage_w = v.stage_f;
  const hs::CostModel folded = hs::costs_per_rank(v, 4);
  EXPECT_EQ(folded.stage_f, (std::vector<double>{1, 1, 1, 1}));
  EXPECT_NO_THROW(hs::auto_search(4, 8, v, 4.0));
  hs::CostModel neg;
  neg.f = -1;
  EXPECT_THROW(hs::auto_search(4, 8, neg, 4.0), std::invalid_argument);
}

TEST(VBlocks, AnyMicrobatchCountBuildsAndSmallOnesAreRefusedClearly) {
  for (auto kind : {hs::VBlock::Min, hs::VBlock::Half, hs::VBlock::ZB})
    for (int p : {1, 2, 3, 5})
      for (int m : {1, 2, 3, 7}) {
        hs::Schedule s = hs::v_block_schedule(kind, p, m);
        EXPECT_NO_THROW(hs::validate(hs::lower(s))) << s.name << " p=" << p << " m=" << m;
      }
  try {
    hs::v_block_schedule(hs::VBlock::Min, 4, 0);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs p >= 1 and m >= 1 (got p=4, m=0)"),
              std::string::npos)
        << e.what();
  }
  // A block whose ops collide on a slot is refused naming the rank.
  std::vector<hs::BlockOffsets> bad = hs::v_block_offsets(hs::VBlock::Min, 3);
  bad[1].f_up = bad[1].f_down + 6;
  EXPECT_THROW(hs::schedule_from_v_block(bad, 3, 6, "bad"), std::invalid_argument);
  EXPECT_THROW(hs::v_block_family(4, 4, 4, 1), std::invalid_argument);     // collides modulo 6
  EXPECT_THROW(hs::v_block_family(4, 1, 1, 1, 5), std::invalid_argument);  // period < 6
}

TEST(GreedyV, RefusesALimitBelowOneMicrobatchAndKeepsAnyOtherLimit) {
  hs::CostModel c;
  hs::VGreedyParams vp;
  vp.priority = hs::v_block_offsets(hs::VBlock::Min, 4);
  vp.mem_limit = 0.9;  // a rank holds both stages: 0.5 + 0.5
  try {
    hs::greedy_v(4, 8, c, vp);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot hold one microbatch on rank 0"), std::string::npos)
        << e.what();
  }
  for (double limit : {1.0, 1.5, 2.0, 3.0, 4.0}) {
    vp.mem_limit = limit;
    hs::Schedule s = hs::greedy_v(4, 16, c, vp);
    ASSERT_NO_THROW(hs::validate(hs::lower(s)));
    EXPECT_LE(sim(s, c).max_peak_memory, limit + kTol) << limit;
  }
}

// recommend(): the fitting ones first, by step time; the top one is at least
// as fast as every fitting schedule and its CSV reads back.
TEST(Recommend, SortsFittingSchedulesByStepTime) {
  hs::CostModel c;
  c.stage_f = {1.4, 1.0, 1.0, 1.9};
  c.stage_b = {1.4, 1.0, 1.0, 2.1};
  c.stage_w = {0.7, 0.8, 0.8, 1.0};
  c.stage_comm = {0.1, 0.1, 0.1, 0.1};
  c.stage_mem_b = {1, 1, 1, 1.5};
  c.stage_mem_w = {0.5, 0.5, 0.5, 0.7};
  std::vector<std::pair<std::string, std::string>> skipped;
  const auto rows = hs::recommend(4, 16, c, 3.0, &skipped);
  ASSERT_FALSE(rows.empty());
  EXPECT_TRUE(rows.front().fits);
  bool seen_unfit = false;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].fits) seen_unfit = true;
    EXPECT_FALSE(seen_unfit && rows[i].fits) << rows[i].name;
    if (i > 0 && rows[i].fits) {
      EXPECT_GE(rows[i].result.makespan, rows[i - 1].result.makespan - kTol) << rows[i].name;
    }
  }
  bool auto_listed = false;
  for (const auto& r : rows)
    auto_listed = auto_listed || r.name == "auto";
  EXPECT_TRUE(auto_listed);
  const hs::Schedule back = hs::from_csv(hs::to_csv(rows.front().schedule));
  EXPECT_NO_THROW(hs::validate(hs::lower(back)));
}

}  // namespace
