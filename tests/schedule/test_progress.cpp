// tests/schedule/test_progress.cpp: the one definition of what an action
// waits for (hp/schedule/progress.h), checked on hand-derived cases.
#include <gtest/gtest.h>

#include "hp/schedule/generators.h"
#include "hp/schedule/progress.h"

namespace hs = hp::schedule;

namespace {
hs::Action A(hs::Op op, int st, int mb) {
  return hs::Action::make(op, st, mb);
}
}  // namespace

// ZB-V at p = 2: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; the
// route 0 -> 1 -> 2 -> 3 turns on rank 1 (stage 1 to 2: a local hand-off).
TEST(Progress, InputSourcesFollowTheRouteAndThePlacement) {
  hs::Schedule s = hs::build("zbv", 2, 4);
  using K = hs::InputSource::Kind;
  EXPECT_EQ(hs::forward_input(s, 0, 0).kind, K::Data);
  EXPECT_EQ(hs::forward_input(s, 1, 0).kind, K::Remote);
  EXPECT_EQ(hs::forward_input(s, 1, 0).stage, 0);
  EXPECT_EQ(hs::forward_input(s, 2, 0).kind, K::Local);
  EXPECT_EQ(hs::forward_input(s, 2, 0).stage, 1);
  EXPECT_EQ(hs::backward_input(s, 3, 0).kind, K::Loss);
  EXPECT_EQ(hs::backward_input(s, 2, 0).kind, K::Remote);
  EXPECT_EQ(hs::backward_input(s, 2, 0).stage, 3);
  EXPECT_EQ(hs::backward_input(s, 1, 0).kind, K::Local);
}

// A two-stage route, by hand: F(1) waits for F(0) plus the transfer; I(1)
// (the route's end) waits only for its own F; I(0) waits for its F and for
// I(1) plus the transfer; W waits for its own I; FB for both halves.
TEST(Progress, ReadyTimesWithTransfers) {
  hs::Schedule s = hs::build("1f1b", 2, 2);
  hs::Progress pr(s);
  auto transfer = [](int a, int b) { return 10.0 * a + b + 0.5; };  // boundary 0-1: 1.5
  EXPECT_EQ(pr.ready_at(A(hs::Op::F, 0, 0), transfer), 0.0);
  EXPECT_LT(pr.ready_at(A(hs::Op::F, 1, 0), transfer), 0.0);
  EXPECT_FALSE(pr.ready(A(hs::Op::W, 1, 0)));
  pr.finish(A(hs::Op::F, 0, 0), 2.0);
  EXPECT_DOUBLE_EQ(pr.ready_at(A(hs::Op::F, 1, 0), transfer), 3.5);
  EXPECT_DOUBLE_EQ(pr.ready_at(A(hs::Op::F, 1, 0)), 2.0);  // no transfer given
  EXPECT_LT(pr.ready_at(A(hs::Op::I, 0, 0), transfer), 0.0);
  pr.finish(A(hs::Op::F, 1, 0), 4.0);
  EXPECT_DOUBLE_EQ(pr.ready_at(A(hs::Op::I, 1, 0), transfer), 4.0);
  pr.finish(A(hs::Op::I, 1, 0), 5.0);
  EXPECT_DOUBLE_EQ(pr.ready_at(A(hs::Op::W, 1, 0), transfer), 5.0);
  EXPECT_DOUBLE_EQ(pr.ready_at(A(hs::Op::I, 0, 0), transfer), 6.5);
  // FB: F(0, 1) is ready at 0, B(0, 0) at 6.5: the pair at the later.
  hs::Action fb = hs::Action::overlap(0, 1, 0, 0);
  EXPECT_DOUBLE_EQ(pr.ready_at(fb, transfer), 6.5);
  // SEND and RECV never wait; a stage a microbatch does not visit never runs.
  EXPECT_EQ(pr.ready_at(A(hs::Op::RECV_F, 1, 1), transfer), 0.0);
  EXPECT_LT(pr.ready_at(A(hs::Op::F, 5, 0), transfer), 0.0);
}
