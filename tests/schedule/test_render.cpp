// tests/schedule/test_render.cpp: ASCII, SVG and Chrome-trace renderers and
// the JSON statistics, on simulated and on hand-made ("measured") timelines.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "hp/schedule/generators.h"
#include "hp/schedule/render.h"
#include "hp/schedule/simulate.h"

namespace hs = hp::schedule;

namespace {
int count(const std::string& s, const std::string& needle) {
  int n = 0;
  for (size_t i = s.find(needle); i != std::string::npos; i = s.find(needle, i + 1))
    ++n;
  return n;
}
hs::Timeline measured() {
  // What a runtime would record: arbitrary times, an FB pair, a gap.
  hs::Timeline t;
  t.num_ranks = 2;
  t.title = "measured";
  t.events = {{0, hs::Action::make(hs::Op::F, 0, 0), 0.0, 1.1},
              {1, hs::Action::make(hs::Op::F, 1, 0), 1.2, 2.0},
              {1, hs::Action::make(hs::Op::I, 1, 0), 2.0, 3.1},
              {1, hs::Action::make(hs::Op::W, 1, 0), 3.1, 4.0},
              {0, hs::Action::overlap(0, 1, 0, 0), 3.2, 6.0}};
  return t;
}
}  // namespace

TEST(Ascii, OneRowPerRankWithLabelsAndBubbles) {
  hs::SimResult r = hs::simulate(hs::build("1f1b", 4, 8), hs::CostModel{});
  std::string a = hs::render_ascii(r.timeline);
  EXPECT_EQ(count(a, "rank "), 4);
  EXPECT_NE(a.find("F0"), std::string::npos);
  EXPECT_NE(a.find("B7"), std::string::npos);
  EXPECT_NE(a.find("."), std::string::npos);  // bubbles
  EXPECT_EQ(a.find("\x1b["), std::string::npos);
  // Rank 3 starts after three forwards of idle time: its row begins with bubbles.
  size_t row3 = a.find("rank 3 |");
  ASSERT_NE(row3, std::string::npos);
  EXPECT_EQ(a[row3 + 8], '.');
  hs::AsciiOptions o;
  o.color = true;
  EXPECT_NE(hs::render_ascii(r.timeline, o).find("\x1b[44"), std::string::npos);
}

TEST(Ascii, NarrowWidthStillDrawsEveryRank) {
  hs::SimResult r = hs::simulate(hs::build("gpipe", 8, 64), hs::CostModel{});
  hs::AsciiOptions o;
  o.max_width = 40;
  std::string a = hs::render_ascii(r.timeline, o);
  std::istringstream is(a);
  std::string line;
  int rows = 0;
  while (std::getline(is, line))
    if (line.rfind("rank", 0) == 0) {
      ++rows;
      EXPECT_LE(line.size(), 40u + 12u) << line;
    }
  EXPECT_EQ(rows, 8);
}

TEST(Ascii, MeasuredTimelineWithOverlappedPair) {
  std::string a = hs::render_ascii(measured());
  EXPECT_NE(a.find("measured"), std::string::npos);
  EXPECT_NE(a.find("I0"), std::string::npos);
  EXPECT_NE(a.find("W0"), std::string::npos);
  EXPECT_NE(a.find("F1"), std::string::npos);  // F half of the FB pair
  EXPECT_NE(hs::render_ascii(hs::Timeline{}).find("empty"), std::string::npos);
}

TEST(Svg, ColouredBoxesLabelsLegend) {
  hs::SimResult r = hs::simulate(hs::build("zb-h1", 4, 8), hs::CostModel{});
  r.timeline.title = "zb-h1 p=4 m=8";
  std::string s = hs::render_svg(r.timeline);
  EXPECT_EQ(s.rfind("<svg", 0), 0u);
  EXPECT_NE(s.find("</svg>"), std::string::npos);
  EXPECT_NE(s.find("zb-h1 p=4 m=8"), std::string::npos);
  for (int rk = 0; rk < 4; ++rk)
    EXPECT_NE(s.find(">rank " + std::to_string(rk) + "<"), std::string::npos);
  EXPECT_NE(s.find("#4e79a7"), std::string::npos);      // F
  EXPECT_NE(s.find("#f2b447"), std::string::npos);      // I
  EXPECT_NE(s.find("#59a14f"), std::string::npos);      // W
  EXPECT_NE(s.find("weight grad"), std::string::npos);  // legend
  // One box per event (+ one frame per rank + legend swatches + background).
  EXPECT_EQ(count(s, "<rect"), static_cast<int>(r.timeline.events.size()) + 4 + 4 + 1);
  EXPECT_NE(s.find(">7</text>"), std::string::npos);  // microbatch numbers in boxes
}

TEST(Svg, StacksTimelinesOnOneScale) {
  hs::SimResult a = hs::simulate(hs::build("1f1b", 2, 4), hs::CostModel{});
  hs::SimResult b = hs::simulate(hs::build("zb-h2", 2, 4), hs::CostModel{});
  a.timeline.title = "first";
  b.timeline.title = "second";
  std::string s = hs::render_svg({a.timeline, b.timeline, measured()});
  EXPECT_NE(s.find("first"), std::string::npos);
  EXPECT_NE(s.find("second"), std::string::npos);
  EXPECT_NE(s.find("#e15759"), std::string::npos);  // B (the FB pair's B half)
  EXPECT_EQ(count(s, "<svg"), 1);
}

TEST(Trace, ChromeJsonWithOneThreadPerRank) {
  hs::SimResult r = hs::simulate(hs::build("dualpipev", 2, 4), hs::CostModel{});
  auto j = nlohmann::json::parse(hs::render_chrome_trace(r.timeline));
  ASSERT_TRUE(j.contains("traceEvents"));
  int complete = 0, meta = 0, fb = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GT(e["dur"].get<double>(), 0.0);
      if (e["cat"] == "FB") {
        ++fb;
        EXPECT_TRUE(e["args"].contains("microbatch2"));
      }
    }
    if (e["ph"] == "M") ++meta;
  }
  EXPECT_EQ(complete, static_cast<int>(r.timeline.events.size()));
  EXPECT_EQ(meta, 2);
  EXPECT_GT(fb, 0);
}

TEST(Summary, JsonCarriesEveryStatistic) {
  hs::SimResult r = hs::simulate(hs::build("1f1b", 4, 8), hs::CostModel{});
  auto j = nlohmann::json::parse(hs::summary_json(r, "1f1b"));
  EXPECT_EQ(j["name"], "1f1b");
  EXPECT_NEAR(j["bubble_rate"].get<double>(), r.bubble_rate, 1e-12);
  EXPECT_EQ(j["peak_memory"].size(), 4u);
  EXPECT_EQ(j["rank_idle"].size(), 4u);
  EXPECT_EQ(j["comm_volume"].get<int>(), r.comm_volume);
  std::string t = hs::summary_text(r);
  EXPECT_NE(t.find("bubble rate"), std::string::npos);
  EXPECT_NE(t.find("peak memory"), std::string::npos);
}
