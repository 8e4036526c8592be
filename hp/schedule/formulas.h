// hp/schedule/formulas.h: closed-form bubble sizes of the classic schedules
// (seed 004: naive, AFAB/1F1B, interleaved; Zero Bubble: ZB-H1, ZB-H2; DeepSeek:
// DualPipe, DualPipeV), to check the simulator and to print beside it.
#pragma once

#include <string>

#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// A closed form for one schedule, in the units of CostModel (f, b = I, w;
/// no communication).
struct ClosedForm {
  bool known = false;        ///< false when no closed form applies (e.g. zb-auto)
  double bubble = 0.0;       ///< idle time inside the longest rank's span
  double ideal = 0.0;        ///< m * (F + B + W): one rank's work
  double ratio = 0.0;        ///< bubble / ideal (seed 004's r_bubble)
  double bubble_rate = 0.0;  ///< bubble / (ideal + bubble) (the Zero Bubble paper's rate,
                             ///< seed 004's wall-clock fraction)
  std::string formula;       ///< the formula in words, e.g. "(p-1)(F+B+W)"
  /// True when the simulator reproduces the formula on this repository's cost
  /// model (unit costs at least). DeepSeek's DualPipe(V) formulas count an
  /// overlapped F&B chunk differently from our FB (one block whose outputs
  /// leave at its end), so for them this is false: see docs/schedules.md.
  bool matches_simulator = true;
};

/// The closed form of schedule `name` with p ranks, m microbatches, v chunks.
/// naive: m(p-1)(F+B+W); gpipe, 1f1b: (p-1)(F+B+W); interleaved-1f1b:
/// (p-1)(F+B+W)/v; zb-h1: (p-1)(F+B-W); zb-h2 (m >= 2p): (p-1)max(0, F+B-2W); zbv: 0
/// when F = B = W; dualpipe: DeepSeek's (p/2-1)(F&B+B-3W) with F&B = F+B+W;
/// dualpipev: (p-1)(F&B+B-3W)/2 (chunks of half size). B is the paper's B
/// (our I).
ClosedForm closed_form(const std::string& name, int p, int m, int v, const CostModel& costs);

}  // namespace hp::schedule
