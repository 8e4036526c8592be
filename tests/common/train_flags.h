// The `hp train` command line of a TrainConfig: the subset of flags the
// end-to-end and fault tests vary (float64, untied head, no progress line).
#pragma once

#include <sstream>
#include <string>

#include "hp/train/trainer.h"

namespace hp::testing {

inline std::string train_flags(const hp::train::TrainConfig& c) {
  std::ostringstream os;
  os << "train --no-progress --model " << c.model.kind << " --layers " << c.model.layers
     << " --d-model " << c.model.d_model << " --heads " << c.model.heads << " --seq-len "
     << c.model.seq_len << " --dtype float64 --untied -p " << c.nproc;
  if (!c.graph) os << " -s " << c.schedule;  // graph mode takes no schedule
  os << " -m " << c.microbatches << " --microbatch-size " << c.microbatch_size << " --steps "
     << c.steps << " --lr " << c.lr << " --seed " << c.seed << " --timeout " << c.timeout_s;
  return os.str();
}

}  // namespace hp::testing
