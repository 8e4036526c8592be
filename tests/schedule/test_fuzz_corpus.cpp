// tests/schedule/test_fuzz_corpus.cpp: drives the fuzz target of fuzz_parse.cpp
// with the kept corpus (tests/schedule/fuzz_corpus: seeds and every input that
// ever crashed it) and a few thousand deterministic random and mutated inputs,
// so every compiler (not only clang's libFuzzer) exercises the parsers.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/schedule.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace hs = hp::schedule;

namespace {
int feed(const std::string& s) {
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}
}  // namespace

TEST(Fuzz, KeptCorpusNeverCrashes) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(HP_FUZZ_CORPUS_DIR)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(feed(text), 0) << entry.path();
    ++files;
  }
  EXPECT_GE(files, 10);
}

TEST(Fuzz, SeedsAndMutationsNeverCrashOrLeakOtherExceptions) {
  std::vector<std::string> seeds = {"2F0",  "1I3",      "0SEND_B2",          "3F1+5B0",
                                    "0W12", "0RECV_F1", "0F0,0B0\n1F0,1B0\n"};
  // Issue 15's cases: headers that disagree with the rows, metadata twice or
  // after the rows, a lowered flag the rows contradict, raw and NUL bytes.
  for (const char* c : {"# ranks,3\n0F0,0B0\n1F0,1B0\n", "# ranks,1\n0F0,0B0\n1F0,1B0\n",
                        "# stages,1\n0F0,0B0\n1F0,1B0\n", "# microbatches,1\n0F0,0F1,0B0,0B1\n",
                        "# ranks,2\n# ranks,2\n0F0\n1F0\n", "0F0,0B0\n# ranks,1\n",
                        "# lowered,0\n0F0,0SEND_F0,0B0\n", "# stages,2\n# stage_rank,0\n0F0\n1F0\n",
                        "# name,\x1b[31m\n0F0,0B0\n"})
    seeds.push_back(c);
  seeds.push_back(std::string("0F0,0\x01X") + std::string(1, '\0') + "\xff,0B0\n");
  seeds.push_back(std::string("# ranks,2\n0F0,0B0\n") + std::string(3, '\0') + "\n1F0,1B0\n");
  for (const char* n : {"1f1b", "zbv", "dualpipe", "interleaved-1f1b"}) {
    hs::Schedule s = hs::build(n, 2, 4);
    seeds.push_back(hs::to_csv(s));
    seeds.push_back(hs::to_csv(hs::lower(s)));
  }
  std::mt19937 rng(20240601);  // deterministic
  const std::string alphabet = "0123456789FIWBSENDRCV_+,#\n -x";
  int runs = 0;
  for (const auto& s : seeds) {
    EXPECT_EQ(feed(s), 0);
    ++runs;
  }
  for (int i = 0; i < 3000; ++i) {
    std::string s = seeds[rng() % seeds.size()];
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
      switch (rng() % 5) {
        case 0:  // replace a character
          if (!s.empty() && pos < s.size()) s[pos] = alphabet[rng() % alphabet.size()];
          break;
        case 1:  // insert
          s.insert(s.begin() + pos, alphabet[rng() % alphabet.size()]);
          break;
        case 2:  // delete a run
          if (pos < s.size()) s.erase(pos, 1 + rng() % 8);
          break;
        case 3: {  // splice in part of another seed
          const std::string& o = seeds[rng() % seeds.size()];
          size_t a = rng() % (o.size() + 1);
          s.insert(pos, o.substr(a, rng() % 24));
          break;
        }
        default:  // random bytes
          s.insert(s.begin() + pos, static_cast<char>(rng() % 256));
      }
    }
    ASSERT_NO_THROW(feed(s)) << "input: " << s;
    ++runs;
  }
  // Pure random short strings.
  for (int i = 0; i < 1000; ++i) {
    std::string s(rng() % 12, ' ');
    for (auto& c : s)
      c = alphabet[rng() % alphabet.size()];
    ASSERT_NO_THROW(feed(s)) << "input: " << s;
    ++runs;
  }
  EXPECT_GE(runs, 4000);
}
