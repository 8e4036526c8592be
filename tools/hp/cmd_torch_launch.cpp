// `hp launch -n N [--timeout S] [--pin] [--port P] -- CMD ARGS...`: runs N
// ranks of CMD on this machine with torchrun's variables (hp/launch/launcher.h)
// and exits non-zero with a per-rank summary when any rank failed.
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "hp/launch/launcher.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct LaunchArgs {
  int nproc = 2;
  double timeout_s = 60;
  double run_timeout_s = 0;
  bool pin = false;
  int port = 0;
  std::string output_dir;
  std::vector<std::string> command;
};

void run_launch(const LaunchArgs& a) {
  launch::LaunchOptions o;
  o.nproc = a.nproc;
  o.command = a.command;
  o.timeout = std::chrono::milliseconds(int64_t(a.timeout_s * 1000));
  o.run_timeout = std::chrono::milliseconds(int64_t(a.run_timeout_s * 1000));
  o.pin_cores = a.pin;
  o.master_port = a.port;
  o.output_dir = a.output_dir;
  // The ranks' Comm uses the same timeout as the launcher's grace period.
  o.env.push_back({"HP_DIST_TIMEOUT_MS", std::to_string(int64_t(a.timeout_s * 1000))});
  launch::LaunchResult r;
  try {
    r = launch::launch_local(o);
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
  if (r.ok()) return;
  std::fprintf(stderr, "hp launch: %s\n%s",
               r.interrupted_by  ? "interrupted"
               : r.run_timed_out ? "run timeout expired"
                                 : ("rank " + std::to_string(r.first_failed_rank) + " failed (" +
                                    r.ranks[r.first_failed_rank].describe() + ")")
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
      "MASTER_PORT set)");
  cmd->add_option("-n,--nproc", a->nproc, "number of ranks")->check(CLI::Range(1, 4096));
  cmd->add_option("--timeout", a->timeout_s,
                  "seconds: each rank's communication timeout (HP_DIST_TIMEOUT_MS), and how "
                  "long the others get after a rank fails before they are terminated")
      ->capture_default_str();
  cmd->add_option("--run-timeout", a->run_timeout_s, "seconds for the whole run (0 = none)");
  cmd->add_flag("--pin", a->pin, "pin rank r to core r % ncores with one intra-op thread");
  cmd->add_option("--port", a->port, "MASTER_PORT (0 = a free port)");
  cmd->add_option("--logs", a->output_dir, "write rank r's output to DIR/rank_r.log");
  cmd->add_option("command", a->command, "the command and its arguments (after --)")->required();
  cmd->callback([a] { run_launch(*a); });
}

HP_CLI_COMMAND(add_launch_command);

}  // namespace hp::cli
