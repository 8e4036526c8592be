// tests/schedule/test_action.cpp: the Action IR's text form and the CSV form
// of a Schedule (round trips, inference, errors naming the offending text).
#include <gtest/gtest.h>

#include <sstream>
#include <stdexcept>
#include <string>

#include "hp/schedule/action.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/schedule.h"

namespace hs = hp::schedule;

TEST(Action, PrintsShortForms) {
  EXPECT_EQ(hs::to_string(hs::Action::make(hs::Op::F, 2, 0)), "2F0");
  EXPECT_EQ(hs::to_string(hs::Action::make(hs::Op::I, 1, 3)), "1I3");
  EXPECT_EQ(hs::to_string(hs::Action::make(hs::Op::W, 0, 12)), "0W12");
  EXPECT_EQ(hs::to_string(hs::Action::make(hs::Op::B, 7, 1)), "7B1");
  EXPECT_EQ(hs::to_string(hs::Action::make(hs::Op::SEND_B, 0, 2)), "0SEND_B2");
  EXPECT_EQ(hs::to_string(hs::Action::make(hs::Op::RECV_F, 3, 4)), "3RECV_F4");
  EXPECT_EQ(hs::to_string(hs::Action::overlap(3, 1, 5, 0)), "3F1+5B0");
}

TEST(Action, ParseRoundTripsEveryOp) {
  for (int op = 0; op <= static_cast<int>(hs::Op::RECV_B); ++op) {
    hs::Action a = static_cast<hs::Op>(op) == hs::Op::FB
                       ? hs::Action::overlap(4, 9, 11, 2)
                       : hs::Action::make(static_cast<hs::Op>(op), 13, 250);
    EXPECT_EQ(hs::parse_action(hs::to_string(a)), a) << hs::to_string(a);
  }
  EXPECT_EQ(hs::parse_action("  2F0 \r"), hs::Action::make(hs::Op::F, 2, 0));
  // A pair whose B leads (NOTE [The half that leads] in fuse.cpp).
  const hs::Action b_led = hs::Action::overlap(3, 1, 2, 0, true);
  EXPECT_EQ(hs::to_string(b_led), "2B0+3F1");
  EXPECT_EQ(hs::parse_action("2B0+3F1"), b_led);
  EXPECT_NE(b_led, hs::Action::overlap(3, 1, 2, 0));
}

