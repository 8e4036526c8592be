// hp/schedule/action.h: the Action IR, one unit of pipeline work (F, I, W, B, FB)
// or communication (SEND_F, RECV_F, SEND_B, RECV_B), and its short text form.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace hp::schedule {

/// What an action does. `I` is the input gradient (dx), `W` the weight
/// gradient (dw), `B` both at once. `FB` is an overlapped pair: the F of one
/// (stage, microbatch) beside the B of another, as DualPipe runs them.
///
/// NOTE [Naming of B]
/// In this IR `B` is the fused backward (I + W) and `I` is dx. The Zero Bubble
/// paper's "B" is our `I`. Cost models (CostModel::b, the CLI's --B) follow the
/// paper: they give the cost of `I`; a fused `B` costs b + w.
enum class Op : std::uint8_t { F, I, W, B, FB, SEND_F, RECV_F, SEND_B, RECV_B };

/// True for F, I, W, B and FB (work that takes compute time).
bool is_compute(Op op);
/// True for SEND_F, RECV_F, SEND_B, RECV_B.
bool is_comm(Op op);
/// The op's name as printed: "F", "I", ..., "SEND_B".
std::string_view op_name(Op op);

/// One action of one rank.
///
/// - compute ops name the stage that computes and the microbatch;
/// - `FB` names the forward half in (stage, microbatch) and the backward
///   (fused B) half in (stage2, microbatch2);
/// - SEND_F/SEND_B name the *producing* stage (whose output or input gradient
///   is sent), RECV_F/RECV_B the *consuming* stage (which will read it).
///   The peer rank follows from Schedule::stage_rank and the microbatch route.
struct Action {
  Op op = Op::F;
  int stage = 0;
  int microbatch = 0;
  int stage2 = -1;       ///< FB only: stage of the B half.
  int microbatch2 = -1;  ///< FB only: microbatch of the B half.
  /// FB only: the B half leads the overlapped pair (NOTE [The half that
  /// leads] in hp/schedule/fuse.cpp); written `5B0+3F1`.
  bool backward_first = false;

  /// A compute or communication action on (stage, microbatch).
  static Action make(Op op, int stage, int microbatch) { return Action{op, stage, microbatch}; }
  /// An overlapped pair: F of (fs, fmb) beside B of (bs, bmb).
  static Action overlap(int fs, int fmb, int bs, int bmb, bool backward_first = false) {
    return Action{Op::FB, fs, fmb, bs, bmb, backward_first};
  }

  bool operator==(const Action& o) const {
    return op == o.op && stage == o.stage && microbatch == o.microbatch && stage2 == o.stage2 &&
           microbatch2 == o.microbatch2 && backward_first == o.backward_first;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

/// Short text form: `2F0` (stage 2, F, microbatch 0), `1I3`, `0SEND_B2`, and
/// for FB `3F1+5B0` (F of stage 3 mb 1 overlapped with B of stage 5 mb 0;
/// `5B0+3F1` when the B half leads).
std::string to_string(const Action& a);

/// Parses the short text form (surrounding spaces allowed). Throws
/// std::invalid_argument naming the text on any error.
Action parse_action(std::string_view text);

}  // namespace hp::schedule
