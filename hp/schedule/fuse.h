// hp/schedule/fuse.h: overlapped pairs (FB) made from a schedule's adjacent
// forward and backward: interleaved-1f1b-fb and zbv-fb (NOTE [Pairs in
// interleaved 1F1B and ZB-V] in fuse.cpp), and which half of a pair leads.
#pragma once

#include <string>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// Work bound of fuse_pairs in simulated actions (about 0.1 s).
constexpr long long kFuseWork = 2'000'000;

/// True for the names of the overlapped variants ("...-fb"). The searches
/// and recommend() leave them out: they rank by the plain simulation, in
/// which a pair only waits for both inputs, so a variant at best ties its base.
bool is_fb_variant(const std::string& name);

/// `s` (compute-only, unlowered) with some of each rank's adjacent forward
/// and backward turned into one FB pair, chosen under `costs` so that the
/// overlapped simulation (SimOptions::overlap_pairs) at those costs is never
/// slower than `s`'s (NOTE [Pairs in interleaved 1F1B and ZB-V] in
/// fuse.cpp). An I that goes into a pair takes its W with it: the W's action
/// is dropped. `work` bounds the simulations (0: kFuseWork); where it runs
/// out, fewer pairs are tried. The result validates; its name is s's with
/// "-fb". Throws std::invalid_argument for a lowered schedule.
Schedule fuse_pairs(const Schedule& s, const CostModel& costs = {}, long long work = 0);

/// `s` with each FB pair's lead (Action::backward_first) set to the half
/// under which the pair ends first in the overlapped simulation at `costs`
/// (F on a tie; NOTE [The half that leads] in fuse.cpp). Lowered or not;
/// nothing else changes.
Schedule order_pairs(const Schedule& s, const CostModel& costs = {});

}  // namespace hp::schedule
