// What the parts of `hp schedule` share: cmd_schedule.cpp (list, show,
// compare; the subcommand itself), cmd_schedule_recommend.cpp (recommend and
// its alias tune) and cmd_schedule_tables.cpp (paper-table, memory-table).
#pragma once

#include <CLI/CLI.hpp>

#include <initializer_list>
#include <string>
#include <utility>

namespace hp::cli::schedule_cli {

/// A --mem-limit value: "" (0: the generator's default), a number, or a
/// multiple of `unit` (p * mem_b) written like 2x.
double parse_mem_limit(const std::string& text, double unit);

/// The line printed when a search's work bound cut it short (NOTE [Budget of
/// the memory search]): the result is valid, the search did not see everything.
std::string cut_line(const std::string& note);

/// Writes a whole output file (NOTE [Output files are whole]).
void write_file(const std::string& path, const std::string& text);

/// Every output option refused before any work when its path cannot be
/// written (NOTE [Output files are whole]); empty ones are not given.
void check_outputs(std::initializer_list<std::pair<const char*, const std::string*>> outputs);

std::string pct(double v);   ///< 0.1234 -> "12.34%"
std::string num(double v);   ///< %.4g
std::string rate(double v);  ///< %.4f

/// `hp schedule recommend` and its alias `tune`, added to `hp schedule`.
void add_recommend_commands(CLI::App* sched);

/// `hp schedule memory-table` and `paper-table`, added to `hp schedule`.
void add_table_commands(CLI::App* sched);

}  // namespace hp::cli::schedule_cli
