// The local launcher: starts N ranks of a command as real processes with
// torchrun's variables set, waits for them, reports which rank failed and why,
// stops every rank soon after one fails, and never hangs or leaves orphans.
// Also the per-rank core pinning a launched rank applies and the fault points
// the failure tests use.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace hp::launch {

/// What `launch_local` starts and how long it waits.
struct LaunchOptions {
  /// Number of ranks (processes).
  int nproc = 2;
  /// The command each rank runs (argv[0] is looked up in PATH).
  std::vector<std::string> command;
  /// After the first rank fails, how long the others get to exit on their own
  /// before they are terminated (NOTE [Failing fast]). A Comm notices a lost
  /// peer within a second; a rank still starting up or waiting to connect
  /// never does, so this is short, not the communication timeout.
  std::chrono::milliseconds timeout{std::chrono::seconds(2)};
  /// Whole-run limit; 0 = none. Past it every rank is terminated.
  std::chrono::milliseconds run_timeout{0};
  /// Between SIGTERM and SIGKILL when terminating.
  std::chrono::milliseconds kill_grace{std::chrono::seconds(3)};
  /// Sets HP_PIN_CORES=1 so each rank's `apply_rank_pinning()` pins it.
  bool pin_cores = false;
  /// MASTER_PORT for the ranks; 0 picks a free port. A given port that is
  /// already in use is an error before any rank starts.
  int master_port = 0;
  /// Extra environment for every rank ("NAME", "value"), applied last.
  std::vector<std::pair<std::string, std::string>> env;
  /// If set, rank r's stdout and stderr go to "<output_dir>/rank_<r>.log"
  /// (the folder must exist); otherwise the ranks inherit ours.
  std::string output_dir;
};

/// How one rank ended.
struct RankStatus {
  enum class State {
    Exited,      ///< exited by itself with `exit_code`
    Signaled,    ///< died by `signal` that the launcher did not send
    Terminated,  ///< the launcher terminated it (after a failure, a timeout or SIGINT)
  };
  int rank = 0;
  int pid = 0;
  State state = State::Exited;
  int exit_code = 0;
  int signal = 0;
  /// Seconds from launch to its end.
  double seconds = 0;
  /// True for an exit code of 0.
  bool ok() const { return state == State::Exited && exit_code == 0; }
  /// "exit 0", "exit 3", "killed by SIGKILL", "terminated by the launcher (SIGTERM)".
  std::string describe() const;
};

/// The outcome of `launch_local`.
struct LaunchResult {
  std::vector<RankStatus> ranks;
  /// The first rank to fail (by time), or -1.
  int first_failed_rank = -1;
  /// SIGINT/SIGTERM received by the launcher and forwarded (0 if none).
  int interrupted_by = 0;
  /// True when the run_timeout expired.
  bool run_timed_out = false;
  int master_port = 0;
  bool ok() const;
  /// A shell-style exit code: 0, the first failed rank's exit code, or 128+signal.
  int exit_code() const;
  /// One line per rank, the first failure marked.
  std::string summary() const;
};

// NOTE [Failing fast]
// A run ends as soon as it cannot succeed, and no rank outlives it:
// * a rank that fails (non-zero exit, a signal) gives the others `timeout`
//   (2 s by default) to fail by themselves, naming the lost peer; then they
//   get SIGTERM, and SIGKILL `kill_grace` later. A rank that died before the
//   ranks connected, or a rank 0 that could not host the rendezvous because
//   its port was taken, thus stops the run within seconds instead of leaving
//   the others waiting for the communication timeout;
// * a `master_port` that is already in use is refused before any rank starts;
// * every rank dies with the launcher: between fork and exec the child asks
//   the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG, which
//   survives exec), then checks that its parent is still the launcher (it
//   may have died before the request), so `kill -9` of `hp launch` or
//   `hp train` leaves no rank running under init. This covers the processes
//   the launcher starts, not processes those start themselves (a rank that is
//   a shell script should `exec` its program).

/// Starts `nproc` processes of `command` with RANK, WORLD_SIZE, LOCAL_RANK,
/// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set (and, for more
/// than one rank, OMP_NUM_THREADS=1 unless it is set), waits for all
/// of them, and returns how each ended. When a rank fails the others get
/// `timeout` to end by themselves, then SIGTERM, then SIGKILL (NOTE [Failing
/// fast]). SIGINT and SIGTERM sent to the launcher are forwarded to the ranks.
/// Each rank runs in its own process group, which is what gets signalled, and
/// dies with the launcher. Throws if a process cannot be started or
/// `master_port` is taken.
LaunchResult launch_local(const LaunchOptions& options);

/// True when nothing listens on 127.0.0.1:`port` (a socket could bind it).
bool port_is_free(int port);

/// A free TCP port on 127.0.0.1 (bound, read, released).
int pick_free_port();

/// In a rank started with pinning (HP_PIN_CORES=1): pins this process to the
/// (LOCAL_RANK % n)-th of the n cores it may run on, and sets one intra-op
/// thread. Returns the core, or -1 when pinning is not asked for.
int apply_rank_pinning();

/// "SIGKILL" for SIGKILL, "signal 42" for an unnamed one.
std::string signal_name(int sig);

// NOTE [Fault injection]
// HP_FAULT_KILL makes a rank kill itself (SIGKILL) at a named point, so the
// failure tests can put a death exactly where they need it. The value is a
// comma-separated list of RANK:POINT, where POINT is
//   STEP        when the rank starts that training step (0-based);
//   connect     before the rank connects to the others;
//   save:STEP   half-way through writing its file of checkpoint step-STEP.
// The rank is the RANK variable of the process. HP_FAULT_STOP, in the same
// form, makes the rank stop itself (SIGSTOP) instead: a frozen peer.

/// Kills this process with SIGKILL when HP_FAULT_KILL names this rank and
/// `point` ("connect", "3", "save:4"), stops it (SIGSTOP) when HP_FAULT_STOP
/// does; does nothing otherwise.
void fault_point(const std::string& point);

}  // namespace hp::launch
