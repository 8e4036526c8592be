// hp/schedule/formulas.cpp: the closed-form bubble sizes (see formulas.h).
#include "hp/schedule/formulas.h"

#include <algorithm>
#include <cmath>

namespace hp::schedule {

ClosedForm closed_form(const std::string& name, int p, int m, int v, const CostModel& c) {
  ClosedForm cf;
  const double F = c.f, B = c.b, W = c.w, all = F + B + W;
  cf.ideal = m * all;
  cf.known = true;
  if (name == "naive") {
    cf.bubble = m * (p - 1) * all;
    cf.formula = "m(p-1)(F+B+W)";
  } else if (name == "gpipe" || name == "afab" || name == "1f1b") {
    cf.bubble = (p - 1) * all;
    cf.formula = "(p-1)(F+B+W)";
  } else if (name == "interleaved-1f1b") {
    cf.bubble = (p - 1) * all / std::max(v, 1);
    cf.formula = "(p-1)(F+B+W)/v";
  } else if (name == "zb-h1") {
    cf.bubble = (p - 1) * std::max(0.0, F + B - W);
    cf.formula = "(p-1)(F+B-W)";
  } else if (name == "zb-h2" && m >= 2 * p) {
    cf.bubble = (p - 1) * std::max(0.0, F + B - 2 * W);
    cf.formula = "(p-1)(F+B-2W)";
  } else if (name == "zbv" && F == B && B == W) {
    cf.bubble = 0.0;
    cf.formula = "0 (F = B = W)";
  } else if (name == "dualpipe") {
    cf.bubble = (p / 2 - 1) * std::max(0.0, all + B - 3 * W);
    cf.formula = "(p/2-1)(F&B+B-3W), F&B = F+B+W (DeepSeek)";
    cf.matches_simulator = false;
  } else if (name == "dualpipev") {
    cf.bubble = (p - 1) * std::max(0.0, all + B - 3 * W) / 2.0;
    cf.formula = "(p-1)(F&B+B-3W)/2, F&B = F+B+W (DeepSeek, half-size chunks)";
    cf.matches_simulator = false;
  } else {
    cf.known = false;
    return cf;
  }
  cf.ratio = cf.bubble / cf.ideal;
  cf.bubble_rate = cf.bubble / (cf.ideal + cf.bubble);
  return cf;
}

}  // namespace hp::schedule
