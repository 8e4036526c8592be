// tests/schedule/test_lower_validate.cpp: lowering adds matched SEND/RECV in
// consistent order and none for local hand-offs; validate catches every kind
// of broken schedule and names rank and action.
#include <gtest/gtest.h>

#include <algorithm>

#include <map>
#include <stdexcept>
#include <string>

#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/simulate.h"

namespace hs = hp::schedule;

namespace {
std::string error_of(const hs::Schedule& s) {
  try {
    hs::validate(s);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(valid)";
}
}  // namespace

// 1F1B, p = 2, m = 2, in the nominal run lower() places by (F = 1, B = 2):
// rank 0 runs F0 [0,1], F1 [1,2], B0 [4,6], B1 [7,9]; rank 1 runs F0 [1,2],
// B0 [2,4], F1 [4,5], B1 [5,7]. A RECV goes before the first compute of its
// rank that ends at or after the message is sent: rank 1 posts RECV_F1 (sent
// at 2) before F0, which ends at 2; rank 0 posts RECV_B0 (sent at 4) with
// F1's SEND, as F1 ends at 2, and RECV_B1 (sent at 7) after B0 (ends at 6).
TEST(Lower, OneFOneBPlacesSendAfterProducerRecvBeforeConsumer) {
  hs::Schedule low = hs::lower(hs::build("1f1b", 2, 2));
  EXPECT_EQ(hs::format_actions(low.actions[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1");
  EXPECT_EQ(hs::format_actions(low.actions[1]),
            "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1");
}

// At m = 4 the steady state has both ranks wanting a receive early across
// the other's send: rank 0 would post RECV_B1 (sent at 7) before F2 [6,7],
// whose F2 rank 1 would receive before B1 [5,7]; run in posting order (NCCL)
// each would wait for the other (NOTE [Batch order]). lower() posts one of
// them later (both are sent at 7; the tie goes to the message numbered
// first): rank 1's RECV_F2 joins B1's SEND batch (and RECV_F3 B2's, the same
// case one step on); rank 0 keeps receiving each B one compute action ahead.
TEST(Lower, ReceivesEarlyWithoutACycle) {
  hs::Schedule low = hs::lower(hs::build("1f1b", 2, 4));
  // Each batch posts its sends before its receives (NOTE [Sends before receives]).
  EXPECT_EQ(hs::format_actions(low.actions[1]),
            "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 "
            "1RECV_F3 1F3 1B3 1SEND_B3");
  EXPECT_EQ(hs::format_actions(low.actions[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0F2 0SEND_F2 0B1 0RECV_B2 0F3 "
            "0SEND_F3 0B2 0RECV_B3 0B3");
  hs::validate(low);
}

TEST(Lower, VPlacementTurnIsLocal) {
  // Rank p-1 holds stages p-1 and p: the turn of the V needs no message.
  const int p = 4;
  hs::Schedule low = hs::lower(hs::build("zbv", p, 8));
  for (const auto& a : low.actions[p - 1]) {
    if (!hs::is_comm(a.op)) continue;
    EXPECT_FALSE(a.op == hs::Op::SEND_F && a.stage == p - 1) << hs::to_string(a);
    EXPECT_FALSE(a.op == hs::Op::RECV_F && a.stage == p) << hs::to_string(a);
    EXPECT_FALSE(a.op == hs::Op::SEND_B && a.stage == p) << hs::to_string(a);
    EXPECT_FALSE(a.op == hs::Op::RECV_B && a.stage == p - 1) << hs::to_string(a);
  }
  // Stage 0 and stage 2p-1 (both rank 0) are route ends: rank 0 only talks to rank 1.
  EXPECT_EQ(hs::comm_volume(low), 8 * 2 * 2 * (p - 1));
}

TEST(Lower, RefusesTwice) {
  hs::Schedule low = hs::lower(hs::build("1f1b", 2, 2));
  EXPECT_THROW(hs::lower(low), std::invalid_argument);
}

TEST(Lower, ReordersReceivesToMatchSendOrder) {
  // Rank 0 sends F0 then F1; rank 1 consumes F1 first. The receives must
  // still be posted in send order (both before 1F1).
  hs::Schedule s = hs::build("gpipe", 2, 2);
  s.actions[1] = {hs::Action::make(hs::Op::F, 1, 1), hs::Action::make(hs::Op::F, 1, 0),
                  hs::Action::make(hs::Op::B, 1, 0), hs::Action::make(hs::Op::B, 1, 1)};
  ASSERT_EQ(error_of(s), "(valid)");
  hs::Schedule low = hs::lower(s);
  EXPECT_EQ(hs::format_actions(low.actions[1]),
            "1RECV_F0 1RECV_F1 1F1 1F0 1B0 1SEND_B0 1B1 1SEND_B1");
  EXPECT_EQ(error_of(low), "(valid)");
}

TEST(Validate, CatchesMissingDuplicateAndMisplacedWork) {
  hs::Schedule s = hs::build("1f1b", 2, 2);
  {
    hs::Schedule t = s;
    t.actions[1].erase(t.actions[1].begin());  // drop 1F0
    EXPECT_NE(error_of(t).find("stage 1 (rank 1) microbatch 0: no F"), std::string::npos)
        << error_of(t);
  }
  {
    hs::Schedule t = s;
    t.actions[0].push_back(hs::Action::make(hs::Op::F, 0, 1));
    EXPECT_NE(error_of(t).find("rank 0 action 4 (0F1): second F"), std::string::npos)
        << error_of(t);
  }
  {
    hs::Schedule t = s;
    t.actions[0][0] = hs::Action::make(hs::Op::F, 1, 0);  // stage 1 lives on rank 1
    EXPECT_NE(error_of(t).find("stage 1 runs on rank 1, not here"), std::string::npos)
        << error_of(t);
  }
  {
    hs::Schedule t = s;
    std::swap(t.actions[1][0], t.actions[1][1]);  // 1B0 before 1F0
    EXPECT_NE(error_of(t).find("backward before its F"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = hs::build("zb-h1", 2, 2);
    // Put rank 1's first W before its I.
    auto& row = t.actions[1];
    size_t wi = 0, ii = 0;
    for (size_t i = 0; i < row.size(); ++i) {
      if (row[i] == hs::Action::make(hs::Op::W, 1, 0)) wi = i;
      if (row[i] == hs::Action::make(hs::Op::I, 1, 0)) ii = i;
    }
    std::swap(row[wi], row[ii]);
    EXPECT_NE(error_of(t).find("W before its I"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = hs::build("zb-h1", 2, 2);
    auto& row = t.actions[0];
    for (size_t i = 0; i < row.size(); ++i)
      if (row[i].op == hs::Op::W && row[i].microbatch == 1) {
        row.erase(row.begin() + i);
        break;
      }
    EXPECT_NE(error_of(t).find("I without its W"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = s;
    t.actions[0].push_back(hs::Action::make(hs::Op::SEND_F, 0, 0));
    EXPECT_NE(error_of(t).find("not marked lowered"), std::string::npos) << error_of(t);
  }
}

TEST(Validate, CatchesDeadlockNamingRanks) {
  hs::Schedule s = hs::build("1f1b", 2, 2);
  // Rank 0 waits for 1B0 before it sends F1; rank 1 wants F1 before B0.
  s.actions[0] = {hs::Action::make(hs::Op::F, 0, 0), hs::Action::make(hs::Op::B, 0, 0),
                  hs::Action::make(hs::Op::F, 0, 1), hs::Action::make(hs::Op::B, 0, 1)};
  s.actions[1] = {hs::Action::make(hs::Op::F, 1, 1), hs::Action::make(hs::Op::F, 1, 0),
                  hs::Action::make(hs::Op::B, 1, 0), hs::Action::make(hs::Op::B, 1, 1)};
  std::string e = error_of(s);
  EXPECT_NE(e.find("deadlock"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0 action 1 (0B0)"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 1 action 0 (1F1)"), std::string::npos) << e;
  EXPECT_THROW(hs::simulate(s, hs::CostModel{}), std::runtime_error);
}

TEST(Validate, CatchesBrokenMessages) {
  hs::Schedule low = hs::lower(hs::build("1f1b", 2, 2));
  {
    hs::Schedule t = low;
    t.actions[1].erase(t.actions[1].begin());  // drop 1RECV_F0
    EXPECT_NE(error_of(t).find("missing 1RECV_F0"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = low;
    // Move 0SEND_F0 before 0F0.
    std::swap(t.actions[0][0], t.actions[0][1]);
    EXPECT_NE(error_of(t).find("sent before it is produced"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = low;
    // Receive 1RECV_F1 after its consumer 1F1.
    auto& row = t.actions[1];
    auto recv = std::find(row.begin(), row.end(), hs::Action::make(hs::Op::RECV_F, 1, 1));
    ASSERT_NE(recv, row.end());
    row.erase(recv);
    row.insert(std::find(row.begin(), row.end(), hs::Action::make(hs::Op::F, 1, 1)) + 1,
               hs::Action::make(hs::Op::RECV_F, 1, 1));
    EXPECT_NE(error_of(t).find("received after its consumer"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = low;
    // Every message is sent before it is needed and each channel keeps its
    // order, so with sends that never block this runs; but rank 0 posts B0's
    // receive in a batch before F1's send, and rank 1 posts F1's receive in a
    // batch before B0's send: run in posting order (NCCL), each waits on the
    // other.
    t.actions[0] = {hs::Action::make(hs::Op::F, 0, 0),      hs::Action::make(hs::Op::SEND_F, 0, 0),
                    hs::Action::make(hs::Op::RECV_B, 0, 0), hs::Action::make(hs::Op::F, 0, 1),
                    hs::Action::make(hs::Op::SEND_F, 0, 1), hs::Action::make(hs::Op::B, 0, 0),
                    hs::Action::make(hs::Op::RECV_B, 0, 1), hs::Action::make(hs::Op::B, 0, 1)};
    std::string e = error_of(t);
    EXPECT_NE(e.find("message order"), std::string::npos) << e;
    EXPECT_NE(e.find("1RECV_F1"), std::string::npos) << e;
    EXPECT_NE(e.find("0RECV_B0"), std::string::npos) << e;
  }
  {
    hs::Schedule t = low;
    // Swap the two receives on rank 1 from rank 0: order mismatch with the sends.
    t.actions[1] = {hs::Action::make(hs::Op::RECV_F, 1, 1), hs::Action::make(hs::Op::RECV_F, 1, 0),
                    hs::Action::make(hs::Op::F, 1, 0),      hs::Action::make(hs::Op::B, 1, 0),
                    hs::Action::make(hs::Op::SEND_B, 1, 0), hs::Action::make(hs::Op::F, 1, 1),
                    hs::Action::make(hs::Op::B, 1, 1),      hs::Action::make(hs::Op::SEND_B, 1, 1)};
    EXPECT_NE(error_of(t).find("order mismatch"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = hs::lower(hs::build("zbv", 2, 4));
    // A message on the V's local turn (stages 1 and 2 share rank 1).
    t.actions[1].push_back(hs::Action::make(hs::Op::SEND_F, 1, 0));
    EXPECT_NE(error_of(t).find("must not communicate"), std::string::npos) << error_of(t);
  }
  {
    hs::Schedule t = low;
    // Stage 1 is the last stage: there is nobody to send its F output to.
    t.actions[1].push_back(hs::Action::make(hs::Op::SEND_F, 1, 0));
    EXPECT_NE(error_of(t).find("no matching peer"), std::string::npos) << error_of(t);
  }
}
