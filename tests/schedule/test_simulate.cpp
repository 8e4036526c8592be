// tests/schedule/test_simulate.cpp: the simulator against the closed forms
// (seed 004, Zero Bubble paper), memory claims, communication, per-stage
// costs, and zb-auto against its baselines.
#include <gtest/gtest.h>

#include <algorithm>
#include <ctime>
#include <string>

#include "hp/schedule/formulas.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/simulate.h"

namespace hs = hp::schedule;

namespace {
hs::CostModel costs(double f, double b, double w, double comm = 0) {
  hs::CostModel c;
  c.f = f;
  c.b = b;
  c.w = w;
  c.comm = comm;
  return c;
}
double bubble(const hs::SimResult& r) {
  return r.span - r.work;
}
}  // namespace

// Seed 004's worked example: AFAB, p=4, m=8 idles 9/33 = 0.2727 of the time.
TEST(ClosedForm, AfabIdleFractionSeedExample) {
  hs::SimResult r = hs::simulate(hs::build("gpipe", 4, 8), costs(1, 1, 1));
  EXPECT_NEAR(r.idle_fraction, 9.0 / 33.0, 1e-12);
  EXPECT_NEAR(r.bubble_rate, 0.2727, 1e-4);
  hs::ClosedForm cf = hs::closed_form("gpipe", 4, 8, 1, costs(1, 1, 1));
  EXPECT_NEAR(cf.ratio, 3.0 / 8.0, 1e-12);  // r_bubble = (p-1)/m
  EXPECT_NEAR(cf.bubble_rate, 3.0 / 11.0, 1e-12);
}

// Seed 004: interleaved v=2, p=4, m=8: ratio 3/16, wall-clock fraction 3/19.
TEST(ClosedForm, InterleavedSeedExample) {
  hs::BuildOptions o;
  o.chunks = 2;
  hs::SimResult r = hs::simulate(hs::build("interleaved-1f1b", 4, 8, o), costs(1, 1, 1));
  EXPECT_NEAR(r.bubble_rate, 3.0 / 19.0, 1e-12);
  hs::ClosedForm cf = hs::closed_form("interleaved-1f1b", 4, 8, 2, costs(1, 1, 1));
  EXPECT_NEAR(cf.ratio, 3.0 / 16.0, 1e-12);
  EXPECT_NEAR(cf.bubble_rate, 3.0 / 19.0, 1e-12);
}

// Seed 004: naive (m=1) wastes (p-1)/p of the time; ratio p-1.
TEST(ClosedForm, NaiveSeedExample) {
  hs::SimResult r = hs::simulate(hs::build("naive", 4, 1), costs(1, 1, 1));
  EXPECT_NEAR(r.bubble_rate, 0.75, 1e-12);
  EXPECT_NEAR(hs::closed_form("naive", 4, 1, 1, costs(1, 1, 1)).ratio, 3.0, 1e-12);
}

TEST(ClosedForm, MatchesSimulatorOverSizesAndCosts) {
  struct C {
    double f, b, w;
  };
  // Costs where each formula's assumptions hold: ZB-H1/H2 are laid out at
  // unit costs, and their formulas hold here for W <= F <= B (ZB-H2 also
  // needs m >= 2p microbatches to fill its warmup).
  for (C c : {C{1, 1, 1}, C{1, 2, 1}, C{1, 1, 0.5}}) {
    hs::CostModel cm = costs(c.f, c.b, c.w);
    for (int p : {2, 3, 4, 6, 8}) {
      for (int k : {1, 2, 3}) {
        const int m = k * p;
        for (const char* name : {"naive", "gpipe", "1f1b", "zb-h1", "zb-h2"}) {
          if (std::string(name) == "zb-h2" && m < 2 * p) {
            EXPECT_FALSE(hs::closed_form(name, p, m, 1, cm).known);
            continue;
          }
          SCOPED_TRACE(std::string(name) + " p=" + std::to_string(p) + " m=" + std::to_string(m));
          hs::ClosedForm cf = hs::closed_form(name, p, m, 1, cm);
          ASSERT_TRUE(cf.known && cf.matches_simulator);
          hs::SimResult r = hs::simulate(hs::build(name, p, m), cm);
          EXPECT_NEAR(bubble(r), cf.bubble, 1e-9);
          EXPECT_NEAR(r.bubble_rate, cf.bubble_rate, 1e-9);
        }
        for (int v : {2, 3}) {
          hs::BuildOptions o;
          o.chunks = v;
          hs::ClosedForm cf = hs::closed_form("interleaved-1f1b", p, m, v, cm);
          hs::SimResult r = hs::simulate(hs::build("interleaved-1f1b", p, m, o), cm);
          EXPECT_NEAR(bubble(r), cf.bubble, 1e-9) << "p=" << p << " m=" << m << " v=" << v;
        }
      }
    }
  }
}

