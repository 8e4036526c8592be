// `hp schedule memory-table` (bubble rates at fractions of 1F1B's memory)
// and `hp schedule paper-table` (the Zero Bubble paper's tables beside ours).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "hp/schedule/generators.h"
#include "hp/schedule/paper.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/simulate.h"
#include "tools/hp/schedule_cli.h"

namespace hp::cli::schedule_cli {

namespace {
namespace hs = hp::schedule;

struct MemoryTableArgs {
  double f = 1, b = 1, w = 1, comm = 0, mem_w = 1;
  bool json = false;
};

// `hp schedule memory-table`: at 1/3, 1/2, 1 and 2x of 1F1B's activation
// memory (p mem_b), for p in {4, 8, 16} and m in {3p, 6p}, the bubble rate of
// every fixed schedule that fits and of the search `auto`, with the
// controllable-memory paper's values for V-Min, V-Half and V-ZB beside ours.
void run_memory_table(const MemoryTableArgs& a) {
  hs::CostModel c;
  c.f = a.f;
  c.b = a.b;
  c.w = a.w;
  c.comm = a.comm;
  c.mem_b = 1;
  c.mem_w = a.mem_w;
  c.check();
  const std::vector<std::string> fixed = {"1f1b", "zb-h1", "zb-h2", "v-min", "v-half", "v-zb"};
  nlohmann::json rows = nlohmann::json::array();
  if (!a.json) {
    std::printf(
        "bubble rate (the Zero Bubble paper's) at a memory limit, F=%s B=%s W=%s comm=%s, "
        "mem_b=1 mem_w=%s\n(mem_w = 1: the controllable-memory paper's count, memory held "
        "until W); '-': over the limit;\nours / paper for V-Min (2p/3m), V-Half (p/2m), V-ZB "
        "(0); zbv: the paper's hand-made ZB-V; auto: the search\n\n",
        num(a.f).c_str(), num(a.b).c_str(), num(a.w).c_str(), num(a.comm).c_str(),
        num(a.mem_w).c_str());
    std::printf("| limit | p | m | 1F1B | ZB-H1 | ZB-H2 | zbv | V-Min | V-Half | V-ZB | auto |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  hs::SimOptions quiet;
  quiet.record_timeline = false;
  for (double frac : {1.0 / 3, 0.5, 1.0, 2.0}) {
    for (int p : {4, 8, 16}) {
      for (int mult : {3, 6}) {
        const int m = mult * p;
        const double limit = frac * p;
        auto cell = [&](const hs::Schedule& s, double paper) {
          const hs::SimResult r = hs::simulate(s, c, quiet);
          nlohmann::json j = {{"bubble_rate", r.bubble_rate},
                              {"peak_memory", r.max_peak_memory},
                              {"fits", r.max_peak_memory <= limit + 1e-9}};
          if (paper >= 0) j["paper"] = paper;
          return j;
        };
        nlohmann::json row = {{"limit_x", frac}, {"limit", limit}, {"p", p}, {"m", m}};
        for (const auto& n : fixed) {
          const double paper = n == "v-min"    ? 2.0 * p / (3.0 * m)
                               : n == "v-half" ? p / (2.0 * m)
                               : n == "v-zb"   ? 0.0
                                               : -1.0;
          row[n] = cell(hs::build(n, p, m), paper);
        }
        row["zbv"] = cell(hs::zbv(p, m), -1);
        row["auto"] = cell(hs::auto_search(p, m, c, limit), -1);
        rows.push_back(row);
        if (a.json) continue;
        auto show = [&](const char* key) {
          const auto& j = row[key];
          if (!j["fits"].get<bool>()) return std::string("-");
          std::string t = rate(j["bubble_rate"].get<double>());
          if (j.contains("paper")) t += " / " + rate(j["paper"].get<double>());
          return t;
        };
        const char* lx = frac < 0.4 ? "1/3" : frac < 0.9 ? "1/2" : frac < 1.5 ? "1" : "2";
        std::printf("| %sx (%s) | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n", lx,
                    num(limit).c_str(), p, m, show("1f1b").c_str(), show("zb-h1").c_str(),
                    show("zb-h2").c_str(), show("zbv").c_str(), show("v-min").c_str(),
                    show("v-half").c_str(), show("v-zb").c_str(), show("auto").c_str());
      }
    }
  }
  if (a.json) std::cout << nlohmann::json{{"rows", rows}}.dump(2) << "\n";
}

struct PaperArgs {
  int table = 0;  // 0: both
  bool json = false;
};

// `hp schedule paper-table`: the Zero Bubble paper's Tables 5 and 8 beside
// what our schedules give on the same inputs.
void run_paper(const PaperArgs& a) {
  if (a.table != 0 && a.table != 5 && a.table != 8)
    throw std::invalid_argument("--table " + std::to_string(a.table) + ": give 5 or 8");
  nlohmann::json out = nlohmann::json::object();
  if (a.table == 0 || a.table == 5) {
    nlohmann::json rows = nlohmann::json::array();
    if (!a.json) {
      std::printf(
          "Zero Bubble paper (arXiv 2401.10241) Table 5, inputs from its Table 9: bubble rate, "
          "paper / ours\nZB-1p: zb-auto under p M_B, ZB-2p: under 2p M_B (M_B = 34h + 5as, "
          "M_W = 32h, s = 1024);\nbound: no schedule within that memory has a lower rate "
          "(span_lower_bound)\n\n");
      std::printf("%-6s %3s %4s | %-15s | %-15s | %-15s | %-15s | %-15s | %s\n", "model", "p", "m",
                  "1F1B", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p", "bound 1p / 2p");
    }
    for (const hs::PaperRow& r : hs::paper_table5()) {
      hs::PaperResult o = hs::run_paper_row(r, 5);
      if (a.json) {
        rows.push_back({{"model", r.model},
                        {"p", r.p},
                        {"m", r.m},
                        {"paper", {r.r_1f1b, r.r_zbh1, r.r_zbh2, r.r_zb1p, r.r_zb2p}},
                        {"ours", {o.r_1f1b, o.r_zbh1, o.r_zbh2, o.r_zb1p, o.r_zb2p}},
                        {"bound", {o.bound_1p, o.bound_2p}}});
        continue;
      }
      std::printf("%-6s %3d %4d | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s\n",
                  r.model.c_str(), r.p, r.m, rate(r.r_1f1b).c_str(), rate(o.r_1f1b).c_str(),
                  rate(r.r_zbh1).c_str(), rate(o.r_zbh1).c_str(), rate(r.r_zbh2).c_str(),
                  rate(o.r_zbh2).c_str(), rate(r.r_zb1p).c_str(), rate(o.r_zb1p).c_str(),
                  rate(r.r_zb2p).c_str(), rate(o.r_zb2p).c_str(), rate(o.bound_1p).c_str(),
                  rate(o.bound_2p).c_str());
    }
    out["table5"] = {{"columns", {"1F1B", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p"}}, {"rows", rows}};
  }
  if (a.table == 0 || a.table == 8) {
    nlohmann::json rows = nlohmann::json::array();
    if (!a.json) {
      std::printf(
          "%sZero Bubble paper (arXiv 2401.10241) Table 8: bubble rate, paper / ours\nZB-V: "
          "zbv-auto "
          "under p M_B; inputs recovered from the table's own 1F1B, ZB-H1, ZB-H2 columns\n(see "
          "docs/schedules.md)\n\n",
          a.table == 0 ? "\n" : "");
      std::printf("%-6s %3s %4s | %-15s | %-15s | %-15s | %-15s\n", "model", "p", "m", "1F1B",
                  "ZB-H1", "ZB-H2", "ZB-V");
    }
    for (const hs::PaperRow& r : hs::paper_table8()) {
      hs::PaperResult o = hs::run_paper_row(r, 8);
      if (a.json) {
        rows.push_back({{"model", r.model},
                        {"p", r.p},
                        {"m", r.m},
                        {"paper", {r.r_1f1b, r.r_zbh1, r.r_zbh2, r.r_zbv}},
                        {"ours", {o.r_1f1b, o.r_zbh1, o.r_zbh2, o.r_zbv}}});
        continue;
      }
      std::printf("%-6s %3d %4d | %s / %s | %s / %s | %s / %s | %s / %s\n", r.model.c_str(), r.p,
                  r.m, rate(r.r_1f1b).c_str(), rate(o.r_1f1b).c_str(), rate(r.r_zbh1).c_str(),
                  rate(o.r_zbh1).c_str(), rate(r.r_zbh2).c_str(), rate(o.r_zbh2).c_str(),
                  rate(r.r_zbv).c_str(), rate(o.r_zbv).c_str());
    }
    out["table8"] = {{"columns", {"1F1B", "ZB-H1", "ZB-H2", "ZB-V"}}, {"rows", rows}};
  }
  if (a.json) std::cout << out.dump(2) << "\n";
}

}  // namespace

void add_table_commands(CLI::App* sched) {
  auto mt_args = std::make_shared<MemoryTableArgs>();
  CLI::App* mt = sched->add_subcommand(
      "memory-table", "bubble rates at 1/3, 1/2, 1 and 2x of 1F1B's memory (docs/schedules.md)");
  mt->add_option("--F", mt_args->f, "forward cost")->capture_default_str();
  mt->add_option("--B", mt_args->b, "input-gradient cost")->capture_default_str();
  mt->add_option("--W", mt_args->w, "weight-gradient cost")->capture_default_str();
  mt->add_option("--comm", mt_args->comm, "cost of one cross-rank transfer")->capture_default_str();
  mt->add_option("--mem-w", mt_args->mem_w, "memory from I until W (mem_b = 1)")
      ->capture_default_str();
  mt->add_flag("--json", mt_args->json, "print as JSON");
  mt->callback([mt_args]() { run_memory_table(*mt_args); });

  auto paper_args = std::make_shared<PaperArgs>();
  CLI::App* paper = sched->add_subcommand(
      "paper-table", "the Zero Bubble paper's Tables 5 and 8 beside our schedules");
  paper->add_option("--table", paper_args->table, "5 or 8 (default: both)");
  paper->add_flag("--json", paper_args->json, "print as JSON");
  paper->callback([paper_args]() { run_paper(*paper_args); });
}

}  // namespace hp::cli::schedule_cli
