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
  CostModel costs;  ///< costs and memory (the searches search under these)
  /// The searches (zb-auto, zbv-auto, auto): per-rank activation memory
  /// limit; 0 = the preset's default (zb-auto: 2 p mem_b, the paper's ZB-2p;
  /// zbv-auto and auto: p mem_b, 1F1B's).
  double mem_limit = 0;
  /// The searches: their work bound in simulated actions (0: the default;
  /// NOTE [Budget of the memory search] in search/search.cpp).
  long long search_work = 0;
  /// The searches: when set and the work bound cut the search short, a line
  /// saying what it left out is appended here.
  std::string* search_note = nullptr;
};

/// Every generator name build() accepts, in a stable order.
const std::vector<std::string>& names();

/// One line saying what the named schedule is (for `hp schedule list`).
std::string describe(const std::string& name);

/// Builds the named schedule for `ranks` ranks and `microbatches`
/// microbatches: naive, gpipe (alias afab), 1f1b, interleaved-1f1b
/// (depth-first), interleaved-1f1b-fb and zbv-fb (the two with overlapped
/// FB pairs chosen under `costs`: fuse_pairs in fuse.h), interleaved-bfs (breadth-first / looped),
/// interleaved-zb (depth-first with the backward split), zb-h1, zb-h2, zbv (the paper's ZB-V),
/// dualpipe, dualpipev, v-min, v-half, v-zb (vshape.h), and the presets of the schedule search
/// (search/search.h): zb-auto, zbv-auto and auto. Throws std::invalid_argument stating any unmet
/// constraint (even ranks, enough microbatches, divisibility) and what to change.
Schedule build(const std::string& name, int ranks, int microbatches,
               const BuildOptions& options = {});

/// ZB-V, the Zero Bubble paper's hand-made V schedule ("zbv";
/// torch.distributed.pipelining's ScheduleZBVZeroBubble construction, laid
/// out for F = I = W and no transfer time). Before the names said what they
/// are, "zbv" was the cost-aware search and this function zbv_handmade; the
/// search is now "zbv-auto" (zbv_auto in search/search.h), whose first
/// candidate this is.
Schedule zbv(int ranks, int microbatches);

}  // namespace hp::schedule
