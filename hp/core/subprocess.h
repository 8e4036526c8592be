// Running a shell command and keeping what it printed (benchmarks that time
// whole `hp` runs side by side).
#pragma once

#include <string>

namespace hp {

/// Runs `command` with /bin/sh, stderr merged into stdout; returns the output
/// and sets `*exit_code` (128 + signal when the command was killed). Throws
/// std::runtime_error when the command cannot be started.
std::string run_and_capture(const std::string& command, int* exit_code);

}  // namespace hp
