// hp/schedule/progress.h: when a compute action may run - the one definition
// of "this action is ready" that validation, lowering's message order and
// the simulator share, and where each input of an action comes from, which
// the executor uses.
#pragma once

#include <functional>
#include <vector>

#include "hp/schedule/schedule.h"

namespace hp::schedule {

// NOTE [What an action waits for]
// A compute action runs once the work it reads has run:
// - F(s, mb) reads the output of F(prev, mb), prev the stage before s on mb's
//   route (nothing at the route's start: the microbatch's input);
// - I(s, mb) and B(s, mb) read their own F(s, mb) and the input gradient of
//   I or B(next, mb), next the stage after s (nothing at the route's end:
//   the loss);
// - W(s, mb) reads what its own I(s, mb) kept;
// - FB(s, mb, s2, mb2) is F(s, mb) and B(s2, mb2) together.
// An input from another rank also pays its transfer. SEND and RECV never
// wait: a runtime posts them and the consumer waits for the data.

/// Where one input of a compute action's half comes from.
struct InputSource {
  enum class Kind {
    Data,    ///< the microbatch's input (F at a route's start)
    Loss,    ///< the loss (I/B at a route's end: no gradient to receive)
    Local,   ///< `stage`, on the same rank (a hand-off, no message)
    Remote,  ///< `stage`, on another rank (a message)
  };
  Kind kind = Kind::Data;
  int stage = -1;  ///< the producing stage (Local, Remote)
};

/// Where F(stage, mb) gets its input activation.
InputSource forward_input(const Schedule& s, int stage, int mb);
/// Where I/B(stage, mb) gets the gradient of its output.
InputSource backward_input(const Schedule& s, int stage, int mb);

/// What has run so far, and when: the completion time of every (stage,
/// microbatch)'s F, backward (I or B) and I. Answers when an action may start
/// (NOTE [What an action waits for]).
class Progress {
 public:
  explicit Progress(const Schedule& s);

  /// The transfer time of a hand-off across the boundary between stages `a`
  /// and `b`, consecutive on a route (a before b), in either direction
  /// (activation a -> b, gradient b -> a); asked only when they are on
  /// different ranks. Not given: 0.
  using Transfer = std::function<double(int a, int b)>;

  /// When `a` may start: the latest completion of what it reads (plus the
  /// transfer for inputs from other ranks), 0 if it reads nothing, or a
  /// negative number while something it reads has not run. SEND/RECV: 0.
  double ready_at(const Action& a, const Transfer& transfer = nullptr) const;
  /// Whether everything `a` reads has run.
  bool ready(const Action& a) const { return ready_at(a) >= 0; }
  /// Records that compute action `a` finished at `end`.
  void finish(const Action& a, double end = 0.0);

 private:
  double f_ready(int stage, int mb, const Transfer& transfer) const;
  double g_ready(int stage, int mb, const Transfer& transfer) const;
  size_t key(int stage, int mb) const { return static_cast<size_t>(stage) * m_ + mb; }
  bool in_range(int stage, int mb) const;

  const Schedule& s_;
  int m_;
  std::vector<double> f_done_, g_done_, i_done_;  // completion times; < 0: not yet
};

}  // namespace hp::schedule
