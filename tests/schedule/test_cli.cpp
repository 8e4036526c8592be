// tests/schedule/test_cli.cpp: `hp schedule` as a user runs it: the compare
// table leads with step time and idle, tune and recommend write a CSV that
// show reads back, and bad input is refused with the file, the line or the
// bound.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace {

struct CliRun {
  int status = -1;
  std::string out;  // stdout and stderr
};

CliRun hp(const std::string& args) {
  CliRun r;
  const std::string cmd = std::string(HP_BIN) + " " + args + " 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0)
    r.out.append(buf, n);
  const int st = ::pclose(f);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string temp(const std::string& name) {
  return ::testing::TempDir() + "hp_cli_test_" + name;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// `hp args...` with its standard output on `out_fd` and its standard error
// read back; SIGPIPE ignored in the child when `ignore_sigpipe` (a shell's
// default otherwise). status: the exit code, or -signal when killed.
struct Spawned {
  int status = -999;
  std::string err;
};
Spawned spawn_hp(const std::vector<std::string>& args, int out_fd, bool ignore_sigpipe) {
  Spawned res;
  int errp[2];
  if (::pipe(errp) != 0) return res;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
  posix_spawn_file_actions_adddup2(&fa, errp[1], 2);
  posix_spawn_file_actions_addclose(&fa, errp[0]);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  sigset_t def;
  sigemptyset(&def);
  sigaddset(&def, SIGPIPE);
  posix_spawnattr_setsigdefault(&at, &def);
  if (!ignore_sigpipe) posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGDEF);
  std::vector<std::string> argv_s = {HP_BIN};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  // An ignored signal stays ignored across exec: ignore it around the spawn.
  struct sigaction old {
  }, ign{};
  ign.sa_handler = SIG_IGN;
  if (ignore_sigpipe) ::sigaction(SIGPIPE, &ign, &old);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, HP_BIN, &fa, &at, argv.data(), environ);
  if (ignore_sigpipe) ::sigaction(SIGPIPE, &old, nullptr);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  ::close(errp[1]);
  if (rc != 0) {
    ::close(errp[0]);
    return res;
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::read(errp[0], buf, sizeof buf)) > 0)
    res.err.append(buf, static_cast<size_t>(n));
  ::close(errp[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  res.status = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? -WTERMSIG(st) : -999;
  return res;
}

// A folder of the test's own with the full device (char 1,7) in it, made by
// mknod; empty when this process may not make device nodes.
std::string own_full_device(const std::string& dir) {
  ::mkdir(dir.c_str(), 0755);
  const std::string dev = dir + "/full";
  ::unlink(dev.c_str());
  if (::mknod(dev.c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0) return "";
  const int fd = ::open(dev.c_str(), O_WRONLY);
  if (fd < 0) return "";
  ::close(fd);
  return dev;
}

}  // namespace

// Issue 17 item 5: the table leads with the step time and the idle fraction,
// is sorted by step time, keeps the paper's bubble rate as a named second
// measure and says which is which.
TEST(Cli, CompareLeadsWithStepTimeAndIdle) {
  CliRun r = hp("schedule compare -p 4 -m 8");
  ASSERT_EQ(r.status, 0) << r.out;
  std::istringstream in(r.out);
  std::string line, header;
  std::vector<double> steps;
  bool gpipe_seen = false;
  while (std::getline(in, line)) {
    if (line.rfind("schedule ", 0) == 0) header = line;
    if (header.empty() || line == header || line.empty()) continue;
    if (line.rfind("sorted by", 0) == 0) break;
    std::istringstream cells(line);
    std::string name, idle;
    double step = 0;
    cells >> name >> step >> idle;
    steps.push_back(step);
    if (name == "gpipe") {
      gpipe_seen = true;
      EXPECT_EQ(idle, "27.27%");  // seed 004: AFAB at p=4, m=8 idles 9/33 of the time
    }
  }
  ASSERT_FALSE(header.empty()) << r.out;
  const size_t step = header.find("step time"), idle = header.find("idle"),
               bubble = header.find("bubble");
  ASSERT_NE(step, std::string::npos);
  EXPECT_LT(step, idle);
  EXPECT_LT(idle, bubble);
  EXPECT_TRUE(gpipe_seen);
  ASSERT_GE(steps.size(), 10u);
  for (size_t i = 1; i < steps.size(); ++i)
    EXPECT_LE(steps[i - 1], steps[i]) << "row " << i;
  EXPECT_NE(r.out.find("sorted by step time"), std::string::npos);
  EXPECT_NE(r.out.find("Zero Bubble paper's bubble rate"), std::string::npos);
  EXPECT_NE(r.out.find("total idle time / (p x step time)"), std::string::npos);
}

// recommend --search: one search beside the fixed schedules, written as CSV
// (what `tune`, now its alias, did).
TEST(Cli, RecommendSearchWritesACsvThatShowReads) {
  const std::string costs = temp("costs.json"), out = temp("tuned.csv"), old = temp("old.csv");
  write(costs,
        R"({"stages": [{"f": 1.4, "i": 1.4, "w": 0.7, "comm": 0.3},
                       {"f": 1, "i": 1, "w": 0.8, "comm": 0.3},
                       {"f": 1, "i": 1, "w": 0.8, "comm": 0.3},
                       {"f": 1.9, "i": 2.1, "w": 1.0, "mem_b": 1.5, "mem_w": 0.7}]})");
  CliRun t = hp("schedule recommend --search zb-auto --costs " + costs +
                " -m 16 --mem-limit 1x -o " + out);
  ASSERT_EQ(t.status, 0) << t.out;
  EXPECT_NE(t.out.find("wrote " + out + " (zb-auto)"), std::string::npos) << t.out;
  CliRun s = hp("schedule show --from " + out + " --no-color");
  EXPECT_EQ(s.status, 0) << s.out;
  EXPECT_NE(s.out.find("zb-auto  p=4 m=16"), std::string::npos) << s.out;
  // tune, its alias, writes the same schedule and says what it is now.
  CliRun alias = hp("schedule tune --costs " + costs + " -m 16 --mem-limit 1x -o " + old);
  ASSERT_EQ(alias.status, 0) << alias.out;
  EXPECT_NE(alias.out.find("hp schedule tune is `hp schedule recommend --search zb-auto`"),
            std::string::npos)
      << alias.out;
  std::ifstream a(out), b(old);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}),
            std::string(std::istreambuf_iterator<char>(b), {}));
  // The stage count must match -p; --search names a search.
  CliRun bad = hp("schedule recommend --search zb-auto --costs " + costs + " -p 3 -o " + out);
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("has 4 stages but -p is 3"), std::string::npos) << bad.out;
  CliRun fixed = hp("schedule recommend --search zbv --costs " + costs + " -o " + out);
  EXPECT_EQ(fixed.status, 1);
  EXPECT_NE(fixed.out.find("give zb-auto, zbv-auto or auto"), std::string::npos) << fixed.out;
  std::remove(costs.c_str());
  std::remove(out.c_str());
  std::remove(old.c_str());
}

