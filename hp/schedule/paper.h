// hp/schedule/paper.h: the Zero Bubble paper's bubble-rate tables (arXiv
// 2401.10241, Qi et al.: Table 5 with its inputs from Table 9, Table 8 with
// inputs recovered from its own columns) as data, and our schedules on them.
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// One row of a paper table: the model, p, m, the per-rank costs the paper
/// simulated with, the transformer shape its memory model needs, and the
/// paper's bubble rates (-1 where the table has no such column).
struct PaperRow {
  std::string model;                             ///< "1.5B", ...
  int p = 0;                                     ///< pipeline stages (ranks)
  int m = 0;                                     ///< microbatches
  double f = 0, b = 0, w = 0, comm = 0;          ///< T_F, T_B (our I), T_W, T_comm
  int hidden = 0;                                ///< h
  int heads = 0;                                 ///< a
  double r_1f1b = -1, r_zbh1 = -1, r_zbh2 = -1;  ///< paper: 1F1B, ZB-H1, ZB-H2
  double r_zb1p = -1, r_zb2p = -1;               ///< paper: ZB-1p, ZB-2p (Table 5)
  double r_zbv = -1;                             ///< paper: ZB-V (Table 8)
};

/// Table 5 (bubble rates of 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p) with the
/// profiled costs of Table 9.
const std::vector<PaperRow>& paper_table5();

/// Table 8 (bubble rates of 1F1B, ZB-H1, ZB-H2, ZB-V; the V runs' costs).
/// The paper does not print these inputs: see NOTE [Table 8 inputs].
const std::vector<PaperRow>& paper_table8();

/// The row's cost model as the paper defines memory: mem_b = M_B =
/// 34h + 5as and mem_w = M_W = 32h per token (s = 1024), normalised so that
/// mem_b = 1 (limits are then multiples of p).
CostModel paper_costs(const PaperRow& row);

/// Our bubble rates on one row (NOTE [Bubble rate]).
struct PaperResult {
  double r_1f1b = 0, r_zbh1 = 0, r_zbh2 = 0;      ///< our hand-made schedules
  double r_zb1p = -1, r_zb2p = -1;                ///< zb-auto under p M_B and 2p M_B (Table 5)
  double r_zbv = -1;                              ///< zbv-auto under p M_B (Table 8)
  double peak_1p = 0, peak_2p = 0, peak_zbv = 0;  ///< their peak memory, in M_B
  /// The bubble rate of span_lower_bound() under p M_B and 2p M_B (Table 5):
  /// no loop schedule within that memory does better.
  double bound_1p = -1, bound_2p = -1;
};

/// Runs our schedules on a row of Table 5 (`table == 5`) or Table 8.
PaperResult run_paper_row(const PaperRow& row, int table);

}  // namespace hp::schedule
