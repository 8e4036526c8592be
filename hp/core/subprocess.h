// Processes: running a shell command and keeping what it printed (benchmarks
// that time whole `hp` runs side by side), and reading another process's
// state (a stopped or dead peer rank).
#pragma once

#include <string>

namespace hp {

/// Runs `command` with /bin/sh, stderr merged into stdout; returns the output
/// and sets `*exit_code` (128 + signal when the command was killed). Throws
/// std::runtime_error when the command cannot be started.
std::string run_and_capture(const std::string& command, int* exit_code);

/// The state letter of process `pid` in /proc/<pid>/stat ('R', 'S', 'T'
/// stopped, 't' stopped by a tracer, 'Z' zombie, ...); 0 when it cannot be
/// read (no such process, or no /proc).
char process_state(int pid);

/// Whether process `pid` is stopped: state 'T' or 't'.
inline bool process_stopped(int pid) {
  const char s = process_state(pid);
  return s == 'T' || s == 't';
}

}  // namespace hp
