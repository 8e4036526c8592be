// Report and summary of a training run: the last step's measurements
// gathered on rank 0, the fit and simulation, the files.
#include "hp/train/report.h"

#include "hp/distributed/collectives.h"
#include "hp/pipeline/step_timeline.h"
#include "hp/schedule/progress.h"
#include "hp/schedule/render.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/text.h"
#include "hp/train/checkpoint.h"
#include "hp/train/stage_memory.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace hp::train {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The stage costs fitted to a measured timeline, with the stage bytes.
schedule::CostModel fitted_costs(const schedule::Schedule& sched,
                                 const schedule::Timeline& timeline, double comm_cost,
                                 const std::vector<double>& stage_bytes) {
  schedule::CostModel costs = schedule::costs_from_timeline(sched, timeline, comm_cost);
  // NOTE [Memory measured against predicted] in stage_memory.cpp: the
  // simulator's memory count under the measured bytes of every stage (they
  // also land in the report's stage costs, as mem_b and mem_w in bytes).
  if (!stage_bytes.empty()) set_stage_memory(costs, stage_bytes);
  return costs;
}

}  // namespace

void gather_and_report(const TrainConfig& config, const schedule::Schedule& sched,
                       const pipeline::StepStats& last, double peak_bytes,
                       const std::vector<double>& stage_bytes, double comm_cost,
                       distributed::Comm& comm, distributed::Comm* copies, bool reporter,
                       TrainResult& result) {
  constexpr int64_t kFixed = 10;  // the figures below; then the copies' (kPerCopy each)
  constexpr int64_t kPerCopy = 3;
  auto mine =
      torch::tensor({last.compute, last.comm_wait, last.overhead, peak_bytes, last.pair_hidden,
                     last.pair_exposed, double(last.deferred_w_in_waits),
                     double(last.deferred_w_at_end), last.pair_exposed_alone, last.chunk_wait},
                    torch::kFloat64);
  // NOTE [The copies' compute]
  // With expert parallelism the copies of a stage exchange tokens in every
  // MoE layer, so a copy whose experts got fewer tokens, or whose core ran
  // slower for a while, waits inside its chunks for the busier one: no
  // overlap can hide that wait (the lighter copy has nothing left to
  // compute), and it counts as exposed communication in the pairs. On a
  // shared 2-core machine the dense GPT's copies, doing the same work,
  // differ by up to 1.6x (docs/benchmarks.md, "The busiest copy and the
  // predicted share").
  // Each rank's compute over its copies shows how much of a rank's waiting
  // is that spread, and the pairs' hidden and exposed seconds on the copy
  // with the most compute (the one that sets the step) are the
  // communication's own. (Without experts the copies only meet in the
  // gradient reduction, and the spread is noise.)
  if (copies != nullptr) {
    std::vector<torch::Tensor> each(copies->world_size());
    for (auto& t : each)
      t = torch::empty({kPerCopy}, torch::kFloat64);
    copies->all_gather(
        each, torch::tensor({last.compute, last.pair_hidden, last.pair_exposed}, torch::kFloat64));
    mine = torch::cat({mine, torch::cat(each)});
  }
  std::vector<torch::Tensor> all(comm.world_size());
  for (auto& t : all)
    t = torch::empty_like(mine);
  comm.all_gather(all, mine);
  schedule::Timeline timeline =
      pipeline::gather_step_timeline(last, comm, config.schedule + " (measured, last step)");
  if (comm.rank() != 0 || !reporter) return;
  result.timeline = std::move(timeline);
  for (auto& t : all) {
    result.rank_compute.push_back(t[0].item<double>());
    result.rank_comm_wait.push_back(t[1].item<double>());
    result.rank_overhead.push_back(t[2].item<double>());
    result.rank_peak_bytes.push_back(t[3].item<double>());
    result.rank_pair_hidden.push_back(t[4].item<double>());
    result.rank_pair_exposed.push_back(t[5].item<double>());
    result.rank_deferred_w_in_waits.push_back(static_cast<int>(t[6].item<double>()));
    result.rank_deferred_w_at_end.push_back(static_cast<int>(t[7].item<double>()));
    result.rank_pair_exposed_alone.push_back(t[8].item<double>());
    result.rank_chunk_wait.push_back(t[9].item<double>());
    if (t.numel() > kFixed) {
      auto per = t.slice(0, kFixed).reshape({-1, kPerCopy}).t().contiguous();
      auto column = [&](int64_t i) {
        const double* d = per[i].data_ptr<double>();
        return std::vector<double>(d, d + per.size(1));
      };
      result.rank_copies_compute.push_back(column(0));
      result.rank_copies_pair_hidden.push_back(column(1));
      result.rank_copies_pair_exposed.push_back(column(2));
    }
  }
  auto measured = schedule::timeline_stats(result.timeline);
  result.measured_bubble = measured.bubble_rate;
  result.measured_makespan = measured.makespan;
  result.stage_costs = fitted_costs(sched, result.timeline, comm_cost, stage_bytes);
  schedule::SimOptions so;
  so.overlap_pairs = config.fb_overlap;  // NOTE [An overlapped pair in the simulator]
  so.defer_wgrad = config.defer_wgrad;   // NOTE [Deferred W's in the simulator]
  so.deferred_w_parts = config.w_parts;
  so.pair_first_ready = config.pairs_take_ready_turns();
  auto sim = schedule::simulate(sched, result.stage_costs, so);
  result.simulated_bubble = sim.bubble_rate;
  result.simulated_makespan = sim.makespan;
  result.rank_predicted_pair_hidden = sim.rank_pair_hidden;
  result.rank_predicted_pair_exposed = sim.rank_pair_exposed;
  if (!stage_bytes.empty()) predict_rank_memory(sched, stage_bytes, sim, result);
  if (!config.trace.empty()) {
    // The renderers read one time unit as one millisecond.
    schedule::Timeline ms = result.timeline;
    for (auto& e : ms.events)
      e.start *= 1e3, e.end *= 1e3, e.waited *= 1e3;
    write_file_atomically(config.trace, schedule::render_chrome_trace(ms));
    write_file_atomically(config.trace + ".svg", schedule::render_svg(ms));
  }
  if (!config.report.empty()) write_report(config, result, config.report);
}

