// `hp schedule`: list, show (terminal timeline + statistics, SVG, trace, JSON,
// CSV), compare, tune (a schedule for measured per-stage costs), recommend
// (every schedule under a memory limit for a cost file, the best as CSV) and
// paper-table (the Zero Bubble paper's tables beside ours), all through the
// torch-free hp/schedule.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "hp/schedule/budget.h"
#include "hp/schedule/cost_file.h"
#include "hp/schedule/formulas.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/paper.h"
#include "hp/schedule/render.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/text.h"
#include "hp/schedule/zb_auto.h"
#include "tools/hp/commands.h"

namespace hp::cli {

namespace {
namespace hs = hp::schedule;

// Command-line settings shared by show and compare.
struct Common {
  int p = 4, m = 8, v = 2;
  double f = 1, b = 1, w = 1, comm = 0, mem_b = 1, mem_w = 0.5;
  std::string mem_limit;  // "" (default), a number, or a multiple like "2x" of p * mem_b
};

void add_common(CLI::App* c, Common& o) {
  c->add_option("-p,--ranks", o.p, "pipeline ranks")->capture_default_str();
  c->add_option("-m,--microbatches", o.m, "microbatches")->capture_default_str();
  c->add_option("-v,--chunks", o.v, "chunks per rank (interleaved)")->capture_default_str();
  c->add_option("--F", o.f, "forward cost of one rank's share of the model")->capture_default_str();
  c->add_option("--B", o.b, "input-gradient cost (the paper's B, our I)")->capture_default_str();
  c->add_option("--W", o.w, "weight-gradient cost")->capture_default_str();
  c->add_option("--comm", o.comm, "cost of one cross-rank transfer")->capture_default_str();
  c->add_option("--mem-b", o.mem_b, "activation memory from F until I")->capture_default_str();
  c->add_option("--mem-w", o.mem_w, "memory from I until W")->capture_default_str();
  c->add_option("--mem-limit", o.mem_limit,
                "per-rank memory limit: a number, or a multiple of p*mem_b like 2x "
                "(zb-auto, zbv and auto search under it; default 2x for zb-auto, 1x else)");
}

hs::CostModel costs_of(const Common& o) {
  hs::CostModel c;
  c.f = o.f;
  c.b = o.b;
  c.w = o.w;
  c.comm = o.comm;
  c.mem_b = o.mem_b;
  c.mem_w = o.mem_w;
  c.check();
  return c;
}

// A --mem-limit value: "" (0: the generator's default), a number, or a
// multiple of `unit` (p * mem_b) written like 2x.
double parse_mem_limit(const std::string& text, double unit) {
  if (text.empty()) return 0.0;
  std::string t = text;
  bool multiple = !t.empty() && (t.back() == 'x' || t.back() == 'X');
  if (multiple) t.pop_back();
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != t.size() || !(v > 0))
    throw std::invalid_argument("--mem-limit '" + hs::escape_bytes(text) +
                                "': expected a positive number (e.g. 12) or a multiple of "
                                "p*mem_b (e.g. 2x)");
  return multiple ? v * unit : v;
}

double mem_limit_of(const Common& o) {
  return parse_mem_limit(o.mem_limit, o.p * o.mem_b);
}

hs::BuildOptions options_of(const Common& o) {
  hs::BuildOptions b;
  b.chunks = o.v;
  b.costs = costs_of(o);
  b.mem_limit = mem_limit_of(o);
  return b;
}

// The line printed when a search's work bound cut it short (NOTE [Budget of
// the memory search]): the result is valid, the search did not see everything.
std::string cut_line(const std::string& note) {
  return "search cut short by its work bound (" + note +
         "); the result is valid but may not be the best (NOTE [Budget of the memory search])";
}

void write_file(const std::string& path, const std::string& text) {
  hs::write_text_file(path, text);  // NOTE [Output files are whole]
}

// Every output option refused before any work when its path cannot be
// written (NOTE [Output files are whole]); empty ones are not given.
void check_outputs(std::initializer_list<std::pair<const char*, const std::string*>> outputs) {
  for (const auto& [option, path] : outputs)
    if (!path->empty()) hs::check_output_path(*path, option);
}

std::string pct(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f%%", 100 * v);
  return buf;
}
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

struct ShowArgs {
  Common c;
  std::string name, from, svg, trace, csv;
  bool json = false, lowered = false, no_color = false;
  int width = 160;
};

void run_show(const ShowArgs& a) {
  check_outputs({{"--csv", &a.csv}, {"--svg", &a.svg}, {"--trace", &a.trace}});
  hs::Schedule s;
  std::string cut;
  if (!a.from.empty()) {
    s = hs::from_csv(hs::read_input_file(a.from), a.from);
  } else {
    if (a.name.empty()) throw std::invalid_argument("hp schedule show: give a NAME or --from FILE");
    hs::BuildOptions bo = options_of(a.c);
    bo.search_note = &cut;
    s = hs::build(a.name, a.c.p, a.c.m, bo);
  }
  hs::validate(s);
  hs::Schedule low = s.lowered ? s : hs::lower(s);
  hs::validate(low);
  const hs::Schedule& shown = a.lowered ? low : s;
  hs::CostModel costs = costs_of(a.c);
  hs::SimResult r = hs::simulate(shown, costs);
  std::string title =
      s.name + "  p=" + std::to_string(s.num_ranks) + " m=" + std::to_string(s.num_microbatches);
  r.timeline.title = title;
  hs::ClosedForm cf = hs::closed_form(s.name, s.num_ranks, s.num_microbatches, a.c.v, costs);
  if (!a.csv.empty()) write_file(a.csv, hs::to_csv(shown));
  if (!a.svg.empty()) write_file(a.svg, hs::render_svg(r.timeline));
  if (!a.trace.empty()) write_file(a.trace, hs::render_chrome_trace(r.timeline));
  if (a.json) {
    auto j = nlohmann::json::parse(hs::summary_json(r, s.name));
    j["ranks"] = s.num_ranks;
    j["microbatches"] = s.num_microbatches;
    j["stages"] = s.num_stages;
    if (cf.known)
      j["closed_form"] = {{"formula", cf.formula},
                          {"bubble", cf.bubble},
                          {"bubble_rate", cf.bubble_rate},
                          {"matches_simulator", cf.matches_simulator}};
    if (!cut.empty()) j["search_cut_short"] = cut;
    std::cout << j.dump(2) << "\n";
    return;
  }
  hs::AsciiOptions ao;
  ao.max_width = a.width;
  ao.color = !a.no_color && isatty(STDOUT_FILENO);
  std::cout << hs::render_ascii(r.timeline, ao) << "\n" << hs::summary_text(r);
  if (cf.known)
    std::cout << "closed form    " << cf.formula << " = " << num(cf.bubble) << " (bubble rate "
              << pct(cf.bubble_rate) << (cf.matches_simulator ? "" : ", reference only") << ")\n";
  if (!cut.empty()) std::cout << cut_line(cut) << "\n";
  if (a.lowered) {
    std::cout << "\nlowered action lists:\n";
    for (int rk = 0; rk < shown.num_ranks; ++rk)
      std::cout << "rank " << rk << ": " << hs::format_actions(shown.actions[rk]) << "\n";
  }
}

struct CompareArgs {
  Common c;
  std::string svg;
  bool json = false;
};

void run_compare(const CompareArgs& a) {
  check_outputs({{"--svg", &a.svg}});
  hs::BuildOptions bo = options_of(a.c);
  hs::CostModel costs = costs_of(a.c);
  const double limit = mem_limit_of(a.c);
  struct Row {
    std::string name;
    hs::SimResult r;
  };
  std::vector<Row> rows;
  std::vector<std::pair<std::string, std::string>> skipped;
  // NOTE [One size rule]: refused once, before any schedule is tried.
  hs::check_schedule_size("hp schedule compare", a.c.p, a.c.m, 1);
  for (const auto& n : hs::names()) {
    try {
      hs::Schedule s = hs::build(n, a.c.p, a.c.m, bo);
      hs::Schedule low = hs::lower(s);
      hs::validate(low);
      hs::SimResult r = hs::simulate(s, costs);
      r.timeline.title = n;
      rows.push_back({n, std::move(r)});
    } catch (const std::invalid_argument& e) {
      skipped.emplace_back(n, e.what());
    }
  }
  if (rows.empty()) {
    std::string why;
    for (const auto& [n, e] : skipped)
      why += "\n  " + n + ": " + e;
    throw std::invalid_argument("hp schedule compare: no schedule can be built at p=" +
                                std::to_string(a.c.p) + " m=" + std::to_string(a.c.m) + ":" + why);
  }
  // What a user picks by comes first: the step time, then the idle share.
  std::stable_sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
    const double tol = 1e-9 * std::max(1.0, std::max(x.r.makespan, y.r.makespan));
    if (x.r.makespan < y.r.makespan - tol) return true;
    if (y.r.makespan < x.r.makespan - tol) return false;
    return x.r.idle_fraction < y.r.idle_fraction - 1e-12;
  });
  if (!a.svg.empty()) {
    std::vector<hs::Timeline> tls;
    for (const auto& row : rows)
      tls.push_back(row.r.timeline);
    write_file(a.svg, hs::render_svg(tls));
  }
  if (a.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& row : rows)
      j.push_back(nlohmann::json::parse(hs::summary_json(row.r, row.name)));
    nlohmann::json out = {
        {"ranks", a.c.p}, {"microbatches", a.c.m}, {"sorted_by", "makespan"}, {"schedules", j}};
    nlohmann::json sk = nlohmann::json::array();
    for (const auto& [n, why] : skipped)
      sk.push_back({{"name", n}, {"reason", why}});
    out["skipped"] = sk;
    std::cout << out.dump(2) << "\n";
    return;
  }
  std::printf("p=%d m=%d v=%d  F=%s B=%s W=%s comm=%s  mem_b=%s mem_w=%s%s\n\n", a.c.p, a.c.m,
              a.c.v, num(a.c.f).c_str(), num(a.c.b).c_str(), num(a.c.w).c_str(),
              num(a.c.comm).c_str(), num(a.c.mem_b).c_str(), num(a.c.mem_w).c_str(),
              limit > 0 ? ("  mem-limit=" + num(limit)).c_str() : "");
  std::printf("%-18s %9s %7s %8s %9s %6s  %s\n", "schedule", "step time", "idle", "bubble",
              "peak-mem", "comm", "peak memory per rank");
  for (const auto& row : rows) {
    std::string per;
    for (size_t i = 0; i < row.r.peak_memory.size(); ++i) {
      if (i == 12 && row.r.peak_memory.size() > 14) {
        per += " ...";
        break;
      }
      per += (i ? " " : "") + num(row.r.peak_memory[i]);
    }
    std::string over = (limit > 0 && row.r.max_peak_memory > limit + 1e-9) ? "  (over limit)" : "";
    std::printf("%-18s %9s %7s %8s %9s %6d  %s%s\n", row.name.c_str(), num(row.r.makespan).c_str(),
                pct(row.r.idle_fraction).c_str(), pct(row.r.bubble_rate).c_str(),
                num(row.r.max_peak_memory).c_str(), row.r.comm_volume, per.c_str(), over.c_str());
  }
  std::printf(
      "\nsorted by step time. step time: one step's makespan (first op to last op over all\n"
      "ranks), in cost units. idle: total idle time / (p x step time), the wall-clock share\n"
      "(AFAB at p=4 m=8: 27.27%%). bubble: the Zero Bubble paper's bubble rate, (span - work)\n"
      "/ span of the longest rank, its span counted from its own first F (a later start is not\n"
      "counted). peak-mem: activation memory in units of mem_b; comm: cross-rank transfers.\n");
  if (!skipped.empty()) {
    std::printf("\nnot applicable for p=%d m=%d:\n", a.c.p, a.c.m);
    for (const auto& [n, why] : skipped)
      std::printf("  %-16s %s\n", n.c_str(), why.c_str());
  }
}

