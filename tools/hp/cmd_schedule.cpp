// `hp schedule`: list, show (terminal timeline + statistics, SVG, trace, JSON,
// CSV) and compare here; recommend (and its alias tune) in
// cmd_schedule_recommend.cpp, paper-table and memory-table in
// cmd_schedule_tables.cpp; all through the torch-free hp/schedule.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <initializer_list>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>

#include "hp/schedule/cost_file.h"
#include "hp/schedule/formulas.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/render.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/text.h"
#include "tools/hp/commands.h"
#include "tools/hp/schedule_cli.h"

namespace hp::cli {

namespace schedule_cli {
namespace hs = hp::schedule;

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

std::string cut_line(const std::string& note) {
  return "search cut short by its work bound (" + note +
         "); the result is valid but may not be the best (NOTE [Budget of the memory search])";
}

void write_file(const std::string& path, const std::string& text) {
  hs::write_text_file(path, text);  // NOTE [Output files are whole]
}

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

std::string rate(double v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.4f", v);
  return buf;
}

}  // namespace schedule_cli

namespace {
using namespace schedule_cli;
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
                "(zb-auto, zbv-auto and auto search under it; default 2x for zb-auto, 1x else)");
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

struct ShowArgs {
  Common c;
  std::string name, from, svg, trace, csv, costs;
  bool json = false, lowered = false, no_color = false, fb_overlap = false, defer_wgrad = false;
  std::string pair_turns = "auto";  // NOTE [Turns as messages arrive]
  int w_parts = 1;                  // NOTE [Weight gradients until the message is there]
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
  if (!a.costs.empty()) {  // NOTE [Stage cost file]: one entry per stage of this schedule
    costs = hs::parse_stage_costs(hs::read_input_file(a.costs), a.costs);
    if (costs.stage_f.size() != static_cast<size_t>(s.num_stages))
      throw std::invalid_argument(a.costs + " has " + std::to_string(costs.stage_f.size()) +
                                  " stages but the schedule has " + std::to_string(s.num_stages) +
                                  " (a report of the same schedule, -p and -m fits)");
  }
  hs::SimOptions so;
  so.overlap_pairs = a.fb_overlap;  // NOTE [An overlapped pair in the simulator]
  so.defer_wgrad = a.defer_wgrad;   // NOTE [Deferred W's in the simulator]
  so.pair_first_ready = hs::pair_turns_ready(a.pair_turns, a.defer_wgrad);  // as hp train's
  so.deferred_w_parts = a.w_parts;
  hs::SimResult r = hs::simulate(shown, costs, so);
  std::string title =
      s.name + "  p=" + std::to_string(s.num_ranks) + " m=" + std::to_string(s.num_microbatches);
  r.timeline.title = title;
  // NOTE [Waits inside a chunk]: a pair cut at its chunks' waits, node by node.
  const hs::Timeline drawn = hs::pair_nodes_drawn(r);
  hs::ClosedForm cf = hs::closed_form(s.name, s.num_ranks, s.num_microbatches, a.c.v, costs);
  // NOTE [Deferred W's where they lower the step]: what hp train's
  // --defer-wgrad auto would choose under these costs (CPU ranks).
  std::optional<hs::DeferredWChoice> choice;
  if (a.fb_overlap && !a.defer_wgrad && low.has_pairs())
    choice = hs::choose_deferred_w(shown, costs, a.pair_turns, true, false);
  if (!a.csv.empty()) write_file(a.csv, hs::to_csv(shown));
  if (!a.svg.empty()) write_file(a.svg, hs::render_svg(drawn));
  if (!a.trace.empty()) write_file(a.trace, hs::render_chrome_trace(drawn));
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
    if (choice)
      j["defer_wgrad_auto"] = {{"step_with", choice->step_with},
                               {"step_without", choice->step_without},
                               {"peak_with", choice->peak_with},
                               {"peak_without", choice->peak_without},
                               {"deferred", choice->defer}};
    std::cout << j.dump(2) << "\n";
    return;
  }
  hs::AsciiOptions ao;
  ao.max_width = a.width;
  ao.color = !a.no_color && isatty(STDOUT_FILENO);
  std::cout << hs::render_ascii(drawn, ao) << "\n" << hs::summary_text(r);
  if (cf.known)
    std::cout << "closed form    " << cf.formula << " = " << num(cf.bubble) << " (bubble rate "
              << pct(cf.bubble_rate) << (cf.matches_simulator ? "" : ", reference only") << ")\n";
  if (!cut.empty()) std::cout << cut_line(cut) << "\n";
  if (choice)
    std::cout << "deferred W's   step " << num(choice->step_with) << " with --defer-wgrad against "
              << num(choice->step_without) << " without, peak memory " << num(choice->peak_with)
              << " against " << num(choice->peak_without) << ": hp train's --defer-wgrad auto "
              << (choice->defer ? "takes them" : "does not") << "\n";
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

}  // namespace

void add_schedule_command(CLI::App& app) {
  CLI::App* sched =
      app.add_subcommand("schedule",
                         "pipeline schedules: list, show, compare, recommend (tune), paper-table, "
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
  show->add_flag("--fb-overlap", show_args->fb_overlap,
                 "run each FB pair as hp train --fb-overlap does: its lead first (the partner "
                 "first where only the lead waits for a message), each half drawn as it ran");
  show->add_flag("--defer-wgrad", show_args->defer_wgrad,
                 "with --fb-overlap: each pair's B runs its I and queues its W, as hp train "
                 "--defer-wgrad does")
      ->needs("--fb-overlap");
  show->add_option("--pair-turns", show_args->pair_turns,
                   "with --fb-overlap: ready (at each wait the half whose wait ends first "
                   "runs), fixed (the other half) or auto (default, as hp train's: ready, "
                   "fixed with --defer-wgrad)")
      ->check(CLI::IsMember({"auto", "ready", "fixed"}))
      ->needs("--fb-overlap");
  show->add_option("--w-parts", show_args->w_parts,
                   "with --defer-wgrad and ready turns: each deferred W in N parts, run at a "
                   "wait until a message is there, as hp train --w-parts (default 1)")
      ->check(CLI::PositiveNumber)
      ->needs("--defer-wgrad");
  show->add_option("--costs", show_args->costs,
                   "simulate under the per-stage costs of FILE (a stage cost file or a report "
                   "of hp train --report, one entry per stage), the waits inside its chunks "
                   "included: with --fb-overlap each pair is drawn node by node");
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

  add_recommend_commands(sched);
  add_table_commands(sched);
}

HP_CLI_COMMAND(add_schedule_command);

}  // namespace hp::cli
