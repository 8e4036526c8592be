// tests/schedule/test_costs.cpp: per-stage costs, memory and comm in the
// simulator and the searches, the stage cost file, the bounded file reader,
// and a tuned schedule beating every fixed one on unbalanced stages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include "hp/schedule/cost_file.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/refine.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/simulate.h"

namespace hs = hp::schedule;

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

// A GPT-like cut into 4 stages: the last stage carries the head and the loss
// (slower, more activation memory), the first the embedding.
hs::CostModel heavy_last() {
  hs::CostModel c;
  c.stage_f = {1.4, 1, 1, 1.9};
  c.stage_b = {1.4, 1, 1, 2.1};
  c.stage_w = {0.7, 0.8, 0.8, 1.0};
  c.stage_comm = {0.3, 0.3, 0.3, 0};
  c.stage_mem_b = {1, 1, 1, 1.5};
  c.stage_mem_w = {0.5, 0.5, 0.5, 0.7};
  return c;
}
// The embedding (a large vocabulary) on the first stage is the heavy one.
hs::CostModel heavy_first() {
  hs::CostModel c;
  c.stage_f = {2.0, 1, 1, 1.2};
  c.stage_b = {2.0, 1, 1, 1.2};
  c.stage_w = {1.0, 0.5, 0.5, 0.6};
  c.stage_comm = {0.3, 0.3, 0.3, 0};
  return c;
}
}  // namespace

// Naive at m = 1 is one chain: each boundary is crossed once each way, so the
// makespan grows by twice the boundary's own latency.
TEST(PerStage, CommIsPerBoundary) {
  hs::Schedule s = hs::build("naive", 3, 1);
  hs::CostModel c;
  hs::SimResult base = hs::simulate(s, c);
  c.stage_comm = {0.5, 0.25, 7.0};  // the last stage's entry has no boundary after it
  hs::SimResult r = hs::simulate(s, c);
  EXPECT_NEAR(r.makespan - base.makespan, 2 * (0.5 + 0.25), 1e-12);
  // A V turn is on one rank: no latency even with a large entry.
  hs::Schedule v = hs::zbv(1, 2);
  hs::CostModel cv;
  hs::SimResult v0 = hs::simulate(v, cv);
  cv.stage_comm = {9, 9};
  EXPECT_NEAR(hs::simulate(v, cv).makespan, v0.makespan, 1e-12);
}

TEST(PerStage, MemoryPerStage) {
  hs::CostModel c;
  c.stage_mem_b = {1, 1, 1, 3};
  c.stage_mem_w = {0.5, 0.5, 0.5, 1};
  hs::SimResult r = hs::simulate(hs::build("gpipe", 4, 4), c);
  EXPECT_NEAR(r.peak_memory[0], 4.0, 1e-12);  // all four microbatches held
  EXPECT_NEAR(r.peak_memory[3], 12.0, 1e-12);
}

TEST(PerStage, VectorsMustHaveOneEntryPerStage) {
  hs::CostModel c;
  c.stage_f = {1, 1, 1};
  std::string e = error_of([&] { hs::simulate(hs::build("1f1b", 4, 4), c); });
  EXPECT_NE(e.find("stage_f has 3 entries"), std::string::npos) << e;
  EXPECT_NE(e.find("4 stages"), std::string::npos) << e;
  c = hs::CostModel{};
  c.stage_comm = {0.1, -1, 0.1, 0.1};
  EXPECT_NE(error_of([&] { hs::simulate(hs::build("1f1b", 4, 4), c); }).find("stage comm"),
            std::string::npos);
  // zbv-auto's virtual stages are 2p: p entries are refused, not silently ignored.
  hs::BuildOptions o;
  o.costs.stage_f = {1, 1, 1, 1};
  EXPECT_NE(error_of([&] { hs::build("zbv-auto", 4, 8, o); }).find("8 stages"), std::string::npos);
}

