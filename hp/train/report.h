// The JSON report of a training run (`hp train --report FILE`).
#pragma once

#include <string>

#include "hp/train/config.h"

namespace hp::train {

/// The report as JSON text: config, per-step loss and time, throughput,
/// measured and simulated bubble, per-rank compute/wait/overhead/peak memory,
/// parameter checksum.
std::string report_json(const TrainConfig& config, const TrainResult& result);
/// Writes report_json atomically (temporary file, then rename).
void write_report(const TrainConfig& config, const TrainResult& result, const std::string& path);
/// A few lines for the terminal at the end of a run.
std::string summary_text(const TrainConfig& config, const TrainResult& result);

}  // namespace hp::train
