// hp/distributed/lanes.h: a group in several copies over the same ranks, one
// per thread that posts in an order of its own (NOTE [Lanes] in lanes.cpp).
#pragma once

#include <memory>
#include <string>

#include "hp/distributed/comm.h"

namespace hp::distributed {

/// `group` and `lanes - 1` copies of it over the same ranks (split() of
/// all of them; every rank calls it): each operation goes to the copy the
/// calling thread's LaneScope names (NOTE [Lanes]), so threads whose posts
/// interleave by timing each keep an order of their own. A lane beyond the
/// count is lane 0; `lanes` 1 returns `group`.
std::shared_ptr<Comm> with_lanes(std::shared_ptr<Comm> group, int lanes);

/// How many lanes `group` has: with_lanes' count, 1 for any other Comm.
int lane_count(const Comm& group);

/// The lanes an overlapped pair uses (NOTE [Lanes]).
enum Lane : int {
  kMainLane = 0,      ///< the executor, and a pair's first half
  kPartnerLane = 1,   ///< a pair's second half (the runner's thread)
  kDeferredLane = 2,  ///< the weight gradients run in waits
  kPairLanes = 3,     ///< how many
};

/// Names the lane the calling thread's operations on a with_lanes Comm take,
/// while alive; nests, restoring the previous one (kMainLane at first).
class LaneScope {
 public:
  explicit LaneScope(int lane);
  ~LaneScope();
  LaneScope(const LaneScope&) = delete;
  LaneScope& operator=(const LaneScope&) = delete;

 private:
  int previous_;
};
/// The calling thread's lane.
int current_lane();

/// While alive, an exchange with peers that this thread starts through
/// check_exchange_allowed throws `why` instead: a deferred W of pairs that
/// take turns as messages arrive must exchange nothing (NOTE [Turns as
/// messages arrive] in hp/pipeline/overlap.cpp). Nests.
class NoExchangeScope {
 public:
  explicit NoExchangeScope(std::string why);
  ~NoExchangeScope();
  NoExchangeScope(const NoExchangeScope&) = delete;
  NoExchangeScope& operator=(const NoExchangeScope&) = delete;

 private:
  const std::string* previous_;
  std::string why_;
};
/// Throws std::runtime_error("`what`: <why>") inside a NoExchangeScope.
void check_exchange_allowed(const char* what);
/// The text this thread's last refusal threw, once (then empty): a caller
/// whose error came back through code that kept only its own (a Python
/// function in the autograd engine: "python_error") names the cause.
std::string take_exchange_refusal();

}  // namespace hp::distributed