// The searches honour per-stage costs: every schedule they return is valid,
// within its memory limit, and each rank is busy exactly its stages' work.
TEST(PerStage, SearchesStayValidUnderRandomStageCosts) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> u(0.3, 2.5), mem(0.5, 2.0), comm(0.0, 0.4);
  for (int p : {1, 2, 3, 5}) {
    for (int m : {1, 2, 5, 8, 11}) {
      hs::CostModel c;
      for (int s = 0; s < p; ++s) {
        c.stage_f.push_back(u(rng));
        c.stage_b.push_back(u(rng));
        c.stage_w.push_back(u(rng));
        c.stage_comm.push_back(comm(rng));
        c.stage_mem_b.push_back(mem(rng));
        c.stage_mem_w.push_back(0.4 * c.stage_mem_b.back());
      }
      double max_mb = *std::max_element(c.stage_mem_b.begin(), c.stage_mem_b.end());
      for (double x : {1.0, 2.0}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m) +
                     " limit=" + std::to_string(x) + "p");
        const double limit = x * p * max_mb;
        hs::Schedule s = hs::zb_auto(p, m, c, limit);
        ASSERT_NO_THROW(hs::validate(hs::lower(s)));
        hs::SimResult r = hs::simulate(s, c);
        EXPECT_LE(r.max_peak_memory, limit + 1e-9);
        for (int rk = 0; rk < p; ++rk)
          EXPECT_NEAR(r.rank_busy[rk], m * (c.stage_f[rk] + c.stage_b[rk] + c.stage_w[rk]), 1e-9);
      }
      // zbv-auto with one entry per virtual stage (2p).
      hs::CostModel v;
      for (int s = 0; s < 2 * p; ++s) {
        v.stage_f.push_back(u(rng));
        v.stage_b.push_back(u(rng));
        v.stage_w.push_back(u(rng));
        v.stage_comm.push_back(comm(rng));
      }
      hs::BuildOptions o;
      o.costs = v;
      o.mem_limit = 2.0 * p;  // 2x the hand-made ZB-V's peak at these memory defaults
      hs::Schedule z = hs::build("zbv-auto", p, m, o);
      ASSERT_NO_THROW(hs::validate(hs::lower(z)));
      EXPECT_LE(hs::simulate(z, v).max_peak_memory, o.mem_limit + 1e-9);
    }
  }
}

// The local search never returns a worse schedule, keeps the limit, and keeps
// the lists valid; from a poor start (1F1B's order split into I and W) it
// finds something strictly better.
TEST(Refine, NeverWorseAndImprovesAPoorStart) {
  hs::CostModel c;
  c.comm = 0.2;
  const int p = 4, m = 12;
  hs::Schedule s = hs::build("1f1b", p, m);
  for (auto& row : s.actions) {  // B -> I W
    std::vector<hs::Action> split;
    for (const auto& a : row) {
      if (a.op != hs::Op::B) {
        split.push_back(a);
        continue;
      }
      split.push_back(hs::Action::make(hs::Op::I, a.stage, a.microbatch));
      split.push_back(hs::Action::make(hs::Op::W, a.stage, a.microbatch));
    }
    row = split;
  }
  hs::SimResult before = hs::simulate(s, c);
  hs::RefineOptions o;
  o.mem_limit = before.max_peak_memory;
  hs::RefineStats st;
  hs::Schedule r = hs::refine(s, c, o, &st);
  ASSERT_NO_THROW(hs::validate(hs::lower(r)));
  hs::SimResult after = hs::simulate(r, c);
  EXPECT_LT(after.span, before.span - 1e-9);
  EXPECT_NEAR(after.span, st.span_after, 1e-9);
  EXPECT_LE(after.max_peak_memory, o.mem_limit + 1e-9);
  EXPECT_GT(st.improvements, 0);
  // Anything but a compute-only F/I/W schedule comes back unchanged.
  hs::Schedule fused = hs::build("1f1b", p, m);
  EXPECT_EQ(hs::refine(fused, c, o).actions, fused.actions);
}

