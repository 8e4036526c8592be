// launch_local: fork/exec of N ranks (each dies with the launcher), the wait
// loop that reports, grants a short grace period after a failure and
// terminates; signal forwarding; pinning; fault points.
#include "hp/launch/launcher.h"

#include "hp/core/subprocess.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <sstream>

extern char** environ;

namespace hp::launch {
namespace {

using Clock = std::chrono::steady_clock;
// NOTE [The first failure of a sweep]: how soon after an exit with an error
// a rank killed by a signal is still taken for its cause, in seconds.
constexpr double kCauseWindow = 1.0;

volatile sig_atomic_t g_pending_signal = 0;

void on_signal(int sig) {
  g_pending_signal = sig;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One poll step of the wait loop: waitpid(WNOHANG) has no timed form, so the
// loop checks every few milliseconds (cheap next to process start-up).
void short_nap() {
  timespec ts{0, 5 * 1000 * 1000};
  nanosleep(&ts, nullptr);
}

}  // namespace

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    case SIGXCPU:
      return "SIGXCPU";
    case SIGSYS:
      return "SIGSYS";
    default:
      return "signal " + std::to_string(sig);
  }
}

std::string RankStatus::describe() const {
  switch (state) {
    case State::Exited:
      return "exit " + std::to_string(exit_code);
    case State::Signaled:
      return "killed by " + signal_name(signal);
    case State::Terminated:
      return "terminated by the launcher (" + signal_name(signal) + ")";
  }
  return "?";
}

bool LaunchResult::ok() const {
  for (const auto& r : ranks)
    if (!r.ok()) return false;
  return !ranks.empty() && interrupted_by == 0 && !run_timed_out;
}

int LaunchResult::exit_code() const {
  if (interrupted_by != 0) return 128 + interrupted_by;
  if (first_failed_rank >= 0) {
    const auto& r = ranks[first_failed_rank];
    if (r.state == RankStatus::State::Exited) return r.exit_code;
    return 128 + r.signal;
  }
  return ok() ? 0 : 1;
}

std::string LaunchResult::summary() const {
  std::ostringstream os;
  if (interrupted_by != 0)
    os << "interrupted by " << signal_name(interrupted_by) << " (forwarded to the ranks)\n";
  if (run_timed_out) os << "the run timeout expired; the ranks were terminated\n";
  for (const auto& r : ranks) {
    os << "  rank " << r.rank << " (pid " << r.pid << "): " << r.describe() << " after "
       << std::fixed;
    os.precision(1);
    os << r.seconds << " s";
    if (r.rank == first_failed_rank) os << "   <- first failure";
    os << "\n";
  }
  return os.str();
}

bool port_is_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "port_is_free: socket: ", std::strerror(errno));
  // As a listener would: SO_REUSEADDR ignores connections in TIME_WAIT, so
  // only a socket bound to the port makes it taken.
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

void fault_point(const std::string& point) {
  const char* rank = std::getenv("RANK");
  if (rank == nullptr) return;
  for (auto [name, sig] :
       {std::pair{"HP_FAULT_KILL", SIGKILL}, std::pair{"HP_FAULT_STOP", SIGSTOP}}) {
    const char* env = std::getenv(name);
    if (env == nullptr) continue;
    std::stringstream list(env);
    std::string item;
    while (std::getline(list, item, ',')) {
      auto colon = item.find(':');
      if (colon == std::string::npos) continue;
      if (item.substr(0, colon) == rank && item.substr(colon + 1) == point) ::raise(sig);
    }
  }
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "pick_free_port: socket: ", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
            getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  int err = errno;
  close(fd);
  TORCH_CHECK(ok, "pick_free_port: ", std::strerror(err));
  return ntohs(a.sin_port);
}

int apply_rank_pinning() {
  const char* pin = std::getenv("HP_PIN_CORES");
  if (pin == nullptr || std::string(pin) != "1") return -1;
  const char* lr = std::getenv("LOCAL_RANK");
  int local_rank = lr ? std::atoi(lr) : 0;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  TORCH_CHECK(sched_getaffinity(0, sizeof(allowed), &allowed) == 0,
              "apply_rank_pinning: sched_getaffinity: ", std::strerror(errno));
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  TORCH_CHECK(!cores.empty(), "apply_rank_pinning: no CPU is allowed");
  int core = cores[local_rank % int(cores.size())];
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(core, &one);
  TORCH_CHECK(sched_setaffinity(0, sizeof(one), &one) == 0, "apply_rank_pinning: pinning to core ",
              core, ": ", std::strerror(errno));
  at::set_num_threads(1);
  return core;
}