// 1F1B bubble (p-1)(F+B+W); ZB-H1 (p-1)(F+B-W); ZB-H2 and ZB-V zero at F=B=W.
TEST(ClosedForm, ZeroBubbleClaimsAtUnitCosts) {
  hs::CostModel unit = costs(1, 1, 1);
  for (int p : {2, 4, 5, 8}) {
    for (int m : {2 * p, 3 * p, 4 * p}) {
      EXPECT_NEAR(bubble(hs::simulate(hs::build("1f1b", p, m), unit)), 3.0 * (p - 1), 1e-9);
      EXPECT_NEAR(bubble(hs::simulate(hs::build("zb-h1", p, m), unit)), 1.0 * (p - 1), 1e-9);
      EXPECT_NEAR(hs::simulate(hs::build("zb-h2", p, m), unit).bubble_rate, 0.0, 1e-12);
      EXPECT_NEAR(hs::simulate(hs::build("zbv", p, m), unit).bubble_rate, 0.0, 1e-12);
    }
  }
}

// DeepSeek's DualPipe formula counts an overlapped F&B chunk as one unit of
// time that hides part of its neighbours; our FB is one block whose outputs
// leave at its end, so the formula is reference only (matches_simulator is
// false). What holds in this model: at unit costs DualPipe's bubble is
// (p/2-1)(2F+B-W) = p-2, half of ZB-H1's (p-1) rounded, and for other costs
// it stays below 1F1B's.
TEST(ClosedForm, DualPipeInThisModel) {
  struct C {
    double f, b, w;
  };
  for (int p : {2, 4, 6, 8})
    for (int m : {2 * p, 4 * p})
      EXPECT_NEAR(bubble(hs::simulate(hs::build("dualpipe", p, m), costs(1, 1, 1))), p - 2.0, 1e-9);
  for (C c : {C{1, 2, 1}, C{1, 1, 0.5}, C{2, 1, 1}}) {
    hs::CostModel cm = costs(c.f, c.b, c.w);
    for (int p : {2, 4, 6, 8}) {
      for (int m : {2 * p, 4 * p}) {
        hs::SimResult r = hs::simulate(hs::build("dualpipe", p, m), cm);
        EXPECT_LE(bubble(r), bubble(hs::simulate(hs::build("1f1b", p, m), cm)) + 1e-9);
      }
    }
  }
  EXPECT_FALSE(hs::closed_form("dualpipe", 4, 8, 1, costs(1, 1, 1)).matches_simulator);
  EXPECT_FALSE(hs::closed_form("zb-auto", 4, 8, 1, costs(1, 1, 1)).known);
}

TEST(Memory, PeaksMatchTheClaims) {
  hs::CostModel c = costs(1, 1, 1);
  c.mem_b = 1;
  c.mem_w = 0.5;
  const int p = 4, m = 16;
  hs::SimResult g = hs::simulate(hs::build("gpipe", p, m), c);
  for (int r = 0; r < p; ++r)
    EXPECT_NEAR(g.peak_memory[r], m, 1e-12);  // AFAB holds all m
  hs::SimResult f = hs::simulate(hs::build("1f1b", p, m), c);
  for (int r = 0; r < p; ++r)
    EXPECT_NEAR(f.peak_memory[r], p - r, 1e-12);  // 1F1B: p - r
  // ZB-H1 and ZB-V stay within 1F1B's peak (p * M_B); ZB-H2 within 2p * M_B.
  EXPECT_LE(hs::simulate(hs::build("zb-h1", p, m), c).max_peak_memory, p + 1e-12);
  EXPECT_LE(hs::simulate(hs::build("zbv", p, m), c).max_peak_memory, p + 1e-12);
  EXPECT_LE(hs::simulate(hs::build("zb-h2", p, m), c).max_peak_memory, 2 * p + 1e-12);
  EXPECT_GT(hs::simulate(hs::build("zb-h2", p, m), c).max_peak_memory, p);
}

TEST(Simulate, CommunicationDelaysCrossRankHopsOnly) {
  // Naive at m=1 is a chain: 2(p-1) cross-rank hops, each paying comm.
  const int p = 4;
  hs::SimResult r0 = hs::simulate(hs::build("naive", p, 1), costs(1, 1, 1, 0));
  hs::SimResult r1 = hs::simulate(hs::build("naive", p, 1), costs(1, 1, 1, 0.5));
  EXPECT_NEAR(r1.makespan - r0.makespan, 2 * (p - 1) * 0.5, 1e-12);
  EXPECT_EQ(r1.comm_volume, 2 * (p - 1));
  // ZB-V's turn of the V is local: p=1 has no cross-rank hop at all.
  hs::SimResult v = hs::simulate(hs::build("zbv", 1, 4), costs(1, 1, 1, 5));
  EXPECT_EQ(v.comm_volume, 0);
  EXPECT_NEAR(v.makespan, 4 * 3.0, 1e-12);
}

