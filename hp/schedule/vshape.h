// hp/schedule/vshape.h: the controllable-memory family of V-shape schedules
// (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024,
// arXiv 2405.15362): V-Min, V-Half and V-ZB from their building blocks, and a
// memory-capped list scheduler on the V placement that the memory-budget
// search (budget.h) runs at any limit.
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
/// the memory search] in budget.cpp): the squeeze moves each of a rank's 5 m
/// ops at most once across its row of slots.
long long v_block_work(const std::vector<BlockOffsets>& block, int ranks, int microbatches,
                       int period = 6);

/// V-Min ("v-min"), V-Half ("v-half") or V-ZB ("v-zb") for p ranks and m
/// microbatches (schedule_from_v_block of v_block_offsets).
Schedule v_block_schedule(VBlock kind, int ranks, int microbatches);

/// Settings of one run of greedy_v (V placement, split backward).
///
/// At each moment the free rank with the earliest clock picks, in this order:
/// the up stage's F when its input is there (it completes the V turn); an I
/// whose input is there (the up stage's first); a down F while fewer than
/// `warmup[r]` microbatches are between their down F and their down I; a
/// deferred W; else it waits. A down F (a microbatch entering the rank) is
/// admitted only when the rank's memory can also hold that microbatch's up F
/// within `mem_limit` (NOTE [Admission on the V]); W's run early when memory
/// is short.
struct VGreedyParams {
  std::vector<int> warmup;   ///< [p] microbatches a rank may hold between down F and down I
  double mem_limit = 1e300;  ///< per-rank activation memory limit
  /// When set (one entry per rank), the rules above give way to a block's
  /// order: of the F's and I's whose inputs are there (a down F also needs
  /// admission), the one whose slot in the repeated block (offset + 6 k) is
  /// the earliest runs; W's fill the rest. The block's order adapted to the
  /// costs and capped to the limit (NOTE [Blocks as priorities]).
  std::vector<BlockOffsets> priority;
  /// With `priority`: an op may run only while its slot is at most `window`
  /// slots after the earliest slot among the rank's next ops that memory
  /// allows, ready or not (0: the block's order; large: any ready op).
  int window = 1 << 30;
};

/// The memory-capped list scheduler on the V placement (above). Per-stage
/// vectors of `costs`, when set, have 2p entries. Throws
/// std::invalid_argument naming the bound when `mem_limit` cannot hold one
/// microbatch on a rank (both of its stages).
Schedule greedy_v(int ranks, int microbatches, const CostModel& costs, const VGreedyParams& params);

}  // namespace hp::schedule