// Issue 32: every schedule under the limit, fastest first, the top one as CSV;
// a limit below what any schedule reaches names the smallest one.
TEST(Cli, RecommendWritesTheFastestFittingScheduleAsCsv) {
  const std::string costs = temp("rec_costs.json"), out = temp("rec.csv");
  write(costs,
        R"({"stages": [{"f": 1.4, "i": 1.4, "w": 0.7, "comm": 0.1},
                       {"f": 1, "i": 1, "w": 0.8, "comm": 0.1},
                       {"f": 1, "i": 1, "w": 0.8, "comm": 0.1},
                       {"f": 1.9, "i": 2.1, "w": 1.0, "mem_b": 1.5, "mem_w": 0.7}]})");
  CliRun r = hp("schedule recommend --costs " + costs + " -m 16 --mem-limit 0.5x -o " + out);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("memory limit 3 (1F1B's: 6, smallest possible: 1.25)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("(over limit)"), std::string::npos) << r.out;
  // The first row is the one written; no row within the limit comes after one over it.
  std::istringstream in(r.out);
  std::string line, first;
  bool over_seen = false;
  while (std::getline(in, line)) {
    if (line.rfind("schedule ", 0) == 0) {
      std::getline(in, first);
      break;
    }
  }
  ASSERT_FALSE(first.empty()) << r.out;
  const std::string top = first.substr(0, first.find(' '));
  EXPECT_NE(r.out.find("wrote " + out + " (" + top + ")"), std::string::npos) << r.out;
  while (std::getline(in, line) && !line.empty()) {
    const bool over = line.find("(over limit)") != std::string::npos;
    EXPECT_FALSE(over_seen && !over) << line;
    over_seen = over_seen || over;
  }
  CliRun s = hp("schedule show --from " + out + " --no-color");
  EXPECT_EQ(s.status, 0) << s.out;
  CliRun low = hp("schedule recommend --costs " + costs + " -m 16 --mem-limit 1");
  EXPECT_EQ(low.status, 1);
  EXPECT_NE(low.out.find("below the smallest any schedule reaches (1.25"), std::string::npos)
      << low.out;
  std::remove(costs.c_str());
  std::remove(out.c_str());
}

