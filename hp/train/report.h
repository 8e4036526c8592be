// The report of a training run: every rank's measurements gathered on rank
// 0, the simulation fitted to them, the JSON report (`hp train --report
// FILE`), the trace and the terminal summary.
#pragma once

#include <string>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/executor.h"
#include "hp/schedule/schedule.h"
#include "hp/train/config.h"

namespace hp::train {

/// The tail of a run, collective over the pipeline's group `comm`: every
/// rank's measurements of the last step (`last`, the run's peak activation
/// bytes) gathered on its rank 0; there, when `reporter` (copy 0's), the
/// per-rank figures, the measured timeline, the stage costs fitted to it
/// (`comm_cost`: one transfer's seconds), the simulation under them and the
/// memory prediction (`stage_bytes`, stage_memory.h) go into `result`, and
/// --trace and --report are written. `copies` (the data-parallel copies'
/// group, null without --dp) also gathers each rank's compute over its
/// copies, collective over it too (NOTE [The copies' compute]).
void gather_and_report(const TrainConfig& config, const schedule::Schedule& sched,
                       const pipeline::StepStats& last, double peak_bytes,
                       const std::vector<double>& stage_bytes, double comm_cost,
                       distributed::Comm& comm, distributed::Comm* copies, bool reporter,
                       TrainResult& result);
/// One line on what `--defer-wgrad auto` chose, and why.
std::string deferred_w_line(const DeferredWInRun& d);
/// The report as JSON text: config, per-step loss and time, throughput,
/// measured and simulated bubble, per-rank compute/wait/overhead/peak memory,
/// parameter checksum.
std::string report_json(const TrainConfig& config, const TrainResult& result);
/// Writes report_json atomically (temporary file, then rename).
void write_report(const TrainConfig& config, const TrainResult& result, const std::string& path);
/// A few lines for the terminal at the end of a run.
std::string summary_text(const TrainConfig& config, const TrainResult& result);

}  // namespace hp::train
