// hp/schedule/cost_file.h: per-stage costs as JSON (the input of `hp schedule
// tune --costs`), read strictly into a CostModel, and the bounded file reader
// the schedule CLI uses for every input file.
#pragma once

#include <cstddef>
#include <string>

#include "hp/schedule/simulate.h"

namespace hp::schedule {

// NOTE [Stage cost file]
// One object per pipeline stage, in stage order:
//
//   {"stages": [{"f": 1.2, "i": 1.1, "w": 0.6, "comm": 0.05, "send": 0.01,
//                "mem_b": 1.0, "mem_w": 0.4}, ...]}
//
// f, i and w (the forward, input-gradient and weight-gradient times of one
// microbatch on that stage, in any one time unit) are required and positive;
// "b" is accepted for "i" (the Zero Bubble paper's name). comm is the latency
// of a transfer between this stage and the next (the last stage's is
// ignored; default 0); send is the time the stage's rank stays busy posting
// one output to another rank (NOTE [Sending occupies the sender] in
// simulate.h; default 0); mem_b is the activation memory one microbatch holds
// from F until I, mem_w from I until W (defaults 1 and 0.5, any one unit).
// The same object may sit under the key "stage_costs" of a larger JSON
// document (a training report). Unknown keys, duplicate keys, missing or
// non-numeric values are errors that name the stage and the key.

/// Parses a stage cost file (NOTE [Stage cost file]); `source` names it in
/// errors (std::invalid_argument). The result has one per-stage entry per
/// stage in stage_f, stage_b, stage_w, stage_comm, stage_send, stage_mem_b
/// and stage_mem_w, and f, b, w, comm, send, mem_b, mem_w set to the stage
/// maxima.
CostModel parse_stage_costs(const std::string& json_text, const std::string& source);
/// Largest cost file text parse_stage_costs reads (checked before parsing).
constexpr std::size_t kMaxCostFileBytes = std::size_t{1} << 20;
/// Largest cost (or memory) of one stage it accepts.
constexpr double kMaxCost = 1e12;

/// Reads a whole regular file of at most `max_bytes` bytes (kMaxInputBytes,
/// schedule.h, by default). Throws
/// std::invalid_argument naming the path when it is missing, not a regular
/// file (a directory, a character device such as /dev/zero, a pipe) or
/// larger than the bound.
std::string read_input_file(const std::string& path, std::size_t max_bytes = kMaxInputBytes);

}  // namespace hp::schedule