std::string report_json(const TrainConfig& c, const TrainResult& r) {
  nlohmann::json j;
  j["config"] = {{"model", c.model.kind},
                 {"layers", c.model.layers},
                 {"d_model", c.model.d_model},
                 {"heads", c.model.heads},
                 {"seq_len", c.model.seq_len},
                 {"documents", c.model.documents},
                 {"dtype", c.model.dtype == torch::kFloat64 ? "float64" : "float32"},
                 {"nproc", c.nproc},
                 {"dp", c.dp},
                 {"fsdp", c.fsdp},
                 {"schedule", c.schedule},
                 {"chunks", c.chunks},
                 {"microbatches", c.microbatches},
                 {"microbatch_size", c.microbatch_size},
                 {"steps", c.steps},
                 {"optimizer", c.optimizer},
                 {"lr", c.lr},
                 {"seed", c.seed},
                 {"recompute", c.recompute},
                 {"mode", c.graph ? "graph" : "pipeline"}};
  if (c.model.experts > 0) {
    j["config"]["experts"] = c.model.experts;
    j["config"]["top_k"] = c.model.top_k;
    j["config"]["ep"] = c.ep;
  }
  if (!c.graph) {
    j["config"]["p2p"] = c.p2p;
    j["config"]["fb_overlap"] = c.fb_overlap;
    j["config"]["defer_wgrad"] = c.defer_wgrad;
    j["config"]["w_parts"] = c.w_parts;
    if (c.fb_overlap) j["config"]["pair_turns"] = c.pairs_take_ready_turns() ? "ready" : "fixed";
    if (!c.link.empty()) j["config"]["link"] = c.link;
    const DeferredWInRun& d = r.deferred_w_in_run;
    if (d.decided || (c.fb_overlap && c.defer_wgrad_auto && !c.defer_wgrad)) {
      // NOTE [The deferred W's chosen in the run] in hp/pipeline/pipeline.cpp
      nlohmann::json a = {{"decided", d.decided}};
      if (d.decided) {
        a["after_step"] = d.after_step;
        a["deferred"] = d.choice.defer;
        a["predicted_step_seconds"] = {{"without", d.choice.step_without},
                                       {"with", d.choice.step_with}};
        // In bytes where the stage bytes were measured (the CPU), else in
        // microbatches of activations.
        const char* unit = r.rank_predicted_peak_bytes.empty()
                               ? "predicted_peak_activation_microbatches"
                               : "predicted_peak_activation_bytes";
        a[unit] = {{"without", d.choice.peak_without}, {"with", d.choice.peak_with}};
      }
      j["defer_wgrad_auto"] = a;
    }
    j["p2p_backend"] = r.p2p_backend;  // what rank 0's pipeline group used
    if (!r.p2p_note.empty()) j["p2p_note"] = r.p2p_note;
  }
  if (c.graph) {
    j["config"]["overlap"] = c.overlap;
    j["config"]["shard"] = c.shard;
    j["config"].erase("schedule");
    j["config"].erase("chunks");
    j["compile_seconds"] = r.compile_seconds;
    j["sharded_parameters"] = r.sharded;
  }
  j["first_step"] = r.first_step;
  j["loss"] = r.losses;
  j["step_seconds"] = r.step_seconds;
  double med = median(r.step_seconds);
  j["median_step_seconds"] = med;
  j["items_per_step"] = r.items_per_step;
  j["items_per_second"] = med > 0 ? r.items_per_step / med : 0.0;
  if (!c.graph) {
    j["measured_bubble"] = r.measured_bubble;
    j["simulated_bubble"] = r.simulated_bubble;
    j["measured_makespan_seconds"] = r.measured_makespan;
    j["simulated_makespan_seconds"] = r.simulated_makespan;
    // NOTE [Stage cost file]: what `hp schedule recommend --costs REPORT` reads.
    nlohmann::json stages = nlohmann::json::array();
    const auto& sc = r.stage_costs;
    for (size_t st = 0; st < sc.stage_f.size(); ++st)
      stages.push_back({{"stage", st},
                        {"f", sc.stage_f[st]},
                        {"i", sc.stage_b[st]},
                        {"w", sc.stage_w[st]},
                        {"comm", sc.comm},
                        {"send", st < sc.stage_send.size() ? sc.stage_send[st] : sc.send}});
    // Measured activation bytes (NOTE [Memory measured against predicted]);
    // the cost file takes memory in any one unit.
    if (sc.stage_mem_b.size() == stages.size())
      for (size_t st = 0; st < stages.size(); ++st) {
        stages[st]["mem_b"] = sc.stage_mem_b[st];
        stages[st]["mem_w"] = sc.stage_mem_w.at(st);
      }
    // NOTE [Waits inside a chunk] in hp/schedule/simulate.h
    if (sc.stage_inner.size() == stages.size())
      for (size_t st = 0; st < stages.size(); ++st) {
        const auto& in = sc.stage_inner[st];
        stages[st]["f_waits"] = in.f_waits;
        stages[st]["f_wait"] = in.f;
        stages[st]["i_waits"] = in.i_waits;
        stages[st]["i_wait"] = in.i;
        stages[st]["w_waits"] = in.w_waits;
        stages[st]["w_wait"] = in.w;
        if (!in.f_nodes.empty()) stages[st]["f_nodes"] = in.f_nodes;
        if (!in.i_nodes.empty()) stages[st]["i_nodes"] = in.i_nodes;
        if (!in.w_nodes.empty()) stages[st]["w_nodes"] = in.w_nodes;
      }
    if (!stages.empty()) j["stage_costs"] = {{"unit", "seconds"}, {"stages", stages}};
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t k = 0; k < r.rank_compute.size(); ++k) {
    nlohmann::json one = {
        {"rank", k},
        {"compute_seconds", r.rank_compute[k]},
        {"comm_wait_seconds", r.rank_comm_wait[k]},
        {"chunk_wait_seconds", k < r.rank_chunk_wait.size() ? r.rank_chunk_wait[k] : 0.0},
        {"overhead_seconds", r.rank_overhead[k]}};
    if (k < r.rank_copies_compute.size())  // NOTE [The copies' compute]
      one["copies_compute_seconds"] = r.rank_copies_compute[k];
    if (c.fb_overlap && k < r.rank_pair_hidden.size()) {
      // NOTE [Overlapped pairs] in hp/pipeline/overlap.cpp
      one["pair_hidden_comm_seconds"] = r.rank_pair_hidden[k];
      one["pair_exposed_comm_seconds"] = r.rank_pair_exposed[k];
      one["pair_exposed_alone_comm_seconds"] = r.rank_pair_exposed_alone.at(k);
      if (k < r.rank_predicted_pair_hidden.size()) {  // NOTE [What a pair hides, predicted]
        one["predicted_pair_hidden_comm_seconds"] = r.rank_predicted_pair_hidden[k];
        one["predicted_pair_exposed_comm_seconds"] = r.rank_predicted_pair_exposed[k];
      }
      if (k < r.rank_copies_pair_hidden.size()) {  // NOTE [The copies' compute]
        one["copies_pair_hidden_comm_seconds"] = r.rank_copies_pair_hidden[k];
        one["copies_pair_exposed_comm_seconds"] = r.rank_copies_pair_exposed[k];
      }
    }
    if (c.defer_wgrad && k < r.rank_deferred_w_in_waits.size()) {
      // NOTE [Weight gradients in the waits] in hp/pipeline/overlap.cpp
      one["deferred_w_in_waits"] = r.rank_deferred_w_in_waits[k];
      one["deferred_w_at_end"] = r.rank_deferred_w_at_end[k];
    }
    if (c.graph) {
      // Graph mode: peak bytes a step allocates on top of parameters and state.
      one["peak_step_bytes"] = r.rank_peak_bytes[k];
      one["parameter_bytes"] = r.rank_param_bytes.at(k);
      one["hidden_comm_fraction"] = r.rank_hidden_comm.at(k);
    } else {
      one["peak_activation_bytes"] = r.rank_peak_bytes[k];
      // NOTE [Memory measured against predicted]: both peaks in units of
      // one microbatch's activations on this rank (its stages' mem_b summed).
      if (k < r.rank_microbatch_bytes.size() && r.rank_microbatch_bytes[k] > 0) {
        const double unit = r.rank_microbatch_bytes[k];
        one["microbatch_activation_bytes"] = unit;
        one["predicted_peak_activation_bytes"] = r.rank_predicted_peak_bytes.at(k);
        one["peak_activation_microbatches"] = r.rank_peak_bytes[k] / unit;
        one["predicted_peak_microbatches"] = r.rank_predicted_peak_bytes.at(k) / unit;
        one["predicted_peak_with_transients_bytes"] = r.rank_predicted_peak_transient_bytes.at(k);
        one["predicted_peak_with_transients_microbatches"] =
            r.rank_predicted_peak_transient_bytes.at(k) / unit;
      }
    }
    ranks.push_back(one);
  }
  j["ranks"] = ranks;
  j["parameter_checksum"] = r.checksum;
  return j.dump(2) + "\n";
}