TEST(Action, ParseErrorsNameTheText) {
  for (const char* bad : {"", "F0", "2X0", "2F", "2F0x", "2f0", "2F0+3I1", "2B0+3I1", "2F0+3F1",
                          "+", "2F0+", "99999999999F0", "2SEND0", "-1F0", "2 F0"}) {
    try {
      hs::parse_action(bad);
      ADD_FAILURE() << "parsed '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Csv, RoundTripsEveryGenerator) {
  for (const auto& name : hs::names()) {
    int p = 4, m = 8;
    hs::Schedule s = hs::build(name, p, m);
    for (const hs::Schedule& t : {s, hs::lower(s)}) {
      hs::Schedule back = hs::from_csv(hs::to_csv(t));
      EXPECT_EQ(back.name, t.name);
      EXPECT_EQ(back.num_ranks, t.num_ranks);
      EXPECT_EQ(back.num_stages, t.num_stages);
      EXPECT_EQ(back.num_microbatches, t.num_microbatches);
      EXPECT_EQ(back.num_chunks, t.num_chunks);
      EXPECT_EQ(back.stage_rank, t.stage_rank);
      EXPECT_EQ(back.stage_chunk, t.stage_chunk);
      EXPECT_EQ(back.routes, t.routes);
      EXPECT_EQ(back.microbatch_route, t.microbatch_route);
      EXPECT_EQ(back.lowered, t.lowered);
      EXPECT_EQ(back.actions, t.actions) << name;
      EXPECT_NO_THROW(hs::validate(back)) << name;
    }
  }
}

TEST(Csv, PlainRowsInferALoopLayout) {
  // A torch-style CSV: one row per rank, no metadata.
  hs::Schedule s = hs::from_csv(
      "0F0,0F1,0B0,0B1\n"
      "1F0,1B0,1F1,1B1\n");
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_EQ(s.num_stages, 2);
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_EQ(s.stage_rank, (std::vector<int>{0, 1}));
  EXPECT_FALSE(s.lowered);
  EXPECT_NO_THROW(hs::validate(s));
}

TEST(Csv, RanksWithoutActionsSurviveTheRoundTrip) {
  // Found by the fuzzer: an empty rank row must not shift later rows.
  hs::Schedule s = hs::from_csv(",,\n,,\n,\n\n\n,,\n111B11");
  EXPECT_EQ(s.num_ranks, 5);
  EXPECT_EQ(s.stage_rank[111], 4);
  hs::Schedule back = hs::from_csv(hs::to_csv(s));
  EXPECT_EQ(back.actions, s.actions);
}

TEST(Csv, ErrorsNameTheRowAndText) {
  try {
    hs::from_csv("0F0,0B0\n1F0,1Q0,1B0\n");
    FAIL();
  } catch (const std::invalid_argument& e) {
    std::string w = e.what();
    EXPECT_NE(w.find("line 2"), std::string::npos) << w;
    EXPECT_NE(w.find("rank 1"), std::string::npos) << w;
    EXPECT_NE(w.find("1Q0"), std::string::npos) << w;
  }
  EXPECT_THROW(hs::from_csv(""), std::invalid_argument);
  EXPECT_THROW(hs::from_csv("# ranks,x\n0F0\n"), std::invalid_argument);
  EXPECT_THROW(hs::from_csv("# colour,blue\n0F0\n"), std::invalid_argument);
  // Stage 0 on two ranks without a placement line.
  EXPECT_THROW(hs::from_csv("0F0,0B0\n0F1,0B1\n"), std::invalid_argument);
  // Placement that names a rank that does not exist.
  EXPECT_THROW(hs::from_csv("# stage_rank,0,5\n0F0,0B0\n1F0,1B0\n"), std::invalid_argument);
}

namespace {
std::string csv_error(const std::string& text) {
  try {
    hs::from_csv(text, "s.csv");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}
bool printable(const std::string& s) {
  for (char c : s)
    if (!(c >= 0x20 && c < 0x7f)) return false;
  return true;
}
}  // namespace

// Issue 15: a header that disagrees with the rows is refused with the file
// and the line, never padded or ignored.
TEST(Csv, HeaderAndRowsMustAgree) {
  std::string full = hs::to_csv(hs::build("1f1b", 3, 4));
  ASSERT_EQ(csv_error(full), "(no error)");
  // Drop the last rank's row: the header still says 3 ranks.
  std::string two_rows = full.substr(0, full.rfind('\n', full.size() - 2) + 1);
  std::string e = csv_error(two_rows);
  EXPECT_NE(e.find("s.csv: line 3 says 3 ranks but the file has 2 rows"), std::string::npos) << e;
  // One row too many.
  e = csv_error(full + "2F0\n");
  EXPECT_NE(e.find("s.csv line 15: row 4 of actions but line 3 says 3 ranks"), std::string::npos)
      << e;
  // An action outside the declared stages / microbatches.
  e = csv_error("# stages,2\n# microbatches,2\n0F0,0B0,0F1,0B1\n1F0,1B0,1F3,1B1\n");
  EXPECT_NE(e.find("s.csv line 4 (rank 1): action '1F3' names a microbatch outside the 2"),
            std::string::npos)
      << e;
  e = csv_error("# stages,1\n0F0,0B0\n1F0,1B0\n");
  EXPECT_NE(e.find("line 3 (rank 1): action '1F0' names a stage outside the 1 stages of line 1"),
            std::string::npos)
      << e;
  // Lists of the wrong length, metadata given twice or after the rows, a
  // lowered flag the rows contradict.
  EXPECT_NE(csv_error("# stages,2\n# stage_rank,0\n0F0,0B0\n1F0,1B0\n")
                .find("line 2: stage_rank has 1 entries but there are 2 stages"),
            std::string::npos);
  EXPECT_NE(csv_error("# ranks,2\n# ranks,2\n0F0,0B0\n1F0,1B0\n")
                .find("line 2: metadata 'ranks' was already given on line 1"),
            std::string::npos);
  EXPECT_NE(csv_error("0F0,0B0\n# ranks,1\n").find("metadata after the rows"), std::string::npos);
  EXPECT_NE(csv_error("# lowered,0\n0F0,0SEND_F0,0B0\n").find("says the schedule is not lowered"),
            std::string::npos);
  EXPECT_NE(csv_error("# lowered,2\n0F0\n").find("lowered must be 0 or 1"), std::string::npos);
}

// Error text shows the offending bytes escaped and cut, and a NUL byte does
// not end the message early.
TEST(Csv, ErrorsShowBytesSafely) {
  std::string e = csv_error(std::string("0F0,0\x01X") + std::string(1, '\0') + "Y\xff,0B0\n");
  EXPECT_NE(e.find("0\\x01X\\x00Y\\xff"), std::string::npos) << e;
  EXPECT_TRUE(printable(e)) << e;
  std::string junk(5000, 'Q');
  e = csv_error("0F0," + junk + "\n");
  EXPECT_LT(e.size(), 600u) << e;
  EXPECT_NE(e.find("(5000 bytes)"), std::string::npos) << e;
  e = csv_error(std::string("# name,\x1b[31mred\n0F0,0B0\n"));
  EXPECT_NE(e.find("\\x1b[31mred"), std::string::npos) << e;
  EXPECT_TRUE(printable(e)) << e;
}

// Input is bounded: more than kMaxInputBytes is refused before parsing, from a
// string and from a stream (which is read only up to the bound).
TEST(Csv, InputIsBounded) {
  std::string big(hs::kMaxInputBytes + 1, ' ');
  EXPECT_NE(csv_error(big).find("more than the limit"), std::string::npos);
  std::istringstream in(big);
  try {
    hs::read_csv(in, "big.csv");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("big.csv: more than"), std::string::npos) << e.what();
  }
}
