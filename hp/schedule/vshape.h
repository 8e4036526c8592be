// hp/schedule/vshape.h: the controllable-memory family of V-shape schedules
// (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024,
// arXiv 2405.15362): V-Min, V-Half and V-ZB from their building blocks (the
// searches run the blocks as priorities of greedy_v: search/heuristics.h).
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// The three blocks of the paper's V-shape family.
enum class VBlock { Min, Half, ZB };

/// Where one microbatch's four compute ops sit on one rank in a building
/// block, in slots of one op (NOTE [V-shape building blocks]): the forward of
/// the down stage (r), the forward of the up stage (2p-1-r), then the input
/// gradients of the up stage and of the down stage.
struct BlockOffsets {
  int f_down = 0;  ///< F of stage r
  int f_up = 0;    ///< F of stage 2p-1-r
  int i_up = 0;    ///< I of stage 2p-1-r
  int i_down = 0;  ///< I of stage r
};

/// The building block of `kind` for p ranks: one BlockOffsets per rank. The
/// four offsets of a rank are distinct modulo 6 (the block repeats every 6
/// slots; the two free slots hold W's).
std::vector<BlockOffsets> v_block_offsets(VBlock kind, int ranks);

/// The family of NOTE [V-shape building blocks]: down forwards `a` slots
/// apart between neighbouring ranks, up input gradients `b`, up forwards and
/// down input gradients `u` (V-Min: 1, 1, 1; V-Half: 2, 2, 1; V-ZB: 4, 4,
/// 2), with the smallest gaps g1, g2 that keep each rank's offsets distinct
/// modulo `period`. Throws std::invalid_argument when none do (e.g. a = b =
/// 4, u = 1 at period 6).
std::vector<BlockOffsets> v_block_family(int ranks, int a, int b, int u, int period = 6);

/// The block repeated for m microbatches every `period` slots (6: the
/// paper's; longer periods leave slots empty and hold fewer microbatches in
/// flight, NOTE [Stretched blocks]), W's in the free slots, squeezed (warmup and cooldown ops moved
/// into earlier free slots where that keeps the block's peak memory), then read off as each rank's
/// order. V placement (make_v_layout), F/I/W actions. Throws
/// std::invalid_argument when p < 1 or m < 1, period < 6, or when two ops of
/// a rank fall on one slot (the message names the rank and the offsets).
Schedule schedule_from_v_block(const std::vector<BlockOffsets>& block, int ranks, int microbatches,
                               const std::string& name, int period = 6);

/// An upper bound on the work of schedule_from_v_block(block, p, m, .., period)
/// and of simulating its result, in simulated-action units (NOTE [Budget of
/// the memory search] in search/search.cpp): the squeeze moves each of a rank's 5 m
/// ops at most once across its row of slots.
long long v_block_work(const std::vector<BlockOffsets>& block, int ranks, int microbatches,
                       int period = 6);

/// V-Min ("v-min"), V-Half ("v-half") or V-ZB ("v-zb") for p ranks and m
/// microbatches (schedule_from_v_block of v_block_offsets).
Schedule v_block_schedule(VBlock kind, int ranks, int microbatches);

}  // namespace hp::schedule