// Issue 17: a schedule tuned to unbalanced per-stage costs beats every fixed
// schedule on the same cut that fits the same memory (1F1B's: p x the largest
// mem_b), in step time and in the longest rank's span.
TEST(Tune, BeatsEveryFixedScheduleOnUnbalancedStages) {
  const int p = 4, m = 16;
  for (const hs::CostModel& c : {heavy_last(), heavy_first()}) {
    double max_mb = 1;
    for (double v : c.stage_mem_b)
      max_mb = std::max(max_mb, v);
    const double limit = p * max_mb;
    hs::SimResult tuned = hs::simulate(hs::zb_auto(p, m, c, limit), c);
    EXPECT_LE(tuned.max_peak_memory, limit + 1e-9);
    int compared = 0;
    for (const char* n : {"naive", "gpipe", "1f1b", "zb-h1", "zb-h2"}) {
      hs::SimResult r = hs::simulate(hs::build(n, p, m), c);
      if (r.max_peak_memory > limit + 1e-9) continue;
      ++compared;
      EXPECT_LT(tuned.makespan, r.makespan - 1e-9) << n;
      EXPECT_LT(tuned.span, r.span - 1e-9) << n;
    }
    EXPECT_GE(compared, 3);  // naive, 1f1b, zb-h1 fit 1F1B's memory
    // With twice the memory it is at least as good as every fixed schedule
    // that fits, and its longest span is the heaviest stage's work or within
    // one W of it.
    hs::SimResult two = hs::simulate(hs::zb_auto(p, m, c, 2 * limit), c);
    for (const char* n : {"naive", "gpipe", "1f1b", "zb-h1", "zb-h2"}) {
      hs::SimResult r = hs::simulate(hs::build(n, p, m), c);
      if (r.max_peak_memory > 2 * limit + 1e-9) continue;
      EXPECT_LE(two.makespan, r.makespan + 1e-9) << n;
      EXPECT_LE(two.span, r.span + 1e-9) << n;
    }
  }
}

TEST(CostFile, ReadsStagesAndReportSections) {
  hs::CostModel c = hs::parse_stage_costs(
      R"({"stages": [{"f": 1.5, "i": 1.4, "w": 0.7, "comm": 0.1, "mem_b": 2, "mem_w": 1},
                     {"f": 1, "b": 1, "w": 0.5}]})",
      "costs.json");
  EXPECT_EQ(c.stage_f, (std::vector<double>{1.5, 1}));
  EXPECT_EQ(c.stage_b, (std::vector<double>{1.4, 1}));
  EXPECT_EQ(c.stage_w, (std::vector<double>{0.7, 0.5}));
  EXPECT_EQ(c.stage_comm, (std::vector<double>{0.1, 0}));
  EXPECT_EQ(c.stage_mem_b, (std::vector<double>{2, 1}));
  EXPECT_EQ(c.stage_mem_w, (std::vector<double>{1, 0.5}));
  EXPECT_DOUBLE_EQ(c.mem_b, 2);
  // The same section inside a larger report.
  hs::CostModel r = hs::parse_stage_costs(
      R"({"config": {"model": "gpt"}, "stage_costs": {"unit": "seconds",
          "stages": [{"f": 0.01, "i": 0.012, "w": 0.006}]}})",
      "report.json");
  EXPECT_EQ(r.stage_f.size(), 1u);
  EXPECT_TRUE(r.stage_inner.empty());
  // NOTE [Waits inside a chunk]: an expert stage's waits, as a report gives them.
  hs::CostModel m = hs::parse_stage_costs(
      R"({"stages": [{"f": 1, "i": 1, "w": 1},
                     {"f": 1, "i": 1, "w": 1, "f_waits": 3, "f_wait": 0.5, "i_waits": 2,
                      "i_wait": 0.25, "w_waits": 0, "w_wait": 0,
                      "f_nodes": [0.5, 0.1, 0.3, 0.1]}]})",
      "moe.json");
  ASSERT_EQ(m.stage_inner.size(), 2u);
  EXPECT_EQ(m.stage_inner[0].f_waits + m.stage_inner[0].i_waits, 0);
  EXPECT_EQ(m.stage_inner[1].f_waits, 3);
  EXPECT_EQ(m.stage_inner[1].i_waits, 2);
  EXPECT_DOUBLE_EQ(m.stage_inner[1].f, 0.5);
  EXPECT_DOUBLE_EQ(m.stage_inner[1].i, 0.25);
  EXPECT_EQ(m.stage_inner[1].f_nodes, (std::vector<double>{0.5, 0.1, 0.3, 0.1}));
  EXPECT_TRUE(m.stage_inner[1].i_nodes.empty());
}