// The per-stage costs of a cost file and the ranks they give: -p (p_arg),
// when given, must be the file's stage count.
std::pair<hs::CostModel, int> costs_and_ranks(const std::string& cmd, const std::string& file,
                                              int p_arg) {
  if (file.empty()) throw std::invalid_argument("hp schedule " + cmd + ": give --costs FILE");
  hs::CostModel costs = hs::parse_stage_costs(hs::read_input_file(file), file);
  const int stages = static_cast<int>(costs.stage_f.size());
  const int p = p_arg > 0 ? p_arg : stages;
  if (p != stages)
    throw std::invalid_argument(file + " has " + std::to_string(stages) + " stages but -p is " +
                                std::to_string(p) + "; give one stage per rank (or leave -p out)");
  return {std::move(costs), p};
}

// -m at least 1 and within the one size rule (NOTE [One size rule]).
void check_microbatches(const std::string& cmd, int p, int m) {
  if (m < 1) throw std::invalid_argument("hp schedule " + cmd + ": -m must be at least 1");
  hs::check_schedule_size("hp schedule " + cmd, p, m, 2);
}

struct TuneArgs {
  std::string costs, out, mem_limit;
  int p = 0, m = 8;
  bool json = false;
};

// `hp schedule tune`: zb-auto under per-stage costs read from a file, written
// as a schedule CSV, beside the fixed schedules on the same p-stage cut.
void run_tune(const TuneArgs& a) {
  if (a.out.empty()) throw std::invalid_argument("hp schedule tune: give -o OUT.csv");
  check_outputs({{"-o", &a.out}});
  const auto [costs, p] = costs_and_ranks("tune", a.costs, a.p);
  check_microbatches("tune", p, a.m);
  const double limit = parse_mem_limit(a.mem_limit, p * costs.mem_b);
  std::string cut;
  hs::SearchOptions so;
  so.cut_note = &cut;
  hs::Schedule tuned = hs::zb_auto(p, a.m, costs, limit, so);
  tuned.name = "tuned";
  hs::validate(hs::lower(tuned));
  write_file(a.out, hs::to_csv(tuned));
  const double used_limit = limit > 0 ? limit : 2.0 * p * costs.mem_b;
  hs::SimOptions quiet;
  quiet.record_timeline = false;
  struct Row {
    std::string name;
    hs::SimResult r;
  };
  std::vector<Row> rows = {{"tuned (zb-auto)", hs::simulate(tuned, costs, quiet)}};
  for (const char* n : {"1f1b", "zb-h1", "zb-h2", "gpipe", "naive"})
    rows.push_back({n, hs::simulate(hs::build(n, p, a.m), costs, quiet)});
  if (a.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& row : rows)
      j.push_back(nlohmann::json::parse(hs::summary_json(row.r, row.name)));
    nlohmann::json out{{"ranks", p},
                       {"microbatches", a.m},
                       {"mem_limit", used_limit},
                       {"csv", a.out},
                       {"schedules", j}};
    if (!cut.empty()) out["search_cut_short"] = cut;
    std::cout << out.dump(2) << "\n";
    return;
  }
  std::printf("tuned p=%d m=%d from %s, memory limit %s; wrote %s\n\n", p, a.m, a.costs.c_str(),
              num(used_limit).c_str(), a.out.c_str());
  std::printf("%-16s %9s %7s %8s %9s\n", "schedule", "step time", "idle", "bubble", "peak-mem");
  for (const auto& row : rows) {
    const bool over = row.r.max_peak_memory > used_limit + 1e-9;
    std::printf("%-16s %9s %7s %8s %9s%s\n", row.name.c_str(), num(row.r.makespan).c_str(),
                pct(row.r.idle_fraction).c_str(), pct(row.r.bubble_rate).c_str(),
                num(row.r.max_peak_memory).c_str(), over ? "  (over limit)" : "");
  }
  std::printf(
      "\nall on the same %d-stage cut with the file's per-stage costs; step time is the\n"
      "makespan, idle the wall-clock share, bubble the Zero Bubble paper's rate.\n"
      "run it: hp schedule show --from %s\n",
      p, a.out.c_str());
  if (!cut.empty()) std::printf("%s\n", cut_line(cut).c_str());
}

