// The `hp` command line tool's subcommands. Each file cmd_*.cpp in this
// folder adds one subcommand by defining a static HP_CLI_COMMAND registrar, so
// a new subcommand is a new file and nothing else.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace hp::cli {

/// Adds one subcommand (its options and callback) to the root app.
using CommandAdder = std::function<void(CLI::App&)>;

/// The command line `hp` was started with (argv[0] first).
std::vector<std::string>& command_line();

/// The path of the running `hp` executable (to start ranks of it).
std::string self_executable();

/// Every registered subcommand adder, in registration order.
std::vector<CommandAdder>& command_adders();

/// Registers an adder at static-initialisation time (see HP_CLI_COMMAND).
struct CommandRegistrar {
  explicit CommandRegistrar(CommandAdder adder) { command_adders().push_back(std::move(adder)); }
};

}  // namespace hp::cli

/// Registers `void fn(CLI::App&)` as a subcommand adder of `hp`.
#define HP_CLI_COMMAND(fn) static ::hp::cli::CommandRegistrar hp_cli_registrar_##fn(fn)
