// tests/schedule/test_fuse.cpp: the overlapped variants interleaved-1f1b-fb
// and zbv-fb (NOTE [Pairs in interleaved 1F1B and ZB-V] in
// hp/schedule/fuse.cpp): the base's actions on every rank, each once, as
// themselves or inside a pair; valid; pairs in the steady state; never
// slower than the base in the overlapped simulation at the build costs.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "hp/schedule/fuse.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/simulate.h"

namespace hs = hp::schedule;

namespace {

struct Case {
  std::string base;
  int p, m, v;
};

// The sizes the base builds at: interleaved-1f1b needs m % p == 0; ZB-V
// takes any m (m not a multiple of p included).
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int p : {1, 2, 3, 4, 6})
    for (int m : {1, 2, 3, 5, 8, 12, 16, 24})
      for (int v : {1, 2, 3}) {
        if (m % p == 0) out.push_back({"interleaved-1f1b", p, m, v});
        if (v == 2) out.push_back({"zbv", p, m, 2});
      }
  return out;
}

std::string label(const Case& c) {
  return c.base + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m) +
         " v=" + std::to_string(c.v);
}

hs::Schedule build(const std::string& name, const Case& c, const hs::CostModel& costs = {}) {
  hs::BuildOptions o;
  o.chunks = c.v;
  o.costs = costs;
  return hs::build(name, c.p, c.m, o);
}

// (op, stage, microbatch) of the F and backward (B or I) actions, counted.
using Key = std::tuple<hs::Op, int, int>;
std::map<Key, int> forwards_and_backwards(const std::vector<hs::Action>& row, bool pair_b_as_i) {
  std::map<Key, int> n;
  for (const auto& a : row) {
    if (a.op == hs::Op::FB) {
      ++n[{hs::Op::F, a.stage, a.microbatch}];
      ++n[{pair_b_as_i ? hs::Op::I : hs::Op::B, a.stage2, a.microbatch2}];
    } else if (a.op != hs::Op::W) {
      ++n[{a.op, a.stage, a.microbatch}];
    }
  }
  return n;
}

int count_pairs(const hs::Schedule& s) {
  int n = 0;
  for (const auto& row : s.actions)
    for (const auto& a : row)
      n += a.op == hs::Op::FB;
  return n;
}

double overlapped(const hs::Schedule& s, const hs::CostModel& c) {
  hs::SimOptions o;
  o.overlap_pairs = true;
  o.record_timeline = false;
  return hs::simulate(s, c, o).makespan;
}

}  // namespace

// Each F and each B (I for ZB-V) of the base appears exactly once on its
// rank, as itself or inside an FB; the rank keeps the base's order; a W
// is gone exactly where its I went into a pair.
TEST(FusePairs, EveryRankIsTheBaseWithPairs) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(label(c));
    const hs::Schedule base = build(c.base, c);
    const hs::Schedule fb = build(c.base + "-fb", c);
    EXPECT_EQ(fb.name, c.base + "-fb");
    ASSERT_EQ(fb.actions.size(), base.actions.size());
    const bool split = c.base == "zbv";
    for (int r = 0; r < c.p; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const auto want = forwards_and_backwards(base.actions[r], split);
      const auto got = forwards_and_backwards(fb.actions[r], split);
      EXPECT_EQ(got, want);
      for (const auto& [k, n] : got)
        EXPECT_EQ(n, 1);
      // Order: the base's list with each pair's halves and dropped W's
      // removed is the fused list with the pairs removed.
      std::map<std::tuple<int, int>, bool> paired_b;
      std::vector<hs::Action> rest_fb, rest_base;
      std::map<Key, bool> in_pair;
      for (const auto& a : fb.actions[r])
        if (a.op == hs::Op::FB) {
          in_pair[{hs::Op::F, a.stage, a.microbatch}] = true;
          in_pair[{split ? hs::Op::I : hs::Op::B, a.stage2, a.microbatch2}] = true;
          paired_b[{a.stage2, a.microbatch2}] = true;
        } else {
          rest_fb.push_back(a);
        }
      for (const auto& a : base.actions[r]) {
        if (in_pair.count({a.op, a.stage, a.microbatch})) continue;
        if (a.op == hs::Op::W && paired_b.count({a.stage, a.microbatch})) continue;
        rest_base.push_back(a);
      }
      // W's of unpaired I's may move past a pair's position, never past
      // other unpaired actions.
      std::vector<hs::Action> no_w_fb, no_w_base;
      for (const auto& a : rest_fb)
        if (a.op != hs::Op::W) no_w_fb.push_back(a);
      for (const auto& a : rest_base)
        if (a.op != hs::Op::W) no_w_base.push_back(a);
      EXPECT_EQ(no_w_fb, no_w_base);
      EXPECT_EQ(rest_fb.size(), rest_base.size());
      for (const auto& a : fb.actions[r])
        if (a.op == hs::Op::FB) EXPECT_NE(a.microbatch, a.microbatch2) << hs::to_string(a);
    }
  }
}

