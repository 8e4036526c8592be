// Entry point of the `hp` command line tool: builds the CLI11 app from the
// registered subcommands and turns library errors into a clean exit code.
#include <exception>
#include <iostream>

#include "tools/hp/commands.h"

namespace hp::cli {
std::vector<CommandAdder>& command_adders() {
  static std::vector<CommandAdder> adders;
  return adders;
}
}  // namespace hp::cli

int main(int argc, char** argv) {
  CLI::App app{"hyperparallel: pipeline parallelism at close to zero bubble", "hp"};
  app.require_subcommand(1);
  for (const auto& add : hp::cli::command_adders()) add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "hp: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