// Issue 15: bad schedule files are refused at once, with the file and line.
TEST(Cli, ShowRefusesBadFiles) {
  CliRun dev = hp("schedule show --from /dev/zero");
  EXPECT_EQ(dev.status, 1);
  EXPECT_NE(dev.out.find("not a regular file"), std::string::npos) << dev.out;
  const std::string path = temp("two_rows.csv");
  write(path, "# ranks,3\n0F0,0B0\n1F0,1B0\n");
  CliRun rows = hp("schedule show --from " + path);
  EXPECT_EQ(rows.status, 1);
  EXPECT_NE(rows.out.find(path + ": line 1 says 3 ranks but the file has 2 rows"),
            std::string::npos)
      << rows.out;
  write(path, std::string("0F0,0B0\n1F0,1\x01Q") + std::string(1, '\0') + "0\n");
  CliRun raw = hp("schedule show --from " + path);
  EXPECT_EQ(raw.status, 1);
  EXPECT_NE(raw.out.find("line 2 (rank 1)"), std::string::npos) << raw.out;
  EXPECT_NE(raw.out.find("1\\x01Q\\x000"), std::string::npos) << raw.out;
  std::remove(path.c_str());
}

// NOTE [One size rule]: a size no schedule can be made of in seconds is
// refused before any work, the same at every entry point, saying the bound;
// costs whose sums leave the doubles' range and oversized cost files too; a
// file that cannot be written whole is an error, not "wrote".
TEST(Cli, SizesAndCostsBeyondTheRulesAreRefusedAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const std::string& args : {std::string("schedule show zb-h1 -p 4 -m 1000000000"),
                                  std::string("schedule compare -p 4 -m 1000000000")}) {
    CliRun r = hp(args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("too many to schedule in seconds"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("use at most 1448 microbatches at 4 ranks"), std::string::npos) << r.out;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  const std::string costs = temp("huge_costs.json");
  write(costs, R"({"stages": [{"f": 1e308, "i": 1e308, "w": 1e308}, {"f": 1, "i": 1, "w": 1}]})");
  CliRun huge =
      hp("schedule recommend --search zb-auto --costs " + costs + " -m 4 -o " + temp("tuned.csv"));
  EXPECT_EQ(huge.status, 1) << huge.out;
  EXPECT_NE(huge.out.find("\"f\" must be positive and at most 1e12"), std::string::npos)
      << huge.out;
  write(costs, "{\"stages\": [" + std::string(2 << 20, ' ') + "]}");
  CliRun big =
      hp("schedule recommend --search zb-auto --costs " + costs + " -m 4 -o " + temp("tuned.csv"));
  EXPECT_EQ(big.status, 1) << big.out;
  EXPECT_NE(big.out.find("a cost file is at most 1048576"), std::string::npos) << big.out;
  std::remove(costs.c_str());
  // A CSV that cannot be written (its folder is missing) fails, naming it.
  CliRun csv = hp("schedule show 1f1b -p 2 -m 4 --csv /nonexistent-hp-folder/s.csv");
  EXPECT_EQ(csv.status, 1) << csv.out;
  EXPECT_NE(csv.out.find("cannot write '/nonexistent-hp-folder/s.csv' (--csv): the folder "
                         "'/nonexistent-hp-folder' does not exist"),
            std::string::npos)
      << csv.out;
}

// Issue 46: every output option is checked before any work: a search that
// would take seconds is refused at once when its output cannot be written.
TEST(Cli, OutputPathsAreRefusedBeforeAnyWork) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const std::string& args :
       {std::string("schedule show zb-auto -p 1024 -m 45 --svg /nonexistent-hp-folder/s.svg"),
        std::string("schedule show zb-auto -p 1024 -m 45 --trace /nonexistent-hp-folder/t.json"),
        std::string("schedule compare -p 64 -m 128 --svg /nonexistent-hp-folder/c.svg")}) {
    CliRun r = hp(args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("does not exist; create it"), std::string::npos) << r.out;
  }
  const std::string costs = temp("out_costs.json");
  write(costs, R"({"stages": [{"f": 1, "i": 1, "w": 1}, {"f": 1, "i": 1, "w": 1}]})");
  const std::string folder = temp("out_folder");
  ::mkdir(folder.c_str(), 0755);
  for (const std::string& cmd :
       {std::string("recommend --search zb-auto"), std::string("recommend")}) {
    CliRun r = hp("schedule " + cmd + " --costs " + costs + " -m 4 -o " + folder);
    EXPECT_EQ(r.status, 1) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("(-o): it is a folder; give a file name"), std::string::npos) << r.out;
  }
  std::remove(costs.c_str());
  ::rmdir(folder.c_str());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

