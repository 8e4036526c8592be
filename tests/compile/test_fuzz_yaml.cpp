// tests/compile/test_fuzz_yaml.cpp: drives the fuzz target of
// fuzz_pass_plan.cpp with the kept corpus (tests/compile/fuzz_corpus: seeds
// and every input that ever crashed it) and a few thousand deterministic
// mutations, so every compiler (not only clang's libFuzzer) exercises the
// PassPlan YAML reader.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

int feed(const std::string& s) {
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::vector<std::string> corpus() {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(HP_YAML_FUZZ_CORPUS_DIR)) {
    std::ifstream in(entry.path(), std::ios::binary);
    out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

TEST(FuzzYaml, KeptCorpusNeverCrashes) {
  auto files = corpus();
  for (const auto& text : files)
    ASSERT_NO_THROW(feed(text)) << text;
  EXPECT_GE(files.size(), 10u);
}

TEST(FuzzYaml, MutationsNeverCrashOrLeakOtherExceptions) {
  std::vector<std::string> seeds = corpus();
  const std::string alphabet = "fsdp:enabledmoduletrnpa \n-[]{}&*!?#'\",.|>\t";
  std::mt19937 rng(20240615);  // deterministic
  int runs = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string s = seeds[rng() % seeds.size()];
    if (s.size() > 4096) s.resize(4096);  // keep each run cheap
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
      switch (rng() % 5) {
        case 0:
          if (pos < s.size()) s[pos] = alphabet[rng() % alphabet.size()];
          break;
        case 1:
          s.insert(s.begin() + pos, alphabet[rng() % alphabet.size()]);
          break;
        case 2:
          if (pos < s.size()) s.erase(pos, 1 + rng() % 8);
          break;
        case 3: {
          const std::string& o = seeds[rng() % seeds.size()];
          s.insert(pos, o.substr(rng() % (o.size() + 1), rng() % 32));
          break;
        }
        default:
          s.insert(s.begin() + pos, static_cast<char>(rng() % 256));
      }
    }
    ASSERT_NO_THROW(feed(s)) << "input: " << s;
    ++runs;
  }
  EXPECT_EQ(runs, 3000);
}

}  // namespace
