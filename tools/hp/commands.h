// The `hp` command line tool's subcommands: each file cmd_*.cpp adds one
// subcommand (with its options and its callback) to the root CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace hp::cli {

/// `hp schedule ...`: generate, validate, simulate, draw and compare schedules.
void add_schedule_command(CLI::App& app);

#ifdef HP_HAVE_TORCH
/// `hp demo ...`: short demonstrations of the library (the dx/dw split).
void add_demo_command(CLI::App& app);
#endif

}  // namespace hp::cli
