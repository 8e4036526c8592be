// `hp bench schedules`: trains the same model on the same data with every
// schedule (and optionally with --recompute, and schedule files), round-robin
// so machine noise hits all alike, and prints one table: step time, the
// simulator's predicted step and its error, speedup over 1F1B, measured and
// simulated bubble, memory.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "hp/core/subprocess.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/text.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct BenchArgs {
  std::string model = "gpt";
  int layers = 8, d_model = 128, heads = 4, seq_len = 64;
  int nproc = 2, microbatches = 8, microbatch_size = 4, steps = 6, rounds = 2;
  std::string schedules;  // comma separated; empty = all that fit
  bool recompute_rows = false;
  bool pin = true;
  std::string markdown;                     // write the table as markdown here too
  std::vector<std::string> schedule_files;  // NAME=FILE: rows that run a schedule CSV
  std::string keep_reports;                 // keep each run's report here
};

struct Row {
  std::string name;
  std::string file;  // a schedule CSV (hp train --schedule-file) instead of -s name
  bool recompute = false;
  std::vector<double> step_times;       // median step of each round
  std::vector<double> predicted_steps;  // simulated step of each round (see run_once)
  std::vector<double> errors;           // each round's predicted / measured step - 1 (same step)
  double measured_bubble = 0, simulated_bubble = 0;
  double peak_mib = 0, overhead_pct = 0;
  // Last run's peak activation memory per rank in microbatches (NOTE [Memory
  // measured against predicted] in hp/train/trainer.cpp): measured, the
  // simulator's count, and that count with each op's transient.
  std::vector<double> peak_mb, predicted_mb, transient_mb;
  std::string error;
};