LaunchResult launch_local(const LaunchOptions& o) {
  TORCH_CHECK(o.nproc >= 1, "launch: nproc must be >= 1, got ", o.nproc);
  TORCH_CHECK(!o.command.empty(), "launch: no command to run (hp launch -n N -- CMD ARGS...)");
  TORCH_CHECK(o.master_port >= 0 && o.master_port <= 65535, "launch: port ", o.master_port,
              " is not a TCP port (1..65535, or 0 for a free one)");
  TORCH_CHECK(o.master_port == 0 || port_is_free(o.master_port), "launch: port ", o.master_port,
              " on 127.0.0.1 is in use (another program listens there), so rank 0 could not host "
              "the rendezvous; pick another port, or 0 for a free one");
  LaunchResult result;
  result.master_port = o.master_port != 0 ? o.master_port : pick_free_port();
  const pid_t launcher_pid = getpid();

  // Everything the children need is built before fork (only async-signal-safe
  // calls happen between fork and exec).
  std::vector<std::string> base_env;
  auto overridden = [&](const std::string& entry) {
    static const char* ours[] = {
        "RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",  "LOCAL_WORLD_SIZE=",
        "MASTER_ADDR=", "MASTER_PORT=", "HP_PIN_CORES="};
    for (const char* p : ours)
      if (entry.rfind(p, 0) == 0) return true;
    for (const auto& kv : o.env)
      if (entry.rfind(kv.first + "=", 0) == 0) return true;
    return false;
  };
  for (char** e = environ; *e != nullptr; ++e)
    if (!overridden(*e)) base_env.push_back(*e);
  std::vector<char*> argv;
  for (const auto& a : o.command)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{}, old_hup{};
  g_pending_signal = 0;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGHUP, &sa, &old_hup);  // a closed terminal ends the ranks too

  auto t0 = Clock::now();
  std::vector<bool> running(o.nproc, false);
  auto signal_all = [&](int sig) {
    for (int r = 0; r < int(result.ranks.size()); ++r)
      if (running[r]) kill(-result.ranks[r].pid, sig);
  };

  for (int r = 0; r < o.nproc; ++r) {
    std::vector<std::string> env = base_env;
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(o.nproc));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o.nproc));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(result.master_port));
    if (o.pin_cores) env.push_back("HP_PIN_CORES=1");
    // NOTE [One intra-op thread per rank by default]
    // As torchrun does: N ranks on one machine, each with one OpenMP thread
    // per core, oversubscribe the cores, and the wheel's OpenMP threads spin
    // while they wait (measured: a 2-rank GPT step went from about 50 ms to
    // seconds on two cores). A value the user set is kept.
    if (std::getenv("OMP_NUM_THREADS") == nullptr && o.nproc > 1)
      env.push_back("OMP_NUM_THREADS=1");
    for (const auto& kv : o.env)
      env.push_back(kv.first + "=" + kv.second);
    std::vector<char*> envp;
    for (auto& e : env)
      envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string log =
        o.output_dir.empty() ? std::string() : o.output_dir + "/rank_" + std::to_string(r) + ".log";
    int log_fd = -1;
    if (!log.empty()) {
      log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (log_fd < 0) {
        signal_all(SIGKILL);
        TORCH_CHECK(false, "launch: cannot write ", log, ": ", std::strerror(errno));
      }
    }
    // exec failures travel back through a close-on-exec pipe.
    int pipefd[2];
    TORCH_CHECK(pipe2(pipefd, O_CLOEXEC) == 0, "launch: pipe: ", std::strerror(errno));
    pid_t pid = fork();
    if (pid == 0) {
      // NOTE [Failing fast]: die with the launcher, even if it is already gone.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher_pid) _exit(128 + SIGKILL);
      setpgid(0, 0);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      if (log_fd >= 0) {
        dup2(log_fd, 1);
        dup2(log_fd, 2);
      }
      execvpe(argv[0], argv.data(), envp.data());
      int err = errno;
      ssize_t ignored = write(pipefd[1], &err, sizeof(err));
      (void)ignored;
      _exit(127);
    }
    close(pipefd[1]);
    if (log_fd >= 0) close(log_fd);
    if (pid < 0) {
      close(pipefd[0]);
      signal_all(SIGKILL);
      TORCH_CHECK(false, "launch: fork failed for rank ", r, ": ", std::strerror(errno));
    }
    setpgid(pid, pid);  // also from the parent, so signal_all never races the child
    int child_err = 0;
    ssize_t n = read(pipefd[0], &child_err, sizeof(child_err));
    close(pipefd[0]);
    RankStatus st;
    st.rank = r;
    st.pid = pid;
    result.ranks.push_back(st);
    running[r] = true;
    if (n == sizeof(child_err)) {
      waitpid(pid, nullptr, 0);
      running[r] = false;
      signal_all(SIGKILL);
      for (int q = 0; q < r; ++q)
        waitpid(result.ranks[q].pid, nullptr, 0);
      sigaction(SIGINT, &old_int, nullptr);
      sigaction(SIGTERM, &old_term, nullptr);
      sigaction(SIGHUP, &old_hup, nullptr);
      TORCH_CHECK(false, "launch: cannot run '", o.command[0], "': ", std::strerror(child_err));
    }
  }

  // The wait loop. Phases: running; after a failure (or interrupt, or run
  // timeout) a deadline for the others; past it SIGTERM, then SIGKILL.
  int left = o.nproc;
  std::vector<bool> continued(o.nproc, false);  // stopped ranks already ended
  bool terminating = false;  // signals sent by us from now on count as "terminated"
  Clock::time_point grace_deadline = Clock::time_point::max();
  Clock::time_point kill_deadline = Clock::time_point::max();
  int sent_signal = 0;
  while (left > 0) {
    bool reaped = false;
    // NOTE [The first failure of a sweep]: a rank killed by a signal and a
    // peer that exited with an error because of it (its connection reset)
    // are often reaped in the same sweep; the killed one is the cause. The
    // peer may also be reaped a sweep earlier: on a loaded host its exit
    // (the reset seen within microseconds) came before the launcher's next
    // sweep found the killed rank (ProcessFaults.KillDuringSaveLosesNothing
    // named the exit-1 peer once). So a rank killed by a signal that the
    // launcher did not send (a stopped rank it ended is no cause), reaped
    // within kCauseWindow of a first failure that exited with an error, takes
    // its place.
    int sweep_failed = -1;
    for (int r = 0; r < o.nproc; ++r) {
      if (!running[r]) continue;
      int status = 0;
      pid_t p = waitpid(result.ranks[r].pid, &status, WNOHANG);
      if (p == 0 || (p < 0 && errno == EINTR)) continue;
      reaped = true;
      running[r] = false;
      --left;
      auto& st = result.ranks[r];
      st.seconds = seconds_since(t0);
      if (p > 0 && WIFEXITED(status)) {
        st.state = RankStatus::State::Exited;
        st.exit_code = WEXITSTATUS(status);
      } else if (p > 0 && WIFSIGNALED(status)) {
        st.signal = WTERMSIG(status);
        st.state = (terminating && st.signal == sent_signal) ? RankStatus::State::Terminated
                                                             : RankStatus::State::Signaled;
      }
      if (!st.ok() && result.first_failed_rank < 0 && result.interrupted_by == 0 &&
          !result.run_timed_out &&
          (sweep_failed < 0 || (st.state == RankStatus::State::Signaled &&
                                result.ranks[sweep_failed].state != RankStatus::State::Signaled)))
        sweep_failed = r;
    }
    if (sweep_failed < 0 && result.first_failed_rank >= 0 && !terminating &&
        result.interrupted_by == 0 && !result.run_timed_out &&
        result.ranks[result.first_failed_rank].state == RankStatus::State::Exited)
      for (int r = 0; r < o.nproc; ++r) {
        const auto& st = result.ranks[r];
        if (!running[r] && !continued[r] && st.state == RankStatus::State::Signaled &&
            st.seconds - result.ranks[result.first_failed_rank].seconds <= kCauseWindow) {
          result.first_failed_rank = r;
          break;
        }
      }
    if (sweep_failed >= 0) {
      result.first_failed_rank = sweep_failed;
      grace_deadline = std::min(grace_deadline, Clock::now() + o.timeout);
    }
    if (left == 0) break;
    // A stopped rank (SIGSTOP, Ctrl-Z) can neither go on nor handle SIGTERM:
    // once the run has failed it is ended now, continued so that it sees the
    // SIGTERM (NOTE [A stopped peer] in hp/distributed/comm_internal.h).
    if (result.first_failed_rank >= 0 || terminating)
      for (int r = 0; r < o.nproc; ++r)
        if (running[r] && !continued[r] && process_stopped(result.ranks[r].pid)) {
          continued[r] = true;
          kill(-result.ranks[r].pid, SIGTERM);
          kill(-result.ranks[r].pid, SIGCONT);
        }
    auto now = Clock::now();
    if (int sig = g_pending_signal; sig != 0 && result.interrupted_by == 0) {
      result.interrupted_by = sig;
      signal_all(sig);  // forwarded: the ranks decide how to end
      grace_deadline = std::min(grace_deadline, now + o.kill_grace);
    }
    if (o.run_timeout.count() > 0 && now - t0 > o.run_timeout && !result.run_timed_out &&
        grace_deadline == Clock::time_point::max()) {
      result.run_timed_out = true;
      grace_deadline = now;
    }
    if (!terminating && now >= grace_deadline) {
      terminating = true;
      sent_signal = SIGTERM;
      signal_all(SIGTERM);
      signal_all(SIGCONT);  // a stopped rank handles its SIGTERM only once continued
      kill_deadline = now + o.kill_grace;
    } else if (terminating && sent_signal == SIGTERM && now >= kill_deadline) {
      sent_signal = SIGKILL;
      signal_all(SIGKILL);
    }
    if (!reaped) short_nap();
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  sigaction(SIGHUP, &old_hup, nullptr);
  return result;
}

}  // namespace hp::launch
