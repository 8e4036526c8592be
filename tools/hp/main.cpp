// Entry point of the `hp` command line tool: builds the CLI11 app from the
// registered subcommands and turns library errors, and a standard output that
// could not be written, into a clean exit code.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
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

namespace {

// NOTE [Standard output is checked]
// `hp schedule show ... > /dev/full` printed into a full device and exited 0:
// std::cout and printf buffer their output and report a failed write only in
// the stream's error state, which nobody read. As coreutils do, main flushes
// standard output at the end and checks both the flush and every earlier
// write (the stream's error flag); a failure is "hp: error: ..." on stderr
// and exit status 1, whatever the command did. (A reader that closed its pipe
// ends the process with SIGPIPE first, as for coreutils: not exit 0 either.)
bool stdout_written() {
  std::cout.flush();
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout) && std::cout.good()) return true;
  std::cerr << "hp: error: cannot write the standard output: "
            << (err ? std::strerror(err) : "a write failed")
            << "; the output is incomplete (a full device or a closed pipe?)\n";
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hyperparallel: pipeline parallelism at close to zero bubble", "hp"};
  app.require_subcommand(1);
  hp::cli::command_line().assign(argv, argv + argc);
  for (const auto& add : hp::cli::command_adders())
    add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return stdout_written() ? code : 1;
  } catch (const std::exception& e) {
    // LibTorch's errors append a C++ backtrace that says nothing to a user.
    std::string msg = e.what();
    auto cut = msg.find("\nException raised from");
    if (cut != std::string::npos) msg.resize(cut);
    std::cerr << "hp: error: " << msg << "\n";
    stdout_written();
    return 1;
  }
  return stdout_written() ? 0 : 1;
}