TEST(Simulate, PerStageCostsOverrideTheDefaults) {
  hs::Schedule s = hs::build("gpipe", 2, 1);
  hs::CostModel c = costs(1, 1, 1);
  c.stage_f = {1, 5};
  c.stage_b = {1, 1};
  c.stage_w = {1, 1};
  hs::SimResult r = hs::simulate(s, c);
  // 0F0 [0,1), 1F0 [1,6), 1B0 [6,8), 0B0 [8,10).
  EXPECT_NEAR(r.makespan, 10, 1e-12);
  ASSERT_EQ(r.timeline.events.size(), 4u);
  EXPECT_THROW(hs::simulate(s, costs(0, 1, 1)), std::invalid_argument);
  EXPECT_THROW(hs::simulate(s, costs(1, 1, 1, -1)), std::invalid_argument);
}

TEST(Simulate, TimelineEventsAreOrderedPerRankAndRespectDependencies) {
  hs::SimResult r = hs::simulate(hs::build("zbv", 4, 8), costs(1, 2, 1, 0.3));
  std::vector<double> last(4, 0.0);
  for (const auto& e : r.timeline.events) {
    EXPECT_GE(e.start + 1e-12, last[e.rank]);
    EXPECT_GT(e.end, e.start);
    last[e.rank] = e.end;
  }
  EXPECT_NEAR(r.timeline.makespan(), r.makespan, 1e-12);
}

// zb-auto keeps the best of the heuristic runs and the hand-made schedules:
// never worse than ZB-H1, ZB-H2 or 1F1B when they fit the memory limit.
TEST(ZbAuto, NoWorseThanItsBaselinesAndWithinMemory) {
  struct Case {
    int p, m;
    double f, b, w, comm, limit_x;
  };
  for (Case k :
       {Case{4, 8, 1, 1, 1, 0, 2}, Case{4, 12, 1, 2, 1, 0.2, 2}, Case{6, 12, 1, 1.5, 0.7, 0.1, 1},
        Case{8, 24, 1, 2, 1.5, 0.3, 1.5}, Case{5, 10, 2, 1, 1, 0, 3}}) {
    hs::BuildOptions o;
    o.costs = costs(k.f, k.b, k.w, k.comm);
    o.mem_limit = k.limit_x * k.p * o.costs.mem_b;
    hs::SimResult a = hs::simulate(hs::build("zb-auto", k.p, k.m, o), o.costs);
    EXPECT_LE(a.max_peak_memory, o.mem_limit + 1e-9);
    for (const char* base : {"zb-h1", "zb-h2", "1f1b"}) {
      hs::SimResult r = hs::simulate(hs::build(base, k.p, k.m), o.costs);
      if (r.max_peak_memory <= o.mem_limit + 1e-9) {
        EXPECT_LE(bubble(a), bubble(r) + 1e-9) << base;
      }
    }
  }
}

TEST(ZbAuto, BeatsTheHandMadeScheduleWhenCostsDiffer) {
  // With F = 2, the unit-cost layout of ZB-H2 leaves a bubble; the search
  // adapts the warmup to the real costs and finds a strictly smaller one.
  hs::BuildOptions o;
  o.costs = costs(2, 1, 1, 0.1);
  o.mem_limit = 2 * 4 * o.costs.mem_b;
  double autob = bubble(hs::simulate(hs::build("zb-auto", 4, 16, o), o.costs));
  double h2 = bubble(hs::simulate(hs::build("zb-h2", 4, 16), o.costs));
  EXPECT_LT(autob, h2 - 1e-9);
}

// Issue 17: zb-auto (and the cost-aware ZB-V) stay under one second at p = 32,
// m = 256 with every search on. CPU time of this process, so a busy machine
// does not fail it; optimised builds only (a debug build is several times
// slower).
TEST(ZbAuto, UnderOneSecondAtP32M256) {
#ifdef NDEBUG
  hs::BuildOptions o;
  o.costs = costs(10.4, 10.25, 7.7, 0.46);  // the paper's 28.3B row
  o.costs.mem_w = 0.43;
  for (const char* name : {"zb-auto", "zbv"}) {
    std::clock_t t0 = std::clock();
    hs::Schedule s = hs::build(name, 32, 256, o);
    const double cpu = static_cast<double>(std::clock() - t0) / CLOCKS_PER_SEC;
    EXPECT_LT(cpu, 1.0) << name;
    EXPECT_EQ(s.num_microbatches, 256);
  }
#else
  GTEST_SKIP() << "timing is checked in optimised builds";
#endif
}