void write_report(const TrainConfig& c, const TrainResult& r, const std::string& path) {
  schedule::write_text_file(path, report_json(c, r));  // NOTE [Output files are whole]
}

namespace {

std::string graph_summary(const TrainConfig& c, const TrainResult& r) {
  char buf[512];
  std::string s;
  double med = median(r.step_seconds);
  std::snprintf(buf, sizeof buf,
                "trained %s (%lld layers, d_model %lld) in graph mode on %d ranks (%s%s): %d "
                "steps x %d microbatches of %lld\n",
                c.model.kind.c_str(), (long long)c.model.layers, (long long)c.model.d_model,
                c.nproc,
                c.nproc == 1 ? "one process"
                : c.shard    ? "FSDP"
                             : "data parallel",
                c.nproc > 1 && c.overlap ? ", overlapped" : "", c.steps, c.microbatches,
                (long long)c.microbatch_size);
  s += buf;
  if (!r.losses.empty()) {
    std::snprintf(buf, sizeof buf, "  loss %.4f -> %.4f\n", r.losses.front(), r.losses.back());
    s += buf;
  }
  std::snprintf(buf, sizeof buf, "  compile %.2f s; median step %.1f ms, %.0f %s/s\n",
                r.compile_seconds, med * 1e3, med > 0 ? r.items_per_step / med : 0.0,
                c.model.kind == "gpt" ? "tokens" : "samples");
  s += buf;
  for (size_t k = 0; k < r.rank_compute.size(); ++k) {
    std::snprintf(buf, sizeof buf,
                  "  rank %zu: operators %.1f ms, waiting %.1f ms (%.0f %% of communication "
                  "hidden), parameters %.2f MiB, step peak %.1f MiB\n",
                  k, r.rank_compute[k] * 1e3, r.rank_comm_wait[k] * 1e3,
                  100 * r.rank_hidden_comm.at(k), r.rank_param_bytes.at(k) / 1048576.0,
                  r.rank_peak_bytes[k] / 1048576.0);
    s += buf;
  }
  std::snprintf(buf, sizeof buf, "  parameter checksum %.12g\n", r.checksum);
  s += buf;
  return s;
}

}  // namespace

