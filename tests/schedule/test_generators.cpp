// tests/schedule/test_generators.cpp: golden action lists (p=4) of the
// classic schedules, placement data, property tests over many (p, m, v), and
// the error message of every constraint.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/search/heuristics.h"
#include "hp/schedule/simulate.h"

namespace hs = hp::schedule;

namespace {
std::vector<std::string> rows(const hs::Schedule& s) {
  std::vector<std::string> out;
  for (const auto& r : s.actions)
    out.push_back(hs::format_actions(r));
  return out;
}
}  // namespace

// Hand-derived: each microbatch goes all the way down and back up alone.
TEST(Golden, Naive) {
  EXPECT_EQ(rows(hs::build("naive", 4, 2)),
            (std::vector<std::string>{"0F0 0B0 0F1 0B1", "1F0 1B0 1F1 1B1", "2F0 2B0 2F1 2B1",
                                      "3F0 3B0 3F1 3B1"}));
}

// Hand-derived AFAB: all forwards, then all backwards.
TEST(Golden, GPipe) {
  EXPECT_EQ(rows(hs::build("gpipe", 4, 4)),
            (std::vector<std::string>{
                "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
                "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3", "3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3"}));
}

// Hand-derived 1F1B (Megatron): rank r warms up with p-1-r forwards.
TEST(Golden, OneFOneB) {
  EXPECT_EQ(rows(hs::build("1f1b", 4, 8)),
            (std::vector<std::string>{
                "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
                "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
                "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
                "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"}));
}

// Hand-derived from Megatron's rule: warmup (p-r-1)*2 + (v-1)*p forwards;
// k-th forward runs chunk (k/p)%v on microbatch (k/(pv))*p + k%p; backwards
// likewise with chunks reversed. Stage = chunk * p + rank.
TEST(Golden, InterleavedDepthFirst) {
  hs::BuildOptions o;
  o.chunks = 2;
  auto got = rows(hs::build("interleaved-1f1b", 4, 8, o));
  EXPECT_EQ(got[0],
            "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 "
            "4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7");
  EXPECT_EQ(got[3],
            "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 "
            "7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7");
}

TEST(Golden, InterleavedBreadthFirst) {
  hs::BuildOptions o;
  o.chunks = 2;
  auto got = rows(hs::build("interleaved-bfs", 4, 2, o));
  EXPECT_EQ(got[1], "1F0 1F1 5F0 5F1 5B0 5B1 1B0 1B1");
}

// The ZB-H1 of the paper's figure: 1F1B warmup, W deferred, rank 0 never
// holds more than p microbatches, the last rank defers p-1 W's.
TEST(Golden, ZbH1) {
  auto got = rows(hs::build("zb-h1", 4, 8));
  EXPECT_EQ(got[0],
            "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 "
            "0I6 0W6 0I7 0W7");
  EXPECT_EQ(got[3],
            "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 "
            "3W4 3W5 3W6 3W7");
}

// ZB-V after torch.distributed.pipelining's ScheduleZBVZeroBubble rule.
TEST(Golden, Zbv) {
  auto got = rows(hs::build("zbv", 4, 8));
  EXPECT_EQ(got[3],
            "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 "
            "4I2 4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 "
            "3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7");
}

// DualPipeV after DeepSeek's eight steps (dualpipev.py), rank 0 and the last rank.
TEST(Golden, DualPipeV) {
  auto got = rows(hs::build("dualpipev", 4, 8));
  EXPECT_EQ(got[0],
            "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7+7B3 "
            "7F4+0B0 7B4 7F5+0B1 7B5 7F6+0B2 7B6 7F7+0B3 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7");
  EXPECT_EQ(got[3],
            "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4+3B0 3F5+4B1 4F5+3B1 3F6+4B2 4F6+3B2 "
            "3F7+4B3 4F7+3B3 4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7");
}