struct RecommendArgs {
  std::string costs, out, mem_limit;
  int p = 0, m = 0;
  bool json = false;
};

// `hp schedule recommend`: every schedule (the search `auto` included) under
// a cost file's per-stage costs, simulated, the ones within the memory limit
// first, by step time; the top one written as CSV for `hp train
// --schedule-file`.
void run_recommend(const RecommendArgs& a) {
  check_outputs({{"-o", &a.out}});
  const auto [costs, p] = costs_and_ranks("recommend", a.costs, a.p);
  const int m = a.m > 0 ? a.m : 4 * p;
  check_microbatches("recommend", p, m);
  double mem_b = 0;
  for (double v : costs.stage_mem_b)
    mem_b = std::max(mem_b, v);
  const double one_f1b = p * mem_b;
  double limit = parse_mem_limit(a.mem_limit, one_f1b);
  if (limit <= 0) limit = one_f1b;
  const double floor = hs::smallest_feasible_memory(p, m, costs);
  if (limit < floor - 1e-9 * std::max(1.0, floor))
    throw std::invalid_argument("--mem-limit " + num(limit) +
                                " is below the smallest any schedule reaches (" + num(floor) +
                                ": one microbatch at a time); give at least " + num(floor));
  std::vector<std::pair<std::string, std::string>> skipped;
  std::vector<hs::Recommendation> rows = hs::recommend(p, m, costs, limit, &skipped);
  if (rows.empty() || !rows.front().fits)
    throw std::invalid_argument("no schedule fits memory limit " + num(limit));
  const hs::Recommendation& top = rows.front();
  if (!a.out.empty()) {
    hs::Schedule best = top.schedule;
    hs::validate(hs::lower(best));
    write_file(a.out, hs::to_csv(best));
  }
  if (a.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& row : rows) {
      auto o = nlohmann::json::parse(hs::summary_json(row.result, row.name));
      o["fits"] = row.fits;
      j.push_back(o);
    }
    nlohmann::json sk = nlohmann::json::array();
    for (const auto& [n, why] : skipped)
      sk.push_back({{"name", n}, {"reason", why}});
    std::cout << nlohmann::json{{"ranks", p},
                                {"microbatches", m},
                                {"mem_limit", limit},
                                {"one_f1b_memory", one_f1b},
                                {"smallest_feasible_memory", floor},
                                {"best", top.name},
                                {"csv", a.out},
                                {"sorted_by", "fits, then makespan"},
                                {"schedules", j},
                                {"skipped", sk}}
                     .dump(2)
              << "\n";
    return;
  }
  std::printf("p=%d m=%d from %s, memory limit %s (1F1B's: %s, smallest possible: %s)\n\n", p, m,
              a.costs.c_str(), num(limit).c_str(), num(one_f1b).c_str(), num(floor).c_str());
  std::printf("%-18s %9s %8s %9s  %s\n", "schedule", "step time", "bubble", "peak-mem",
              "peak memory per rank");
  for (const auto& row : rows) {
    std::string per;
    for (size_t i = 0; i < row.result.peak_memory.size(); ++i) {
      if (i == 12 && row.result.peak_memory.size() > 14) {
        per += " ...";
        break;
      }
      per += (i ? " " : "") + num(row.result.peak_memory[i]);
    }
    std::printf("%-18s %9s %8s %9s  %s%s\n", row.name.c_str(), num(row.result.makespan).c_str(),
                pct(row.result.bubble_rate).c_str(), num(row.result.max_peak_memory).c_str(),
                per.c_str(), row.fits ? "" : "  (over limit)");
  }
  std::printf(
      "\nwithin the limit first, then by step time (makespan, the costs' time unit); bubble: "
      "the\nZero Bubble paper's rate; memory in the file's mem_b unit. Other cuts than one "
      "stage\nper rank get each stage's costs split evenly over its chunks.\n");
  if (!a.out.empty())
    std::printf("wrote %s (%s); run it: hp train --schedule-file %s ...\n", a.out.c_str(),
                top.name.c_str(), a.out.c_str());
  if (!skipped.empty()) {
    std::printf("\nnot applicable or left out for p=%d m=%d:\n", p, m);
    for (const auto& [n, why] : skipped)
      std::printf("  %-16s %s\n", n.c_str(), why.c_str());
  }
}

