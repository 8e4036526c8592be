// Entry point of the `hp` command line tool: builds the CLI11 app from the
// registered subcommands and turns library errors into a clean exit code.
#include <unistd.h>

#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

#include "tools/hp/commands.h"

namespace hp::cli {
std::vector<CommandAdder>& command_adders() {
  static std::vector<CommandAdder> adders;
  return adders;
}
std::string self_executable() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot find the hp executable (/proc/self/exe)");
  buf[n] = 0;
  return buf;
}

std::vector<std::string>& command_line() {
  static std::vector<std::string> args;
  return args;
}
}  // namespace hp::cli

int main(int argc, char** argv) {
  CLI::App app{"hyperparallel: pipeline parallelism at close to zero bubble", "hp"};
  app.require_subcommand(1);
  hp::cli::command_line().assign(argv, argv + argc);
  for (const auto& add : hp::cli::command_adders())
    add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    // LibTorch's errors append a C++ backtrace that says nothing to a user.
    std::string msg = e.what();
    auto cut = msg.find("\nException raised from");
    if (cut != std::string::npos) msg.resize(cut);
    std::cerr << "hp: error: " << msg << "\n";
    return 1;
  }
  return 0;
}
