// The `hp` command line from tests: the `hp train` flags of a TrainConfig
// (the subset the end-to-end and fault tests vary: float64, untied head, no
// progress line) and one run of the binary with its output and exit code.
// The including target defines HP_BIN (the hp binary's path).
#pragma once

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <stdexcept>
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

struct HpRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
  double seconds = 0;
};

/// Runs `env HP_BIN args` through the shell and waits for it.
inline HpRun run_hp(const std::string& args, const std::string& env = "") {
  const std::string cmd = env + " " + HP_BIN + " " + args + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  HpRun r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run " + cmd);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0)
    r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace hp::testing
