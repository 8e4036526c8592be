// tests/schedule/test_lower_validate.cpp: lowering adds matched SEND/RECV in
// consistent order and none for local hand-offs; validate catches every kind
// of broken schedule and names rank and action.
#include <gtest/gtest.h>

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

TEST(Lower, OneFOneBPlacesSendAfterProducerRecvBeforeConsumer) {
  hs::Schedule low = hs::lower(hs::build("1f1b", 2, 2));
  EXPECT_EQ(hs::format_actions(low.actions[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1");
  EXPECT_EQ(hs::format_actions(low.actions[1]),
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1");
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
    std::swap(t.actions[1][4], t.actions[1][5]);
    EXPECT_NE(error_of(t).find("received after its consumer"), std::string::npos) << error_of(t);
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
