// `hp schedule recommend`: which schedule to run for a stage cost file. Every
// schedule ranked under a memory limit (the searches included), or, with
// --search, one search beside the fixed schedules on one stage per rank (the
// job `hp schedule tune` did; `tune` stays as its alias); -o writes the
// schedule at the top as CSV for `hp train --schedule-file`.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hp/schedule/budget.h"
#include "hp/schedule/cost_file.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/render.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/text.h"
#include "tools/hp/schedule_cli.h"

namespace hp::cli::schedule_cli {

namespace {
namespace hs = hp::schedule;

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

struct RecommendArgs {
  std::string costs, out, mem_limit;
  std::string search;  // "": rank every schedule; else the one search to run
  int p = 0, m = 0;
  bool json = false;
};

struct Row {
  std::string name;
  hs::SimResult result;
  bool fits = false;
};

// With --search: the search's schedule under the file's costs (the V's cut
// for zbv-auto, carried over: NOTE [Costs of other cuts]) and the fixed
// schedules on the file's own cut, which tune printed beside it.
hs::Schedule search_rows(const RecommendArgs& a, const hs::CostModel& costs, int p, int m,
                         double limit, std::vector<Row>& rows, std::string& cut) {
  hs::BuildOptions o;
  o.mem_limit = limit;
  o.search_note = &cut;
  o.costs = a.search == "zbv-auto" ? hs::costs_for_cut(costs, hs::make_v_layout(p, m)) : costs;
  hs::Schedule s = hs::build(a.search, p, m, o);
  hs::SimOptions quiet;
  quiet.record_timeline = false;
  auto row = [&](const std::string& name, const hs::Schedule& x) {
    const hs::SimResult r = hs::simulate(x, hs::costs_for_cut(costs, x), quiet);
    rows.push_back({name, r, r.max_peak_memory <= limit + 1e-9 * std::max(1.0, limit)});
  };
  row(a.search, s);
  for (const char* n : {"1f1b", "zb-h1", "zb-h2", "gpipe", "naive"})
    row(n, hs::build(n, p, m));
  std::stable_sort(rows.begin() + 1, rows.end(), [](const Row& x, const Row& y) {
    if (x.fits != y.fits) return x.fits;
    return x.result.makespan < y.result.makespan - 1e-9 * std::max(1.0, y.result.makespan);
  });
  return s;
}

// `hp schedule recommend` (NOTE [Stage cost file] in cost_file.h for FILE).
void run_recommend(const RecommendArgs& a) {
  check_outputs({{"-o", &a.out}});
  if (!a.search.empty() && a.search != "zb-auto" && a.search != "zbv-auto" && a.search != "auto")
    throw std::invalid_argument("--search '" + hs::escape_bytes(a.search) +
                                "': give zb-auto, zbv-auto or auto");
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
  std::vector<Row> rows;
  std::vector<std::pair<std::string, std::string>> skipped;
  std::string cut;  // --search: what its work bound left out
  hs::Schedule best;
  if (a.search.empty()) {
    std::vector<hs::Recommendation> ranked = hs::recommend(p, m, costs, limit, &skipped);
    if (ranked.empty() || !ranked.front().fits)
      throw std::invalid_argument("no schedule fits memory limit " + num(limit));
    best = ranked.front().schedule;
    for (auto& r : ranked)
      rows.push_back({r.name, std::move(r.result), r.fits});
  } else {
    best = search_rows(a, costs, p, m, limit, rows, cut);
  }
  const std::string top = rows.front().name;
  if (!a.out.empty()) {
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
    nlohmann::json out{{"ranks", p},
                       {"microbatches", m},
                       {"mem_limit", limit},
                       {"one_f1b_memory", one_f1b},
                       {"smallest_feasible_memory", floor},
                       {"best", top},
                       {"csv", a.out},
                       {"sorted_by", a.search.empty() ? "fits, then makespan"
                                                      : "the search, then fits, then makespan"},
                       {"schedules", j},
                       {"skipped", sk}};
    if (!a.search.empty()) out["search"] = a.search;
    if (!cut.empty()) out["search_cut_short"] = cut;
    std::cout << out.dump(2) << "\n";
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
  if (!a.search.empty())
    std::printf("\nthe search first, then the fixed schedules on one stage per rank:");
  std::printf(
      "\nwithin the limit first, then by step time (makespan, the costs' time unit); bubble: "
      "the\nZero Bubble paper's rate; memory in the file's mem_b unit. Other cuts than one "
      "stage\nper rank get each stage's costs split evenly over its chunks.\n");
  if (!a.out.empty())
    std::printf("wrote %s (%s); run it: hp train --schedule-file %s ...\n", a.out.c_str(),
                top.c_str(), a.out.c_str());
  if (!cut.empty()) std::printf("%s\n", cut_line(cut).c_str());
  if (!skipped.empty()) {
    std::printf("\nnot applicable or left out for p=%d m=%d:\n", p, m);
    for (const auto& [n, why] : skipped)
      std::printf("  %-16s %s\n", n.c_str(), why.c_str());
  }
}

void add_cost_file_options(CLI::App* c, RecommendArgs& a) {
  c->add_option("--costs", a.costs, "per-stage costs JSON, one stage per rank (docs/schedules.md)")
      ->required();
  c->add_option("-p,--ranks", a.p, "pipeline ranks (default: the file's stages)");
  c->add_flag("--json", a.json, "print the ranking as JSON");
}

}  // namespace

void add_recommend_commands(CLI::App* sched) {
  auto rec_args = std::make_shared<RecommendArgs>();
  CLI::App* rec = sched->add_subcommand(
      "recommend", "every schedule under a memory limit for a cost file, fastest first");
  add_cost_file_options(rec, *rec_args);
  rec->add_option("-m,--microbatches", rec_args->m, "microbatches (default 4p)");
  rec->add_option("--mem-limit", rec_args->mem_limit,
                  "per-rank memory limit: a number, or a multiple of p*max(mem_b) like 0.5x "
                  "(default 1x)");
  rec->add_option("--search", rec_args->search,
                  "run only this search (zb-auto, zbv-auto or auto) and rank it first, beside "
                  "the fixed schedules on one stage per rank; -o writes it");
  rec->add_option("-o,--out", rec_args->out,
                  "write the top schedule (with --search: the search's) as CSV here");
  rec->callback([rec_args]() { run_recommend(*rec_args); });

  // `tune`, the name of `recommend --search zb-auto` before it was part of
  // recommend, with the defaults it had.
  auto tune_args = std::make_shared<RecommendArgs>();
  tune_args->m = 8;
  CLI::App* tune = sched->add_subcommand(
      "tune", "alias of `recommend --search zb-auto` with -m 8 and --mem-limit 2x by default");
  add_cost_file_options(tune, *tune_args);
  tune->add_option("-m,--microbatches", tune_args->m, "microbatches")->capture_default_str();
  tune->add_option("--mem-limit", tune_args->mem_limit,
                   "per-rank memory limit: a number, or a multiple of p*max(mem_b) like 2x "
                   "(default 2x)");
  tune->add_option("-o,--out", tune_args->out, "write the schedule CSV here")->required();
  tune->callback([tune_args]() {
    std::fprintf(stderr,
                 "hp schedule tune is `hp schedule recommend --search zb-auto` (here with -m %d "
                 "--mem-limit %s); tune stays as its alias\n",
                 tune_args->m, tune_args->mem_limit.empty() ? "2x" : tune_args->mem_limit.c_str());
    RecommendArgs a = *tune_args;
    a.search = "zb-auto";
    if (a.mem_limit.empty()) a.mem_limit = "2x";
    run_recommend(a);
  });
}

}  // namespace hp::cli::schedule_cli