std::string rate(double v);

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
        "(0); zbv: the hand-made ZB-V; auto: the search\n\n",
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
        row["zbv"] = cell(hs::zbv_handmade(p, m), -1);
        row["auto"] = cell(hs::budget_search(p, m, c, limit), -1);
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

std::string rate(double v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.4f", v);
  return buf;
}

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
          "%sZero Bubble paper (arXiv 2401.10241) Table 8: bubble rate, paper / ours\nZB-V: zbv "
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

void add_schedule_command(CLI::App& app) {
  CLI::App* sched =
      app.add_subcommand("schedule",
                         "pipeline schedules: list, show, compare, tune, recommend, paper-table, "
                         "memory-table");
  sched->require_subcommand(1);

  CLI::App* list = sched->add_subcommand("list", "list the schedule generators");
  list->callback([]() {
    for (const auto& n : hs::names())
      std::printf("%-18s %s\n", n.c_str(), hs::describe(n).c_str());
  });

  auto show_args = std::make_shared<ShowArgs>();
  CLI::App* show = sched->add_subcommand("show", "draw one schedule and print its statistics");
  show->add_option("name", show_args->name, "schedule name (see `hp schedule list`)");
  show->add_option("--from", show_args->from, "read the schedule from a CSV file instead");
  add_common(show, show_args->c);
  show->add_option("--svg", show_args->svg, "write an SVG picture to FILE");
  show->add_option("--trace", show_args->trace, "write a Chrome/Perfetto trace to FILE");
  show->add_option("--csv", show_args->csv, "write the action lists as CSV to FILE");
  show->add_flag("--json", show_args->json, "print the statistics as JSON");
  show->add_flag("--lowered", show_args->lowered, "include SEND/RECV (lowered lists)");
  show->add_flag("--no-color", show_args->no_color, "no ANSI colours even on a terminal");
  show->add_option("--width", show_args->width, "max timeline width in characters")
      ->capture_default_str();
  show->callback([show_args]() { run_show(*show_args); });

  auto cmp_args = std::make_shared<CompareArgs>();
  CLI::App* cmp =
      sched->add_subcommand("compare", "all schedules side by side, sorted by step time");
  add_common(cmp, cmp_args->c);
  cmp->add_option("--svg", cmp_args->svg, "write all timelines stacked as one SVG");
  cmp->add_flag("--json", cmp_args->json, "print the table as JSON");
  cmp->callback([cmp_args]() { run_compare(*cmp_args); });

  auto tune_args = std::make_shared<TuneArgs>();
  CLI::App* tune = sched->add_subcommand(
      "tune", "a zero-bubble schedule for measured per-stage costs, written as CSV");
  tune->add_option("--costs", tune_args->costs,
                   "per-stage costs JSON: {\"stages\": [{\"f\":..,\"i\":..,\"w\":..,"
                   "\"comm\":..,\"mem_b\":..,\"mem_w\":..}, ...]} (docs/schedules.md)")
      ->required();
  tune->add_option("-p,--ranks", tune_args->p, "pipeline ranks (default: the file's stages)");
  tune->add_option("-m,--microbatches", tune_args->m, "microbatches")->capture_default_str();
  tune->add_option("--mem-limit", tune_args->mem_limit,
                   "per-rank memory limit: a number, or a multiple of p*max(mem_b) like 2x "
                   "(default 2x)");
  tune->add_option("-o,--out", tune_args->out, "write the schedule CSV here")->required();
  tune->add_flag("--json", tune_args->json, "print the comparison as JSON");
  tune->callback([tune_args]() { run_tune(*tune_args); });

  auto rec_args = std::make_shared<RecommendArgs>();
  CLI::App* rec = sched->add_subcommand(
      "recommend", "every schedule under a memory limit for a cost file, fastest first");
  rec->add_option("--costs", rec_args->costs,
                  "per-stage costs JSON, one stage per rank (docs/schedules.md)")
      ->required();
  rec->add_option("-p,--ranks", rec_args->p, "pipeline ranks (default: the file's stages)");
  rec->add_option("-m,--microbatches", rec_args->m, "microbatches (default 4p)");
  rec->add_option("--mem-limit", rec_args->mem_limit,
                  "per-rank memory limit: a number, or a multiple of p*max(mem_b) like 0.5x "
                  "(default 1x)");
  rec->add_option("-o,--out", rec_args->out, "write the fastest fitting schedule as CSV here");
  rec->add_flag("--json", rec_args->json, "print the ranking as JSON");
  rec->callback([rec_args]() { run_recommend(*rec_args); });

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

HP_CLI_COMMAND(add_schedule_command);

}  // namespace hp::cli