std::string deferred_w_line(const DeferredWInRun& d) {
  const schedule::DeferredWChoice& c = d.choice;
  char buf[400];
  if (c.step_with <= 0.0) {
    std::snprintf(buf, sizeof buf,
                  "--defer-wgrad auto: off (ready turns with --recompute take no deferred W's)");
    return buf;
  }
  std::snprintf(buf, sizeof buf,
                "--defer-wgrad auto: %s (under step %d's costs the model's step is %.1f ms with "
                "deferred W's against %.1f ms without, peak activations %.2fx)",
                c.defer ? ("on from step " + std::to_string(d.after_step + 1)).c_str() : "off",
                d.after_step, c.step_with * 1e3, c.step_without * 1e3,
                c.peak_without > 0 ? c.peak_with / c.peak_without : 1.0);
  return buf;
}

std::string summary_text(const TrainConfig& c, const TrainResult& r) {
  if (c.graph) return graph_summary(c, r);
  char buf[512];
  std::string s;
  double med = median(r.step_seconds);
  std::snprintf(buf, sizeof buf,
                "trained %s (%lld layers, d_model %lld) with %s on %d ranks%s: %d steps x %d "
                "microbatches of %lld\n",
                c.model.kind.c_str(), (long long)c.model.layers, (long long)c.model.d_model,
                c.schedule.c_str(), c.nproc,
                c.dp > 1 ? (" x " + std::to_string(c.dp) + " data-parallel copies" +
                            (c.fsdp ? " (FSDP: sharded between steps)" : ""))
                               .c_str()
                         : "",
                c.steps - r.first_step, c.microbatches, (long long)c.microbatch_size);
  s += buf;
  if (!r.losses.empty()) {
    std::snprintf(buf, sizeof buf, "  loss %.4f -> %.4f\n", r.losses.front(), r.losses.back());
    s += buf;
  }
  std::snprintf(buf, sizeof buf,
                "  median step %.1f ms, %.0f %s/s; bubble measured %.1f %%, simulated %.1f %%\n",
                med * 1e3, med > 0 ? r.items_per_step / med : 0.0,
                c.model.kind == "gpt" ? "tokens" : "samples", 100 * r.measured_bubble,
                100 * r.simulated_bubble);
  s += buf;
  for (size_t k = 0; k < r.rank_compute.size(); ++k) {
    std::snprintf(buf, sizeof buf, "  rank %zu: compute %.1f ms", k, r.rank_compute[k] * 1e3);
    s += buf;
    if (k < r.rank_copies_compute.size() && c.ep > 1) {  // NOTE [The copies' compute]
      const auto [lo, hi] =
          std::minmax_element(r.rank_copies_compute[k].begin(), r.rank_copies_compute[k].end());
      std::snprintf(buf, sizeof buf, " (its expert-parallel copies %.1f-%.1f ms)", *lo * 1e3,
                    *hi * 1e3);
      s += buf;
    }
    std::snprintf(buf, sizeof buf, ", waiting %.1f ms", r.rank_comm_wait[k] * 1e3);
    s += buf;
    if (k < r.rank_chunk_wait.size() && r.rank_chunk_wait[k] > 0) {
      // Expert all-to-alls: NOTE [A chunk's own waits] in hp/pipeline/step_timer.h
      std::snprintf(buf, sizeof buf, " (and %.1f ms inside chunks)", r.rank_chunk_wait[k] * 1e3);
      s += buf;
    }
    std::snprintf(buf, sizeof buf, ", executor overhead %.2f ms, peak activations %.1f MiB",
                  r.rank_overhead[k] * 1e3, r.rank_peak_bytes[k] / 1048576.0);
    s += buf;
    if (k < r.rank_microbatch_bytes.size() && r.rank_microbatch_bytes[k] > 0) {
      const double unit = r.rank_microbatch_bytes[k];
      std::snprintf(buf, sizeof buf, " (%.2f microbatches; predicted %.2f, %.2f with transients)",
                    r.rank_peak_bytes[k] / unit, r.rank_predicted_peak_bytes.at(k) / unit,
                    r.rank_predicted_peak_transient_bytes.at(k) / unit);
      s += buf;
    }
    s += "\n";
  }
  std::snprintf(buf, sizeof buf, "  parameter checksum %.12g\n", r.checksum);
  s += buf;
  return s;
}

}  // namespace hp::train