// One hp train run of `row`; its report (and, when `trace` is not empty, its
// timeline) is written where given.
void run_once(const BenchArgs& a, Row& row, const std::string& report, const std::string& trace) {
  std::ostringstream cmd;
  cmd << self_executable() << " train --no-progress --model " << a.model << " --layers " << a.layers
      << " --d-model " << a.d_model
      << (a.model == "gpt"
              ? " --heads " + std::to_string(a.heads) + " --seq-len " + std::to_string(a.seq_len)
              : "")
      << " -p " << a.nproc
      << (row.file.empty() ? " -s " + row.name : " --schedule-file '" + row.file + "'") << " -m "
      << a.microbatches << " --microbatch-size " << a.microbatch_size << " --steps " << a.steps
      << " --report " << report << (trace.empty() ? "" : " --trace " + trace)
      << (a.pin ? " --pin" : "") << (row.recompute ? " --recompute" : "");
  int rc = 0;
  std::string out = hp::run_and_capture(cmd.str(), &rc);
  if (rc != 0) {
    auto cut = out.find("hp: error: ");
    row.error = cut == std::string::npos ? "failed (exit " + std::to_string(rc) + ")"
                                         : out.substr(cut + 11, out.find('\n', cut) - cut - 11);
    return;
  }
  std::ifstream in(report);
  auto j = nlohmann::json::parse(in);
  auto steps = j["step_seconds"].get<std::vector<double>>();
  // The simulator predicts the pipeline; the step also sums replica gradients,
  // steps the optimizer and reduces the loss, which it does not model. The
  // predicted step adds that part as measured in the last step (its step time
  // less its measured pipeline makespan), so measured and predicted steps
  // cover the same work.
  // NOTE [Prediction error on the same step]
  // The costs come from the last step, so its error is against the last
  // step: steps of one run differ by up to 15 % on a shared host (another
  // process takes a core for a while), which no cost model of the schedule
  // can predict. The median step is the "step ms" column.
  double outside = std::max(0.0, steps.back() - j["measured_makespan_seconds"].get<double>());
  double predicted = j["simulated_makespan_seconds"].get<double>() + outside;
  row.predicted_steps.push_back(predicted);
  row.errors.push_back(predicted / steps.back() - 1);
  if (steps.size() > 1) steps.erase(steps.begin());  // the first step warms up
  std::sort(steps.begin(), steps.end());
  row.step_times.push_back(steps[steps.size() / 2]);
  row.measured_bubble = j["measured_bubble"].get<double>();
  row.simulated_bubble = j["simulated_bubble"].get<double>();
  double peak = 0, overhead = 0;
  row.peak_mb.clear(), row.predicted_mb.clear(), row.transient_mb.clear();
  for (const auto& r : j["ranks"]) {
    peak = std::max(peak, r["peak_activation_bytes"].get<double>());
    if (r.contains("peak_activation_microbatches")) {
      row.peak_mb.push_back(r["peak_activation_microbatches"].get<double>());
      row.predicted_mb.push_back(r["predicted_peak_microbatches"].get<double>());
      row.transient_mb.push_back(r["predicted_peak_with_transients_microbatches"].get<double>());
    }
    overhead = std::max(overhead, r["overhead_seconds"].get<double>());
  }
  row.peak_mib = peak / 1048576.0;
  double med = row.step_times.back();
  row.overhead_pct = med > 0 ? 100.0 * overhead / med : 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void run_bench(const BenchArgs& a) {
  std::vector<std::string> names;
  if (a.schedules.empty()) {
    for (const auto& n : schedule::names())
      if (n != "afab") names.push_back(n);
  } else {
    std::stringstream ss(a.schedules);
    std::string n;
    while (std::getline(ss, n, ','))
      names.push_back(n);
  }
  if (std::find(names.begin(), names.end(), "1f1b") == names.end())
    names.insert(names.begin(), "1f1b");
  std::vector<std::pair<std::string, std::string>> files;  // (row name, CSV)
  for (const auto& nf : a.schedule_files) {
    auto eq = nf.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == nf.size())
      throw std::invalid_argument("--schedule-file takes NAME=FILE, not '" + nf + "'");
    std::string file = nf.substr(eq + 1);
    if (file.find('\'') != std::string::npos)
      throw std::invalid_argument("--schedule-file: a file name with a quote is not supported");
    if (!std::filesystem::exists(file))
      throw std::invalid_argument("--schedule-file: no file '" + file + "'");
    files.emplace_back(nf.substr(0, eq), std::filesystem::absolute(file).string());
  }
  std::vector<Row> rows;
  for (bool recompute : {false, true}) {
    if (recompute && !a.recompute_rows) break;
    for (const auto& n : names) {
      Row row;
      row.name = n;
      row.recompute = recompute;
      rows.push_back(row);
    }
    for (const auto& [n, file] : files) {
      Row row;
      row.name = n;
      row.file = file;
      row.recompute = recompute;
      rows.push_back(row);
    }
  }
  if (!a.keep_reports.empty()) std::filesystem::create_directories(a.keep_reports);

  auto dir = std::filesystem::temp_directory_path() / ("hp-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (int round = 0; round < a.rounds; ++round) {
    for (auto& row : rows) {
      if (!row.error.empty()) continue;
      std::fprintf(stderr, "\rround %d/%d: %-16s%s          ", round + 1, a.rounds,
                   row.name.c_str(), row.recompute ? " +recompute" : "");
      if (a.keep_reports.empty()) {
        run_once(a, row, (dir / "report.json").string(), "");
      } else {
        auto base = (std::filesystem::path(a.keep_reports) /
                     (row.name + (row.recompute ? "+recompute" : "") + "-round" +
                      std::to_string(round + 1)))
                        .string();
        run_once(a, row, base + ".json", base + ".trace.json");
      }
    }
  }
  std::fprintf(stderr, "\n");
  std::filesystem::remove_all(dir);

  const Row* base = nullptr;
  for (const auto& r : rows)
    if (r.name == "1f1b" && !r.recompute && r.error.empty()) base = &r;
  std::ostringstream md;
  md << "| schedule | step ms | predicted ms | error | speedup vs 1f1b | predicted speedup | "
        "measured bubble | simulated bubble | peak act. MiB | executor overhead |\n"
     << "|---|---|---|---|---|---|---|---|---|---|\n";
  std::printf("%-22s %9s %9s %7s %8s %9s %8s %8s %9s %9s\n", "schedule", "step ms", "pred. ms",
              "error", "speedup", "pred. sp.", "bubble", "sim bub.", "peak MiB", "overhead");
  for (const auto& r : rows) {
    std::string label = r.name + (r.recompute ? " +recompute" : "");
    if (!r.error.empty()) {
      std::printf("%-22s  %s\n", label.c_str(), r.error.c_str());
      md << "| " << label << " | " << r.error << " | | | | | | | | |\n";
      continue;
    }
    double t = median(r.step_times);
    double sim = median(r.predicted_steps);
    double error = median(r.errors);  // NOTE [Prediction error on the same step]
    double speedup = base ? median(base->step_times) / t : 0;
    double predicted = base && sim > 0 ? median(base->predicted_steps) / sim : 0;
    std::printf("%-22s %9.1f %9.1f %+6.1f%% %8.3f %9.3f %7.1f%% %7.1f%% %9.2f %8.2f%%\n",
                label.c_str(), t * 1e3, sim * 1e3, 100 * error, speedup, predicted,
                100 * r.measured_bubble, 100 * r.simulated_bubble, r.peak_mib, r.overhead_pct);
    char line[512];
    std::snprintf(
        line, sizeof line,
        "| %s | %.1f | %.1f | %+.1f %% | %.3f | %.3f | %.1f %% | %.1f %% | %.2f | %.2f %% |\n",
        label.c_str(), t * 1e3, sim * 1e3, 100 * error, speedup, predicted, 100 * r.measured_bubble,
        100 * r.simulated_bubble, r.peak_mib, r.overhead_pct);
    md << line;
  }
  // Peak activation memory per rank, in units of one microbatch's
  // activations on that rank (CPU runs only: the tracker counts host memory).
  auto ranks_text = [](const std::vector<double>& v) {
    std::string out;
    char b[32];
    for (double x : v) {
      std::snprintf(b, sizeof b, "%s%.2f", out.empty() ? "" : " ", x);
      out += b;
    }
    return out;
  };
  bool any_memory = false;
  for (const auto& r : rows)
    any_memory = any_memory || (r.error.empty() && !r.peak_mb.empty());
  if (any_memory) {
    std::printf("\npeak activation memory per rank, in microbatches (last round)\n");
    std::printf("%-22s %-28s %-28s %-28s %7s\n", "schedule", "measured", "predicted",
                "predicted + transients", "error");
    md << "\n| schedule | peak per rank, measured | predicted | predicted + transients | "
          "largest error against predicted + transients |\n|---|---|---|---|---|\n";
    for (const auto& r : rows) {
      if (!r.error.empty() || r.peak_mb.empty()) continue;
      std::string label = r.name + (r.recompute ? " +recompute" : "");
      double worst = 0;
      for (size_t k = 0; k < r.peak_mb.size(); ++k) {
        const double e = r.transient_mb[k] > 0 ? r.peak_mb[k] / r.transient_mb[k] - 1 : 0;
        if (std::abs(e) > std::abs(worst)) worst = e;
      }
      std::printf("%-22s %-28s %-28s %-28s %+6.1f%%\n", label.c_str(),
                  ranks_text(r.peak_mb).c_str(), ranks_text(r.predicted_mb).c_str(),
                  ranks_text(r.transient_mb).c_str(), 100 * worst);
      char line[512];
      std::snprintf(line, sizeof line, "| %s | %s | %s | %s | %+.1f %% |\n", label.c_str(),
                    ranks_text(r.peak_mb).c_str(), ranks_text(r.predicted_mb).c_str(),
                    ranks_text(r.transient_mb).c_str(), 100 * worst);
      md << line;
    }
  }
  if (!a.markdown.empty()) hp::schedule::write_text_file(a.markdown, md.str());
}

