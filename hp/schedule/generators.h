// hp/schedule/generators.h: every named pipeline schedule as a generator of
// compute-only per-rank action lists (lower() adds the communication).
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// Options shared by the generators; each uses the fields it needs.
struct BuildOptions {
  int chunks = 2;   ///< v: virtual stages per rank (interleaved-*)
  CostModel costs;  ///< costs and memory (zb-auto searches under these)
  /// zb-auto, zbv, auto: per-rank activation memory limit; 0 = the
  /// generator's default (zb-auto: 2 p mem_b, the paper's ZB-2p; zbv and
  /// auto: p mem_b, 1F1B's).
  double mem_limit = 0;
  /// zb-auto, zbv, auto: the search's work bound in simulated actions (0: its
  /// default; NOTE [Budget of the memory search] in budget.cpp).
  long long search_work = 0;
  /// zb-auto, zbv, auto: when set and the work bound cut the search short, a
  /// line saying what it left out is appended here.
  std::string* search_note = nullptr;
};

/// Every generator name build() accepts, in a stable order.
const std::vector<std::string>& names();

/// One line saying what the named schedule is (for `hp schedule list`).
std::string describe(const std::string& name);

/// Builds the named schedule for `ranks` ranks and `microbatches`
/// microbatches: naive, gpipe (alias afab), 1f1b, interleaved-1f1b
/// (depth-first), interleaved-bfs (breadth-first / looped), interleaved-zb
/// (depth-first with the backward split), zb-h1, zb-h2, zbv,
/// dualpipe, dualpipev, zb-auto, v-min, v-half, v-zb (vshape.h) and auto
/// (the memory-budget search, budget.h). Throws std::invalid_argument stating any
/// unmet constraint (even ranks, enough microbatches, divisibility) and what
/// to change.
Schedule build(const std::string& name, int ranks, int microbatches,
               const BuildOptions& options = {});

/// The hand-made ZB-V order (torch.distributed.pipelining's
/// ScheduleZBVZeroBubble construction, laid out for F = I = W and no
/// transfer time): the first candidate of `zbv`, which searches under the
/// real costs (zbv_auto in zb_auto.h).
Schedule zbv_handmade(int ranks, int microbatches);

}  // namespace hp::schedule
