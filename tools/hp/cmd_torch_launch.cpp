// `hp launch -n N [--timeout S] [--grace S] [--pin] [--port P] -- CMD ARGS...`:
// runs N ranks of CMD on this machine with torchrun's variables
// (hp/launch/launcher.h) and exits non-zero with a per-rank summary when any
// rank failed. Every option is checked before a rank starts.
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>

#include "hp/launch/launcher.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct LaunchArgs {
  int nproc = 2;
  double timeout_s = 60;
  double grace_s = 2;
  double run_timeout_s = 0;
  bool pin = false;
  int port = 0;
  std::string output_dir;
  std::vector<std::string> command;
};

// Seconds as a duration, refused when not finite or outside [min, a week].
std::chrono::milliseconds seconds_option(const char* name, double s, double min) {
  constexpr double kWeek = 7 * 24 * 3600.0;
  if (!std::isfinite(s) || s < min || s > kWeek)
    throw std::invalid_argument(std::string(name) + " " + std::to_string(s) +
                                " is out of range: give seconds from " + std::to_string(min) +
                                " to " + std::to_string(kWeek) + " (a week)");
  return std::chrono::milliseconds(int64_t(s * 1000));
}

void run_launch(const LaunchArgs& a) {
  launch::LaunchOptions o;
  o.nproc = a.nproc;
  o.command = a.command;
  const auto timeout = seconds_option("--timeout", a.timeout_s, 0.001);
  o.timeout = seconds_option("--grace", a.grace_s, 0);
  o.run_timeout = seconds_option("--run-timeout", a.run_timeout_s, 0);
  o.pin_cores = a.pin;
  if (a.port < 0 || a.port > 65535)
    throw std::invalid_argument("--port " + std::to_string(a.port) +
                                " is not a TCP port (1..65535, or 0 for a free one)");
  o.master_port = a.port;
  if (!a.output_dir.empty() && !std::filesystem::is_directory(a.output_dir))
    throw std::invalid_argument(
        "--logs '" + a.output_dir +
        "' is not a folder; create it first (rank r writes rank_r.log there)");
  o.output_dir = a.output_dir;
  // The ranks' Comm timeout.
  o.env.push_back({"HP_DIST_TIMEOUT_MS", std::to_string(timeout.count())});
  launch::LaunchResult r;
  try {
    r = launch::launch_local(o);
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
  if (r.ok()) return;
  std::fprintf(stderr, "hp launch: %s\n%s",
               r.interrupted_by ? "interrupted"
               : r.run_timed_out
                   ? "run timeout expired"
                   : ("rank " + std::to_string(r.first_failed_rank) + " failed (" +
                      r.ranks[r.first_failed_rank].describe() + "); the other ranks were stopped")
                         .c_str(),
               r.summary().c_str());
  std::fflush(stderr);
  std::exit(r.exit_code() == 0 ? 1 : r.exit_code());
}

}  // namespace

void add_launch_command(CLI::App& app) {
  auto a = std::make_shared<LaunchArgs>();
  auto* cmd = app.add_subcommand(
      "launch",
      "run N ranks of a command on this machine (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
      "MASTER_PORT set); the ranks die with it");
  cmd->add_option("-n,--nproc", a->nproc, "number of ranks")->check(CLI::Range(1, 4096));
  cmd->add_option("--timeout", a->timeout_s,
                  "seconds: each rank's communication timeout (HP_DIST_TIMEOUT_MS)")
      ->capture_default_str();
  cmd->add_option("--grace", a->grace_s,
                  "seconds the other ranks get to end by themselves after a rank fails, before "
                  "they are terminated")
      ->capture_default_str();
  cmd->add_option("--run-timeout", a->run_timeout_s, "seconds for the whole run (0 = none)");
  cmd->add_flag("--pin", a->pin, "pin rank r to core r % ncores with one intra-op thread");
  cmd->add_option("--port", a->port, "MASTER_PORT (0 = a free port; a port in use is an error)");
  cmd->add_option("--logs", a->output_dir, "write rank r's output to DIR/rank_r.log");
  cmd->add_option("command", a->command, "the command and its arguments (after --)")->required();
  cmd->callback([a] { run_launch(*a); });
}

HP_CLI_COMMAND(add_launch_command);

}  // namespace hp::cli