void add_bench_command(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "side-by-side benchmarks of whole training runs");
  bench->require_subcommand(1);
  auto a = std::make_shared<BenchArgs>();
  auto* s = bench->add_subcommand("schedules", "train with every schedule, one table");
  s->add_option("--model", a->model, "gpt or mlp");
  s->add_option("--layers", a->layers, "layers");
  s->add_option("--d-model", a->d_model, "width");
  s->add_option("--heads", a->heads, "attention heads");
  s->add_option("--seq-len", a->seq_len, "tokens per sequence");
  s->add_option("--nproc,-p", a->nproc, "ranks");
  s->add_option("--microbatches,-m", a->microbatches, "microbatches per step");
  s->add_option("--microbatch-size", a->microbatch_size, "rows per microbatch");
  s->add_option("--steps", a->steps, "steps per run (the first is not timed)");
  s->add_option("--rounds", a->rounds, "round-robin passes over the schedules");
  s->add_option("--schedules", a->schedules, "comma-separated subset (default: all)");
  s->add_flag("--recompute-rows", a->recompute_rows, "add every schedule again with --recompute");
  s->add_flag("!--no-pin", a->pin, "do not pin ranks to cores");
  s->add_option("--markdown", a->markdown, "also write the table as markdown");
  s->add_option(
      "--schedule-file", a->schedule_files,
      "NAME=FILE: also run the schedule CSV FILE (hp schedule recommend -o writes one) as "
      "row NAME; repeatable");
  s->add_option("--keep-reports", a->keep_reports,
                "keep each run's hp train --report and --trace here (NAME-roundK.json, "
                "NAME-roundK.trace.json)");
  s->callback([a] { run_bench(*a); });
}

HP_CLI_COMMAND(add_bench_command);

}  // namespace
}  // namespace hp::cli