// Hand-derived: interleaved-1f1b's F and backward order with warmup
// (v-1)p + p-1-r, each B split into I then W, rank r's W trailing its I by r
// I's (rank 1: 3W0 after 3I1), the rest of the W's at the end.
TEST(Golden, InterleavedZeroBubble) {
  hs::BuildOptions o;
  o.chunks = 2;
  EXPECT_EQ(rows(hs::build("interleaved-zb", 2, 4, o)),
            (std::vector<std::string>{
                "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 "
                "2W3 0I2 0W2 0I3 0W3",
                "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 "
                "3W3 1I3 1W2 1W3"}));
}

// Splitting the backward never makes the interleaved schedule slower when
// I + W costs what B did, and shortens it when W can fill bubbles.
TEST(Property, InterleavedZeroBubbleBeatsInterleaved1F1B) {
  for (int p : {2, 4})
    for (int v : {1, 2, 3}) {
      hs::BuildOptions o;
      o.chunks = v;
      hs::CostModel c;
      c.f = 1.0, c.b = 1.0, c.w = 1.0, c.comm = 0.1;
      auto zb = hs::simulate(hs::build("interleaved-zb", p, 4 * p, o), c);
      auto il = hs::simulate(hs::build("interleaved-1f1b", p, 4 * p, o), c);
      SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v));
      EXPECT_LT(zb.makespan, il.makespan);
      EXPECT_LT(zb.bubble_rate, il.bubble_rate);
    }
}

