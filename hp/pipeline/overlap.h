// hp/pipeline/overlap.h: a forward and a backward run as partners, each
// computing while the other waits on communication (DualPipe's F&B overlap:
// NOTE [Overlapped pairs] in overlap.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <vector>

#include "hp/schedule/action.h"

namespace hp::pipeline {

/// What one overlapped pair did.
struct PairStats {
  /// Times the CPU went from one half to the other (at a wait on
  /// communication).
  int switches = 0;
  /// First-ready turns (NOTE [Turns as messages arrive]): times a half took
  /// the CPU back while its partner, whose turn it was, still waited.
  int reordered = 0;
  /// Seconds some wait of a half was in flight while the CPU computed (the
  /// other half, or a W in a wait): communication the pair hid.
  double hidden = 0.0;
  /// Seconds a wait of a half was in flight while nothing computed (the
  /// other half done, or waiting too): what it exposed. A time both halves
  /// wait counts for each.
  double exposed = 0.0;
  /// Of `exposed`, the seconds after the other half had ended: no compute
  /// of the pair was left to hide them (only a deferred W could), as
  /// against a time both halves waited.
  double exposed_alone = 0.0;
  /// Times `idle` ran a piece of work during a wait.
  int filled = 0;
  /// Seconds of the pair in which the CPU computed nothing and no half
  /// waited on a pipeline receive (whose wait the executor counts as
  /// communication): both halves waited inside their chunks, or the one
  /// left did.
  double chunk_idle = 0.0;
  /// Seconds each half (run()'s first, second) held the CPU: its compute,
  /// without its waits and the work `idle` ran in them.
  double compute[2] = {0.0, 0.0};
  /// Each half's waits on communication of its own (not a receive's: NOTE
  /// [A chunk's own waits] in step_timer.h), and their seconds in flight,
  /// each from the half's arrival at it to its end.
  int inner_waits[2] = {0, 0};
  double inner_waited[2] = {0.0, 0.0};
  /// Each half's compute between those waits, in order (inner_waits + 1).
  std::vector<double> nodes[2];
};

/// Runs pairs of functions as partners (NOTE [Overlapped pairs]): one on the
/// calling thread, the other on a thread of the runner, never both at once;
/// the CPU goes over to the other half at each wait on communication
/// (hp::distributed's WaitObserver), in an order fixed by the code. The
/// calling thread's autograd and dispatcher state, interrupt check and step
/// cache are the partner's too. Not reentrant: one pair at a time.
class PairRunner {
 public:
  /// On a device other than the CPU each half issues its work on a stream
  /// of its own (NOTE [An overlapped pair on a device] in overlap.cpp).
  /// With `first_ready`, a half whose wait ended takes the CPU as soon as it
  /// is free, whichever half that is; else the halves alternate in the
  /// code's order. First-ready needs every group the halves post on in
  /// lanes (distributed::with_lanes; NOTE [Turns as messages arrive]).
  explicit PairRunner(c10::Device device = c10::Device(c10::kCPU), bool first_ready = false);
  ~PairRunner();
  PairRunner(const PairRunner&) = delete;
  PairRunner& operator=(const PairRunner&) = delete;

  /// Runs `first` (on the calling thread; it starts) and `second` (on the
  /// runner's thread) as partners; returns when both ended. When a half
  /// throws, the other's wait in flight is aborted where the backend can
  /// (Gloo's point-to-point), its next switch throws, and the first error
  /// is rethrown here once both ended.
  ///
  /// `idle`, when given, fills waits: a half that starts a wait while its
  /// partner has ended or is stopped at a wait itself (every wait but the
  /// pair's first) calls it once first, on its own thread, before handing
  /// the CPU on (it runs one piece of work, a deferred W, and returns whether
  /// there was one; NOTE [Weight gradients in the waits]). With
  /// `fill_until_there` and first-ready turns it runs again and again while
  /// neither that wait nor the partner's has ended (distributed::Work::test;
  /// NOTE [Weight gradients until the message is there]).
  PairStats run(const std::function<void()>& first, const std::function<void()>& second,
                const std::function<bool()>& idle = {}, bool fill_until_there = false);

  struct State;  // overlap.cpp's

 private:
  std::unique_ptr<State> state_;
};

/// What a pair function that computes both halves itself is handed
/// (PairCall::computed; NOTE [A pair that computes itself] in stage.cpp).
struct PairInputs {
  std::vector<torch::Tensor> forward_input;   ///< the F's input leaves (received ones take grad)
  bool forward_is_last = false;               ///< the F's output is to be its loss
  std::vector<torch::Tensor> backward_roots;  ///< the B's outputs that take a gradient, or its loss
  std::vector<torch::Tensor> backward_grads;  ///< their gradients (a loss's: empty where 1)
  bool backward_is_last = false;              ///< the B starts from a loss
};

/// One FB pair handed to a pair function (ExecutorOptions::pair_function;
/// NOTE [A pair function] in overlap.cpp). Call `forward` and `backward`
/// once each, in any order, or `overlapped` once for both, or `computed`.
struct PairCall {
  schedule::Action action;         ///< the FB: F of (stage, microbatch), B of (stage2, microbatch2)
  std::function<void()> forward;   ///< the F half
  std::function<void()> backward;  ///< the B half (I alone under defer_wgrad)
  std::function<void()> overlapped;  ///< both, as partners (the built-in overlapped runner)
  /// Both halves computed by `fn` (DualPipe's overlapped_forward_backward):
  /// once both inputs arrived, fn runs the F's forward (returning its output,
  /// or on a last stage its loss) and the B's backward from its roots and
  /// grads into .grad (a fused B, also under defer_wgrad).
  std::function<void(const std::function<std::vector<torch::Tensor>(const PairInputs&)>& fn)>
      computed;
};

/// Times of the stand-in check (stand_in_overlap), in milliseconds on the
/// device's own clock.
struct StandInOverlap {
  double compute = 0.0;   ///< the compute half alone
  double transfer = 0.0;  ///< the stand-in transfer alone (posted, then waited on)
  double pair = 0.0;      ///< both as an overlapped pair
};

/// On `device` (CUDA): a stand-in transfer (a device-to-host copy of
/// `transfer_bytes` on a communication stream, waited on in stream order as
/// NCCL's work is) as one half and `iterations` products of n x n matrices
/// as the other, alone and then as a PairRunner pair: concurrent when the
/// pair takes less than the two alone (scripts/gpu_check.py). Throws on the
/// CPU.
StandInOverlap stand_in_overlap(c10::Device device, int64_t n, int iterations,
                                int64_t transfer_bytes);

/// Runs `fn` for the FB pair `a` (NOTE [A pair function] in overlap.cpp):
/// hands it the halves and the built-in overlapped runner, each callable
/// once; throws naming the pair where it ran a half twice or left one.
void run_pair_function(const std::function<void(PairCall&)>& fn, const schedule::Action& a,
                       const std::function<void()>& run_f, const std::function<void()>& run_b,
                       const std::function<void()>& overlapped,
                       const decltype(PairCall::computed)& computed);

}  // namespace hp::pipeline
