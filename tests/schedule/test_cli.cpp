// tests/schedule/test_cli.cpp: `hp schedule` as a user runs it: the compare
// table leads with step time and idle, tune and recommend write a CSV that
// show reads back, and bad input is refused with the file, the line or the
// bound.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

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

TEST(Cli, TuneWritesACsvThatShowReads) {
  const std::string costs = temp("costs.json"), out = temp("tuned.csv");
  write(costs,
        R"({"stages": [{"f": 1.4, "i": 1.4, "w": 0.7, "comm": 0.3},
                       {"f": 1, "i": 1, "w": 0.8, "comm": 0.3},
                       {"f": 1, "i": 1, "w": 0.8, "comm": 0.3},
                       {"f": 1.9, "i": 2.1, "w": 1.0, "mem_b": 1.5, "mem_w": 0.7}]})");
  CliRun t = hp("schedule tune --costs " + costs + " -m 16 --mem-limit 1x -o " + out);
  ASSERT_EQ(t.status, 0) << t.out;
  EXPECT_NE(t.out.find("tuned (zb-auto)"), std::string::npos) << t.out;
  CliRun s = hp("schedule show --from " + out + " --no-color");
  EXPECT_EQ(s.status, 0) << s.out;
  EXPECT_NE(s.out.find("tuned  p=4 m=16"), std::string::npos) << s.out;
  // The stage count must match -p.
  CliRun bad = hp("schedule tune --costs " + costs + " -p 3 -o " + out);
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("has 4 stages but -p is 3"), std::string::npos) << bad.out;
  std::remove(costs.c_str());
  std::remove(out.c_str());
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
  CliRun huge = hp("schedule tune --costs " + costs + " -m 4 -o " + temp("tuned.csv"));
  EXPECT_EQ(huge.status, 1) << huge.out;
  EXPECT_NE(huge.out.find("\"f\" must be positive and at most 1e12"), std::string::npos)
      << huge.out;
  write(costs, "{\"stages\": [" + std::string(2 << 20, ' ') + "]}");
  CliRun big = hp("schedule tune --costs " + costs + " -m 4 -o " + temp("tuned.csv"));
  EXPECT_EQ(big.status, 1) << big.out;
  EXPECT_NE(big.out.find("a cost file is at most 1048576"), std::string::npos) << big.out;
  std::remove(costs.c_str());
  // A CSV that cannot be written (its folder is missing) fails, naming it.
  CliRun csv = hp("schedule show 1f1b -p 2 -m 4 --csv /nonexistent-hp-folder/s.csv");
  EXPECT_EQ(csv.status, 1) << csv.out;
  EXPECT_NE(csv.out.find("cannot write '/nonexistent-hp-folder/s.csv'"), std::string::npos)
      << csv.out;
}
