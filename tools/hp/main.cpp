// Entry point of the `hp` command line tool: builds the CLI11 app from the
// subcommands in commands.h and turns library errors into a clean exit code.
#include <exception>
#include <iostream>

#include "tools/hp/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"hyperparallel: pipeline parallelism at close to zero bubble", "hp"};
  app.require_subcommand(1);
  hp::cli::add_schedule_command(app);
#ifdef HP_HAVE_TORCH
  hp::cli::add_demo_command(app);
#endif
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