TEST(CostFile, RefusesWhatItCannotTrust) {
  auto e = [](const std::string& text) {
    return error_of([&] { hs::parse_stage_costs(text, "c.json"); });
  };
  EXPECT_NE(e("").find("c.json: not valid JSON"), std::string::npos);
  EXPECT_NE(e("[1,2]").find("expected a JSON object"), std::string::npos);
  EXPECT_NE(e(R"({"stages": []})").find("non-empty array"), std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1}]})").find("stage 0: missing \"w\""),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "w": 1, "fw": 2}]})").find("unknown key 'fw'"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "w": 1}], "stage": 1})").find("unknown key"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "f": 2, "i": 1, "w": 1}]})").find("'f' appears twice"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "w": 0}]})").find("\"w\" must be positive"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": "1", "i": 1, "w": 1}]})").find("must be a number"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "b": 1, "w": 1}]})").find("not both"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "w": 1, "f_waits": 1.5}]})").find("whole number"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "w": 1, "f_waits": 1, "f_nodes": [1]}]})")
                .find("1 shares for 1 waits"),
            std::string::npos);
  EXPECT_NE(e(R"({"stages": [{"f": 1, "i": 1, "w": 1, "f_nodes": [-1]}]})").find("non-negative"),
            std::string::npos);
  // Raw bytes never reach a message unescaped, and a NUL does not cut it.
  std::string msg = e(R"({"stages": [{"f": 1, "i": 1, "w": 1, "a\u0000b\u00ff": 1}]})");
  EXPECT_NE(msg.find("unknown key 'a\\x00b\\xc3\\xbf'"), std::string::npos) << msg;
  std::string raw = e(std::string("{\"stages\": [\x01\x02") + std::string(1, '\0') + "\xff]}");
  for (const std::string& m : {msg, raw})
    for (char ch : m)
      EXPECT_TRUE(ch >= 0x20 && ch < 0x7f) << m;
}

TEST(InputFile, BoundedRegularFilesOnly) {
  const std::string path = ::testing::TempDir() + "hp_input_file_test.txt";
  {
    std::ofstream out(path);
    out << "0F0,0B0\n";
  }
  EXPECT_EQ(hs::read_input_file(path), "0F0,0B0\n");
  EXPECT_NE(error_of([&] { hs::read_input_file(path, 4); }).find("more than the limit"),
            std::string::npos);
  EXPECT_NE(error_of([] { hs::read_input_file("/dev/zero"); }).find("not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([] { hs::read_input_file("/"); }).find("not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([] { hs::read_input_file("/nonexistent/x.csv"); }).find("no such file"),
            std::string::npos);
  std::remove(path.c_str());
}

// span_lower_bound is a bound: no schedule within the memory limit has a
// shorter longest span, whatever the costs; and it is tight for 1F1B's
// structure at unit costs without memory to spare (ZB-H1 meets it).
TEST(Bound, NoScheduleWithinTheLimitBeatsIt) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0.3, 2.0), cm(0.0, 0.3);
  int checked = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int p = 1 + static_cast<int>(rng() % 6), m = 1 + static_cast<int>(rng() % 14);
    hs::CostModel c;
    for (int s = 0; s < p; ++s) {
      c.stage_f.push_back(u(rng));
      c.stage_b.push_back(u(rng));
      c.stage_w.push_back(u(rng));
      c.stage_comm.push_back(cm(rng));
      c.stage_mem_b.push_back(1.0);
      c.stage_mem_w.push_back(0.2 + 0.6 * u(rng) / 2);
    }
    for (double x : {1.0, 1.5, 2.0, 3.0}) {
      const double limit = x * p;
      const double bound = hs::span_lower_bound(p, m, c, limit);
      std::vector<hs::Schedule> all = {hs::zb_auto(p, m, c, limit)};
      for (const char* n : {"1f1b", "zb-h1", "zb-h2", "gpipe", "naive"})
        all.push_back(hs::build(n, p, m));
      for (const auto& s : all) {
        hs::SimResult r = hs::simulate(s, c);
        if (r.max_peak_memory > limit + 1e-9) continue;
        EXPECT_GE(r.span, bound - 1e-9) << s.name << " p=" << p << " m=" << m << " x=" << x;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 300);
  hs::CostModel unit;
  unit.mem_w = 0.5;
  for (int p : {2, 4, 8})
    for (int m : {2 * p, 3 * p})
      EXPECT_NEAR(hs::simulate(hs::build("zb-h1", p, m), unit).span,
                  hs::span_lower_bound(p, m, unit, p * unit.mem_b), 1e-9)
          << p << " " << m;
}