TEST(Layout, LoopVAndDualPipePlacement) {
  hs::BuildOptions o;
  o.chunks = 3;
  hs::Schedule il = hs::build("interleaved-1f1b", 4, 8, o);
  EXPECT_EQ(il.num_stages, 12);
  for (int s = 0; s < 12; ++s)
    EXPECT_EQ(il.stage_rank[s], s % 4);
  hs::Schedule v = hs::build("zbv", 4, 8);
  EXPECT_EQ(v.stage_rank, (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(v.num_chunks, 8);
  hs::Schedule d = hs::build("dualpipe", 4, 8);
  EXPECT_EQ(d.num_chunks, 4);
  EXPECT_EQ(d.stage_rank, (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  // Stage p+j computes chunk j: a mirrored copy on rank p-1-j.
  EXPECT_EQ(d.stage_chunk, (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
  ASSERT_EQ(d.routes.size(), 2u);
  EXPECT_EQ(d.routes[0], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(d.routes[1], (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(d.microbatch_route, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(d.next_stage(3, 0), -1);
  EXPECT_EQ(d.next_stage(4, 5), 5);
  EXPECT_EQ(d.prev_stage(4, 5), -1);
  EXPECT_EQ(d.route_position(2, 5), -1);  // up-route microbatches never visit stage 2
  // The ranks the transfers join: neighbours, and the loop's wrap-around.
  using Links = std::vector<std::pair<int, int>>;
  EXPECT_EQ(hs::build("1f1b", 4, 8).rank_links(), (Links{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_EQ(il.rank_links(), (Links{{0, 1}, {0, 3}, {1, 2}, {2, 3}}));
  EXPECT_EQ(v.rank_links(), (Links{{0, 1}, {1, 2}, {2, 3}}));  // the turn is local
  EXPECT_EQ(d.rank_links(), (Links{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_TRUE(hs::build("1f1b", 1, 4).rank_links().empty());
}

// Every generator, over many sizes: builds or refuses with invalid_argument;
// what it builds lowers, validates, simulates, and has the right work.
TEST(Property, EveryScheduleLowersValidatesSimulates) {
  int built = 0;
  for (const auto& name : hs::names()) {
    for (int p = 1; p <= 8; ++p) {
      for (int m : {1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24}) {
        for (int v : {1, 2, 3}) {
          if (v > 1 && name.find("interleaved") == std::string::npos) continue;
          if ((name == "zb-auto" || name == "auto") && (m > 16 || p > 6))
            continue;  // keep the suite fast
          hs::BuildOptions o;
          o.chunks = v;
          hs::Schedule s;
          try {
            s = hs::build(name, p, m, o);
          } catch (const std::invalid_argument&) {
            continue;  // constraint tests below check these are the right refusals
          }
          ++built;
          SCOPED_TRACE(name + " p=" + std::to_string(p) + " m=" + std::to_string(m) +
                       " v=" + std::to_string(v));
          ASSERT_NO_THROW(hs::validate(s));
          hs::Schedule low = hs::lower(s);
          ASSERT_NO_THROW(hs::validate(low));
          hs::CostModel c;
          c.comm = 0.25;
          hs::SimResult r = hs::simulate(low, c);
          // Every rank does m * (F + B + W) of work (the model's share per rank).
          for (int rk = 0; rk < p; ++rk)
            EXPECT_NEAR(r.rank_busy[rk], m * 3.0, 1e-9);
          EXPECT_GE(r.bubble_rate, 0.0);
          EXPECT_LT(r.bubble_rate, 1.0);
          // Lowered and compute-only lists time the same.
          EXPECT_NEAR(hs::simulate(s, c).makespan, r.makespan, 1e-9);
          // Sends and receives pair up, one per cross-rank hop and direction.
          int comm = 0;
          for (const auto& row : low.actions)
            for (const auto& a : row)
              comm += hs::is_comm(a.op);
          EXPECT_EQ(comm, 2 * r.comm_volume);
          // rank_links() is exactly the pairs the lowered sends join.
          std::set<std::pair<int, int>> sent;
          for (int rk = 0; rk < p; ++rk)
            for (const auto& a : low.actions[rk]) {
              if (a.op != hs::Op::SEND_F && a.op != hs::Op::SEND_B) continue;
              const int to = a.op == hs::Op::SEND_F ? low.next_stage(a.stage, a.microbatch)
                                                    : low.prev_stage(a.stage, a.microbatch);
              const int peer = low.stage_rank.at(to);
              sent.insert({std::min(rk, peer), std::max(rk, peer)});
            }
          const std::vector<std::pair<int, int>> joined(sent.begin(), sent.end());
          EXPECT_EQ(s.rank_links(), joined);
        }
      }
    }
  }
  EXPECT_GT(built, 500);
}

TEST(Constraints, EveryRefusalSaysWhatToChange) {
  auto msg = [](const std::string& name, int p, int m, int v = 2) {
    hs::BuildOptions o;
    o.chunks = v;
    try {
      hs::build(name, p, m, o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(msg("interleaved-1f1b", 4, 6).find("m % p == 0"), std::string::npos);
  EXPECT_NE(msg("interleaved-1f1b", 4, 6).find("use m=8"), std::string::npos);
  EXPECT_NE(msg("interleaved-1f1b", 4, 8, 0).find("v >= 1"), std::string::npos);
  EXPECT_NE(msg("interleaved-bfs", 4, 8, 0).find("v >= 1"), std::string::npos);
  EXPECT_NE(msg("dualpipe", 3, 12).find("even number of ranks"), std::string::npos);
  EXPECT_NE(msg("dualpipe", 3, 12).find("use p=4"), std::string::npos);
  EXPECT_NE(msg("dualpipe", 4, 9).find("m % 2 == 0"), std::string::npos);
  EXPECT_NE(msg("dualpipe", 4, 6).find("m >= 2p"), std::string::npos);
  EXPECT_NE(msg("dualpipe", 4, 6).find("use m=8"), std::string::npos);
  EXPECT_NE(msg("dualpipev", 4, 7).find("m >= 2p"), std::string::npos);
  EXPECT_NE(msg("dualpipev", 4, 7).find("use m >= 8"), std::string::npos);
  EXPECT_NE(msg("1f1b", 0, 8).find("at least 1 rank"), std::string::npos);
  EXPECT_NE(msg("1f1b", 4, 0).find("at least 1 microbatch"), std::string::npos);
  std::string unknown = msg("2f2b", 4, 8);
  EXPECT_NE(unknown.find("unknown schedule '2f2b'"), std::string::npos);
  EXPECT_NE(unknown.find("zb-auto"), std::string::npos);  // lists the known names
  hs::BuildOptions tight;
  tight.mem_limit = 0.5;  // below one microbatch
  try {
    hs::build("zb-auto", 4, 8, tight);
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--mem-limit"), std::string::npos);
  }
  // Constraints met: these build.
  EXPECT_EQ(msg("dualpipe", 4, 8), "(no error)");
  EXPECT_EQ(msg("dualpipev", 3, 6), "(no error)");
  EXPECT_EQ(msg("interleaved-1f1b", 4, 12, 3), "(no error)");
}

TEST(Names, ListsEveryGenerator) {
  const auto& n = hs::names();
  for (const char* want :
       {"naive", "gpipe", "1f1b", "interleaved-1f1b", "interleaved-bfs", "interleaved-zb", "zb-h1",
        "zb-h2", "zbv", "dualpipe", "dualpipev", "interleaved-1f1b-fb", "zbv-fb", "zb-auto",
        "zbv-auto", "v-min", "v-half", "v-zb", "auto"}) {
    EXPECT_NE(std::find(n.begin(), n.end(), want), n.end()) << want;
    EXPECT_FALSE(hs::describe(want).empty()) << want;
  }
}

// The searching generators and their heuristics under costs that are not
// F = I = W (and transfers that take time), over a grid of sizes: every
// schedule they return lowers and validates, does each rank's full work, and
// stays within the memory limit it was given.
TEST(Property, CostAwareGeneratorsStayValid) {
  struct C {
    double f, b, w, comm;
  };
  int built = 0;
  for (C k : {C{1, 1, 1, 0.25}, C{18.5, 18.1, 9.3, 0.6}, C{2, 1, 0.5, 0.1}, C{1, 2, 1.5, 0}}) {
    hs::CostModel c;
    c.f = k.f, c.b = k.b, c.w = k.w, c.comm = k.comm;
    for (int p = 1; p <= 7; ++p) {
      for (int m : {1, 2, 3, p, 2 * p + 1, 3 * p}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " F=" + std::to_string(k.f) + " comm=" + std::to_string(k.comm));
        std::vector<std::pair<hs::Schedule, double>> got;  // schedule, memory limit
        for (double x : {1.0, 2.0}) {
          hs::BuildOptions o;
          o.costs = c;
          o.mem_limit = x * p * c.mem_b;
          got.emplace_back(hs::build("zb-auto", p, m, o), o.mem_limit);
          got.emplace_back(hs::build("zbv-auto", p, m, o), o.mem_limit);
          for (int bits = 0; bits < 8; ++bits) {
            hs::SweepParams sp;
            sp.mem_limit = o.mem_limit;
            sp.warmup_overrun = bits & 1;
            sp.hold_back_f = bits & 2;
            sp.fill_small_gaps = !(bits & 4);
            try {
              got.emplace_back(hs::sweep_zero_bubble(p, m, c, sp), 1e300);
            } catch (const std::invalid_argument&) {
              // the sweep may not fit this limit; zb-auto then uses another candidate
            }
          }
        }
        for (const auto& [s, limit] : got) {
          ++built;
          SCOPED_TRACE(s.name);
          ASSERT_NO_THROW(hs::validate(s));
          hs::Schedule low = hs::lower(s);
          ASSERT_NO_THROW(hs::validate(low));
          hs::SimResult r = hs::simulate(low, c);
          EXPECT_LE(r.max_peak_memory, limit + 1e-9);
          for (int rk = 0; rk < p; ++rk)
            EXPECT_NEAR(r.rank_busy[rk], m * (k.f + k.b + k.w), 1e-6 * m * (k.f + k.b + k.w));
        }
      }
    }
  }
  EXPECT_GT(built, 1000);
}