TEST(FusePairs, ValidLoweredAndSimulated) {
  for (const Case& c : cases())
    for (double comm : {0.0, 0.5}) {
      SCOPED_TRACE(label(c) + " comm=" + std::to_string(comm));
      hs::CostModel costs;
      costs.comm = comm;
      const hs::Schedule fb = build(c.base + "-fb", c, costs);
      ASSERT_NO_THROW(hs::validate(fb));
      const hs::Schedule low = hs::lower(fb);
      ASSERT_NO_THROW(hs::validate(low));
      const hs::SimResult r = hs::simulate(low, costs);
      for (int rk = 0; rk < c.p; ++rk)
        EXPECT_NEAR(r.rank_busy[rk], c.m * 3.0, 1e-9);
    }
}

// From m = 2p on, the steady state has pairs (at the default costs).
TEST(FusePairs, PairsInTheSteadyState) {
  for (const Case& c : cases()) {
    if (c.m < 2 * c.p || c.p < 2) continue;
    SCOPED_TRACE(label(c));
    const hs::Schedule fb = build(c.base + "-fb", c);
    EXPECT_GT(count_pairs(fb), 0);
    // A pair sits after the rank's first backward began (or is its first
    // backward) and no later than its last forward.
    for (const auto& row : fb.actions) {
      size_t first_back = row.size(), last_f = 0;
      for (size_t i = 0; i < row.size(); ++i) {
        const auto op = row[i].op;
        if (op == hs::Op::B || op == hs::Op::I || op == hs::Op::FB)
          first_back = std::min(first_back, i);
        if (op == hs::Op::F || op == hs::Op::FB) last_f = i;
      }
      for (size_t i = 0; i < row.size(); ++i)
        if (row[i].op == hs::Op::FB) {
          EXPECT_GE(i, first_back);
          EXPECT_LE(i, last_f);
        }
    }
  }
}

// Overlapped, the variant is never slower than its base at the costs it was
// built for: the defaults, and with transfers.
TEST(FusePairs, NeverSlowerThanTheBase) {
  for (const Case& c : cases())
    for (double comm : {0.0, 0.25, 1.0}) {
      SCOPED_TRACE(label(c) + " comm=" + std::to_string(comm));
      hs::CostModel costs;
      costs.comm = comm;
      const double base = overlapped(build(c.base, c), costs);
      const double fb = overlapped(build(c.base + "-fb", c, costs), costs);
      EXPECT_LE(fb, base + 1e-9);
    }
}

// With transfers that take time, pairs let the half whose input is there
// run while the other's is in flight: interleaved-1f1b-fb is faster. (ZB-V's
// pairs carry their W, so zbv-fb only ties its base: NOTE [Pairs in
// interleaved 1F1B and ZB-V].)
TEST(FusePairs, FasterWithTransfers) {
  hs::CostModel costs;
  costs.comm = 1.0;
  for (int p : {2, 4, 8})
    for (int v : {2, 3}) {
      const Case c{"interleaved-1f1b", p, 4 * p, v};
      SCOPED_TRACE(label(c));
      const double base = overlapped(build(c.base, c), costs);
      const double fb = overlapped(build("interleaved-1f1b-fb", c, costs), costs);
      EXPECT_LT(fb, base - 0.25);
    }
  // The example of docs/schedules.md: p=4, m=16, v=2, comm=1.
  const Case c{"interleaved-1f1b", 4, 16, 2};
  EXPECT_DOUBLE_EQ(overlapped(build(c.base, c), costs), 75.5);
  EXPECT_DOUBLE_EQ(overlapped(build("interleaved-1f1b-fb", c, costs), costs), 74.5);
}

TEST(FusePairs, RefusesALoweredScheduleAndKeepsTheBaseConstraints) {
  const hs::Schedule low = hs::lower(hs::build("zbv", 2, 4));
  EXPECT_THROW(hs::fuse_pairs(low), std::invalid_argument);
  hs::BuildOptions o;
  o.chunks = 2;
  try {
    hs::build("interleaved-1f1b-fb", 4, 6, o);
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("m % p == 0"), std::string::npos) << e.what();
  }
  // A tiny work bound: fewer pairs tried, still valid and no slower.
  const hs::Schedule base = hs::build("interleaved-1f1b", 4, 16, o);
  const hs::Schedule fb = hs::fuse_pairs(base, {}, 1);
  EXPECT_NO_THROW(hs::validate(fb));
  EXPECT_LE(overlapped(fb, {}), overlapped(base, {}) + 1e-9);
}