// Issue 46: --csv to a device node of the test's own (the full device) fails
// and leaves the node a device; --csv to a symlink writes its target.
TEST(Cli, CsvToADeviceOrALinkLeavesThemWhatTheyAre) {
  const std::string dir = temp("devdir");
  const std::string full = own_full_device(dir);
  if (full.empty()) {
    GTEST_SKIP() << "\n\n*** SKIPPED: cannot make and open a device node in " << dir
                 << " (not root, or a nodev mount) ***\n";
  }
  CliRun r = hp("schedule show zb-h1 -p 2 -m 4 --csv " + full);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("cannot write '" + full + "': write: No space left on device"),
            std::string::npos)
      << r.out;
  struct stat st {};
  ASSERT_EQ(::lstat(full.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "the device node was replaced";
  const std::string target = dir + "/target.csv", link = dir + "/link.csv";
  ::unlink(target.c_str());
  ::unlink(link.c_str());
  ASSERT_EQ(::symlink("target.csv", link.c_str()), 0);
  CliRun ok = hp("schedule show zb-h1 -p 2 -m 4 --csv " + link);
  EXPECT_EQ(ok.status, 0) << ok.out;
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "the link was replaced";
  std::ifstream in(target);
  std::string first;
  std::getline(in, first);
  EXPECT_EQ(first, "# hp-schedule,1");
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Issue 46: standard output on a full device (the test's own node) or on a
// pipe whose reader is gone is an error, never exit 0 (as coreutils).
TEST(Cli, StandardOutputThatCannotBeWrittenIsAnError) {
  const std::string dir = temp("stdoutdir");
  const std::string full = own_full_device(dir);
  if (full.empty()) {
    ADD_FAILURE() << "cannot make and open a device node in " << dir;
  } else {
    const int fd = ::open(full.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"schedule", "show", "zb-h1", "-p", "2", "-m", "4"},
          std::vector<std::string>{"schedule", "list"},
          std::vector<std::string>{"schedule", "compare", "-p", "4", "-m", "8", "--json"}}) {
      Spawned r = spawn_hp(args, fd, false);
      EXPECT_EQ(r.status, 1) << args[1] << ": " << r.err;
      EXPECT_NE(r.err.find("hp: error: cannot write the standard output"), std::string::npos)
          << r.err;
    }
    ::close(fd);
  }
  // A pipe whose reader closed: with SIGPIPE ignored, exit 1 and the message;
  // with the default, the signal ends it (a shell's 141), not exit 0.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[0]);
  Spawned ign = spawn_hp({"schedule", "show", "zb-h1", "-p", "2", "-m", "4"}, p[1], true);
  EXPECT_EQ(ign.status, 1) << ign.err;
  EXPECT_NE(ign.err.find("hp: error: cannot write the standard output"), std::string::npos)
      << ign.err;
  Spawned dfl = spawn_hp({"schedule", "show", "zb-h1", "-p", "2", "-m", "4"}, p[1], false);
  EXPECT_EQ(dfl.status, -SIGPIPE) << dfl.err;
  ::close(p[1]);
  std::system(("rm -rf '" + dir + "'").c_str());
}

// show --fb-overlap: the pairs as hp train --fb-overlap runs them (NOTE [An
// overlapped pair in the simulator]): dualpipev at p 4, m 10, comm 2 ends at
// 76 instead of 80.5.
TEST(Cli, ShowSimulatesOverlappedPairs) {
  CliRun plain = hp("schedule show dualpipev -p 4 -m 10 --comm 2 --json");
  CliRun pair = hp("schedule show dualpipev -p 4 -m 10 --comm 2 --fb-overlap --json");
  ASSERT_EQ(plain.status, 0) << plain.out;
  ASSERT_EQ(pair.status, 0) << pair.out;
  EXPECT_NE(plain.out.find("\"makespan\": 80.5"), std::string::npos) << plain.out;
  EXPECT_NE(pair.out.find("\"makespan\": 76.0"), std::string::npos) << pair.out;
}

// show --costs: a cost file's waits inside a chunk (NOTE [Waits inside a
// chunk]) are waited whole by a plain pair, hidden in part by an overlapped
// one, and such a pair is drawn node by node (its halves' letters
// alternate); a file for another number of stages is refused.
TEST(Cli, ShowDrawsAPairNodeByNodeUnderACostFile) {
  std::string stages, dense;
  for (int s = 0; s < 4; ++s) {
    stages +=
        std::string(s ? "," : "") +
        R"({"f": 1, "i": 1, "w": 1, "comm": 1, "f_waits": 2, "f_wait": 1, "i_waits": 2, "i_wait": 1})";
    dense += std::string(s ? "," : "") + R"({"f": 1, "i": 1, "w": 1, "comm": 1})";
  }
  const std::string moe = temp("waits.json"), gpt = temp("dense.json");
  write(moe, "{\"stages\": [" + stages + "]}");
  write(gpt, "{\"stages\": [" + dense + "]}");
  const std::string show = "schedule show dualpipev -p 2 -m 8 --no-color --costs ";
  CliRun plain = hp(show + moe + " --json");
  CliRun pair = hp(show + moe + " --fb-overlap --pair-turns fixed --json");
  // Ready turns (the default; Simulate.ReadyTurnsGiveTheCpuToTheHalfWhoseWaitEndsFirst
  // works one pair by hand) are a little longer here: a half that keeps the
  // CPU can delay the output its partner's consumer waits for.
  CliRun ready = hp(show + moe + " --fb-overlap --json");
  ASSERT_EQ(plain.status, 0) << plain.out;
  ASSERT_EQ(pair.status, 0) << pair.out;
  EXPECT_NE(plain.out.find("\"makespan\": 128.0"), std::string::npos) << plain.out;
  EXPECT_NE(pair.out.find("\"makespan\": 94.3"), std::string::npos) << pair.out;
  EXPECT_NE(ready.out.find("\"makespan\": 94.6"), std::string::npos) << ready.out;
  EXPECT_NE(hp(show + moe + " --pair-turns ready").out.find("--pair-turns requires --fb-overlap"),
            std::string::npos);
  // NOTE [Deferred W's where they lower the step]: hp train's auto choice
  // under these costs, the ready pairs (94.67) against fixed ones with
  // deferred W's (86.67, as the shown step of those flags); none shown
  // where the W's are already deferred.
  CliRun choice = hp(show + moe + " --fb-overlap");
  EXPECT_NE(choice.out.find("deferred W's   step 86.67 with --defer-wgrad against 94.67 without, "
                            "peak memory 5 against 5: hp train's --defer-wgrad auto takes them"),
            std::string::npos)
      << choice.out;
  EXPECT_NE(hp(show + moe + " --fb-overlap --defer-wgrad --pair-turns fixed")
                .out.find("step time      86.67"),
            std::string::npos);
  EXPECT_NE(ready.out.find("\"step_without\": 94.66"), std::string::npos) << ready.out;
  EXPECT_NE(ready.out.find("\"deferred\": true"), std::string::npos) << ready.out;
  EXPECT_EQ(plain.out.find("defer_wgrad_auto"), std::string::npos);  // without --fb-overlap
  EXPECT_EQ(hp(show + moe + " --fb-overlap --defer-wgrad").out.find("deferred W's   step"),
            std::string::npos);
  // NOTE [Weight gradients until the message is there]: ready turns' deferred
  // W's in 4 parts hide more of the pairs' waits than whole ones, and the
  // flag needs its partners.
  const std::string deferred = show + moe + " --fb-overlap --defer-wgrad --pair-turns ready";
  CliRun whole = hp(deferred), parts = hp(deferred + " --w-parts 4");
  EXPECT_NE(whole.out.find("pairs' waits   44.18 % hidden"), std::string::npos) << whole.out;
  EXPECT_NE(parts.out.find("pairs' waits   68.75 % hidden"), std::string::npos) << parts.out;
  EXPECT_NE(parts.out.find("step time      84.42"), std::string::npos) << parts.out;
  EXPECT_NE(
      hp(show + moe + " --fb-overlap --w-parts 4").out.find("--w-parts requires --defer-wgrad"),
      std::string::npos);
  EXPECT_NE(hp(show + moe + " --fb-overlap --defer-wgrad --w-parts 4").out.find("ready turns"),
            std::string::npos);
  EXPECT_NE(hp(show + moe + " --fb-overlap").out.find("BFBF"), std::string::npos);
  EXPECT_EQ(hp(show + gpt + " --fb-overlap").out.find("BFBF"), std::string::npos);
  CliRun other = hp("schedule show dualpipev -p 4 -m 8 --costs " + moe);
  EXPECT_EQ(other.status, 1);
  EXPECT_NE(other.out.find("has 4 stages but the schedule has 8"), std::string::npos) << other.out;
  std::remove(moe.c_str());
  std::remove(gpt.c_str());
}
