// hp/schedule/paper.cpp: the Zero Bubble paper's Tables 5 and 8 (inputs and
// bubble rates, typed in from arXiv 2401.10241) and our schedules on them.
#include "hp/schedule/paper.h"

#include "hp/schedule/generators.h"
#include "hp/schedule/search/search.h"

namespace hp::schedule {

const std::vector<PaperRow>& paper_table5() {
  // Table 5 (bubble rates) with Table 9 (profiled T_F, T_B, T_W, T_comm in
  // ZB-2p) and Table 3 (hidden size, attention heads).
  static const std::vector<PaperRow> rows = {
      {"1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 2304, 24, 0.2431, 0.1585, 0.1083, 0.1585,
       0.0433},
      {"1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 2304, 24, 0.1985, 0.1242, 0.0837, 0.1242,
       0.0039},
      {"1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 2304, 24, 0.1240, 0.0674, 0.0444, 0.0674,
       0.0026},
      {"6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 4096, 32, 0.2347, 0.1323, 0.0698, 0.1323,
       0.0029},
      {"6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 4096, 32, 0.1898, 0.1045, 0.0559, 0.1045,
       0.0022},
      {"6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 4096, 32, 0.1091, 0.0554, 0.0294, 0.0554,
       0.0010},
      {"14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 5120, 40, 0.2552, 0.1397, 0.0672, 0.1397,
       0.0066},
      {"14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 5120, 40, 0.2082, 0.1088, 0.0516, 0.1088,
       0.0054},
      {"14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378, 5120, 40, 0.1251, 0.0576, 0.0266, 0.0576,
       0.0028},
      {"28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 6144, 48, 0.2646, 0.1421, 0.0641, 0.1421,
       0.0038},
      {"28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 6144, 48, 0.2168, 0.1106, 0.0490, 0.1106,
       0.0029},
      {"28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 6144, 48, 0.1352, 0.0594, 0.0257, 0.0594,
       0.0018},
  };
  return rows;
}

// NOTE [Table 8 inputs]
// Table 8 gives bubble rates "based on the profiled values of T_F, T_B, T_W
// and T_comm obtained in the experiments for ZB-V" but does not print those
// values. Its own 1F1B, ZB-H1 and ZB-H2 columns pin them down: those bubble
// rates depend on the costs through W/(F+B) and comm/(F+B) (our simulator
// reproduces every such column of Table 5 to the printed digit), and solving
// the three columns of a row for these two ratios leaves no residual beyond
// the printed rounding. The F:B split, which those columns cannot tell
// apart, is Table 9's for the same model (mean T_B / T_F of its three rows:
// 0.9893, 0.9950, 0.9818). F is 1 (rates do not depend on the time unit).
// The test checks that these inputs give back the paper's 1F1B, ZB-H1 and
// ZB-H2 columns of Table 8.
const std::vector<PaperRow>& paper_table8() {
  static const std::vector<PaperRow> rows = [] {
    std::vector<PaperRow> r = {
        {"6.2B", 16, 48, 1, 0.9893, 0.6687, 0.0556, 4096, 32, 0.2668, 0.1536, 0.0823},
        {"6.2B", 16, 64, 1, 0.9893, 0.6692, 0.0559, 4096, 32, 0.2206, 0.1198, 0.0630},
        {"6.2B", 16, 128, 1, 0.9893, 0.6698, 0.0562, 4096, 32, 0.1390, 0.0637, 0.0325},
        {"14.6B", 24, 72, 1, 0.9950, 0.7630, 0.0548, 5120, 40, 0.2699, 0.1439, 0.0628},
        {"14.6B", 24, 96, 1, 0.9950, 0.7621, 0.0549, 5120, 40, 0.2229, 0.1121, 0.0480},
        {"14.6B", 24, 192, 1, 0.9950, 0.7619, 0.0558, 5120, 40, 0.1403, 0.0595, 0.0247},
        {"28.3B", 32, 96, 1, 0.9818, 0.7520, 0.0453, 6144, 48, 0.2676, 0.1429, 0.0629},
        {"28.3B", 32, 128, 1, 0.9818, 0.7536, 0.0460, 6144, 48, 0.2204, 0.1111, 0.0478},
        {"28.3B", 32, 256, 1, 0.9818, 0.7465, 0.0460, 6144, 48, 0.1362, 0.0593, 0.0251},
    };
    const double zbv_rates[] = {0.0697, 0.0533, 0.0274, 0.0638, 0.0483,
                                0.0250, 0.0593, 0.0451, 0.0236};
    for (size_t i = 0; i < r.size(); ++i)
      r[i].r_zbv = zbv_rates[i];
    return r;
  }();
  return rows;
}

CostModel paper_costs(const PaperRow& row) {
  const double s = 1024;
  const double m_b = 34.0 * row.hidden + 5.0 * row.heads * s;
  const double m_w = 32.0 * row.hidden;
  CostModel c;
  c.f = row.f;
  c.b = row.b;
  c.w = row.w;
  c.comm = row.comm;
  c.mem_b = 1.0;
  c.mem_w = m_w / m_b;
  return c;
}

PaperResult run_paper_row(const PaperRow& row, int table) {
  const CostModel c = paper_costs(row);
  SimOptions quiet;
  quiet.record_timeline = false;
  auto run = [&](const Schedule& s) { return simulate(s, c, quiet); };
  PaperResult out;
  out.r_1f1b = run(build("1f1b", row.p, row.m)).bubble_rate;
  out.r_zbh1 = run(build("zb-h1", row.p, row.m)).bubble_rate;
  out.r_zbh2 = run(build("zb-h2", row.p, row.m)).bubble_rate;
  if (table == 5) {
    SimResult one = run(zb_auto(row.p, row.m, c, 1.0 * row.p * c.mem_b));
    SimResult two = run(zb_auto(row.p, row.m, c, 2.0 * row.p * c.mem_b));
    out.r_zb1p = one.bubble_rate;
    out.peak_1p = one.max_peak_memory;
    out.r_zb2p = two.bubble_rate;
    out.peak_2p = two.max_peak_memory;
    const double work = row.m * (row.f + row.b + row.w);
    for (int x : {1, 2}) {
      const double span = span_lower_bound(row.p, row.m, c, x * row.p * c.mem_b);
      (x == 1 ? out.bound_1p : out.bound_2p) = (span - work) / span;
    }
  } else {
    SimResult v = run(zbv_auto(row.p, row.m, c, 1.0 * row.p * c.mem_b));
    out.r_zbv = v.bubble_rate;
    out.peak_zbv = v.max_peak_memory;
  }
  return out;
}

}  // namespace hp::schedule
