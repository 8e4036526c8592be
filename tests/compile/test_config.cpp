// PassConfig and PassPlan contracts: validation, exact-before-pattern lookup
// in insertion order, merge (other wins, inputs untouched), and the YAML of
// the seed §4.2 incl. malformed files whose errors name the line, and the
// strictness of issue 15 (unknown and duplicate keys, extra documents,
// bounded input, escaped bytes).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "hp/compile/pass_config.h"

using hp::compile::PassConfig;
using hp::compile::PassPlan;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(PassConfig, DefaultsAndValidate) {
  PassConfig c;
  EXPECT_TRUE(c.enable_overlap);
  EXPECT_TRUE(c.fsdp_enabled);
  EXPECT_FALSE(c.fsdp_degree.has_value());
  EXPECT_EQ(c.tp_size, 1);
  EXPECT_FALSE(c.sequence_parallel);
  EXPECT_FALSE(c.loss_parallel);
  EXPECT_NO_THROW(c.validate());
  c.tp_size = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("tp_size is 0"), std::string::npos);
  c.tp_size = 2;
  c.fsdp_degree = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("fsdp_degree is 0"), std::string::npos);
  c.fsdp_degree = 4;
  EXPECT_NO_THROW(c.validate());
}

TEST(PassPlan, ExactFirstThenPatternsInInsertionOrder) {
  PassPlan plan;
  plan.add_pattern("layers.*").add_pattern("layers.1*").add_module("layers.1");
  ASSERT_TRUE(plan.lookup("layers.1"));
  EXPECT_EQ(plan.lookup("layers.1")->key, "layers.1");   // exact wins
  EXPECT_EQ(plan.lookup("layers.10")->key, "layers.*");  // first pattern wins
  EXPECT_FALSE(plan.lookup("head"));
  EXPECT_TRUE(plan.covers_parameter("layers.3.fc.weight"));
  EXPECT_FALSE(plan.covers_parameter("head.weight"));
  EXPECT_FALSE(plan.covers_parameter("layers"));  // a root parameter has no owning module FQN
  EXPECT_TRUE(plan.enabled());
  EXPECT_FALSE(PassPlan().enabled());
}

TEST(PassPlan, MergeOtherWinsWithoutModifying) {
  PassPlan a, b;
  a.add_module("tok").add_pattern("layers.*");
  b.add_module("head").add_pattern("layers.*").add_pattern("blocks.?");
  b.set_enabled(false);
  PassPlan m = a.merge(b);
  EXPECT_EQ(m.modules().size(), 2u);
  EXPECT_EQ(m.patterns().size(), 2u);
  EXPECT_EQ(m.patterns()[0].first, "layers.*");  // kept its place
  EXPECT_EQ(m.patterns()[1].first, "blocks.?");
  EXPECT_FALSE(m.enabled());  // other's explicit flag wins
  EXPECT_TRUE(a.enabled());
  EXPECT_EQ(a.modules().size(), 1u);
  EXPECT_EQ(b.modules().size(), 1u);
}

TEST(PassPlan, YamlOfTheSeed) {
  const std::string text =
      "fsdp:\n"
      "  enabled: true\n"
      "  modules:\n"
      "    - name: tok_embeddings\n"
      "  patterns:\n"
      "    - pattern: \"layers.*\"\n";
  PassPlan p = PassPlan::from_yaml(text);
  ASSERT_EQ(p.modules().size(), 1u);
  EXPECT_EQ(p.modules()[0].first, "tok_embeddings");
  ASSERT_EQ(p.patterns().size(), 1u);
  EXPECT_EQ(p.patterns()[0].first, "layers.*");
  EXPECT_TRUE(p.enabled());
  // Round trip through a file.
  auto path =
      (std::filesystem::temp_directory_path() / ("hp-plan-" + std::to_string(::getpid()) + ".yaml"))
          .string();
  p.save_yaml(path);
  EXPECT_EQ(PassPlan::load_yaml(path), p);
  std::filesystem::remove(path);
  // enabled defaults to "anything registered".
  EXPECT_TRUE(PassPlan::from_yaml("fsdp:\n  modules:\n    - name: a\n").enabled());
  EXPECT_FALSE(PassPlan::from_yaml("fsdp:\n  modules: []\n").enabled());
  EXPECT_FALSE(PassPlan::from_yaml("").enabled());
}

TEST(PassPlan, MalformedYamlNamesTheLine) {
  auto err = [](const std::string& text) {
    return error_of([&] { PassPlan::from_yaml(text, "plan.yaml"); });
  };
  // Broken syntax (an unclosed flow sequence) on line 3.
  std::string e = err("fsdp:\n  modules:\n    - [name: a\n");
  EXPECT_NE(e.find("plan.yaml line"), std::string::npos) << e;
  EXPECT_NE(e.find("malformed YAML"), std::string::npos) << e;
  // An entry without its field, on line 4.
  e = err("fsdp:\n  modules:\n    - name: a\n    - nome: b\n");
  EXPECT_NE(e.find("plan.yaml line 4"), std::string::npos) << e;
  EXPECT_NE(e.find("'name'"), std::string::npos) << e;
  // patterns is not a list (line 2).
  e = err("fsdp:\n  patterns: \"layers.*\"\n");
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  // An unknown key (line 3).
  e = err("fsdp:\n  enabled: true\n  reshard_after_forward: true\n");
  EXPECT_NE(e.find("line 3"), std::string::npos) << e;
  EXPECT_NE(e.find("reshard_after_forward"), std::string::npos) << e;
  // enabled is not a bool.
  e = err("fsdp:\n  enabled: maybe\n");
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  // A ',' in block context, after brackets that belong to a plain scalar
  // (NOTE [yaml-cpp loops on a stray comma]: yaml-cpp would never return),
  // and one inside a real flow sequence, which is fine.
  e = err("a[[b # c\n,\n");
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  EXPECT_NE(e.find("a ',' outside [ ], { } and quotes"), std::string::npos) << e;
  e = err("fsdp:\n  patterns: [a, b]\n  bogus: 1\n");
  EXPECT_NE(e.find("bogus"), std::string::npos) << e;
  // A directive other than %YAML's (yaml-cpp would never return from some),
  // and %YAML's, which is fine.
  e = err("%aY: .a [x\nfsdp: [[x]]\n");
  EXPECT_NE(e.find("line 1"), std::string::npos) << e;
  EXPECT_NE(e.find("a directive"), std::string::npos) << e;
  // A quoted scalar over two lines (yaml-cpp loops on some).
  e = err("fsdp:\n  enabled: 'a\n,b'\n");
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  EXPECT_NE(e.find("a quoted scalar that goes on past its line"), std::string::npos) << e;
  // A flow collection over two lines.
  e = err("fsdp:\n  patterns: [a,\n    b]\n");
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  EXPECT_NE(e.find("not closed on its line"), std::string::npos) << e;
  e = err("%YAML 1.2\n---\nfsdp:\n  bogus: 1\n");
  EXPECT_NE(e.find("bogus"), std::string::npos) << e;
  // Not a map at the top.
  e = err("- a\n- b\n");
  EXPECT_NE(e.find("line 1"), std::string::npos) << e;
  e = error_of([] { PassPlan::load_yaml("/nonexistent/plan.yaml"); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
}

// Issue 15: every way a plan can say something the reader would ignore is
// refused, naming the file, the line and the offending key.
TEST(PassPlan, StrictYamlRefusesWhatItWouldIgnore) {
  auto err = [](const std::string& text) {
    return error_of([&] { PassPlan::from_yaml(text, "plan.yaml"); });
  };
  struct Case {
    std::string text, expected;
  };
  const std::vector<Case> cases = {
      // A misspelt top-level key (the docs always said unknown keys are errors).
      {"fdsp:\n  enabled: true\n", "plan.yaml line 1: unknown key 'fdsp' (known: fsdp)"},
      {"fsdp:\n  enabled: true\nextra: 1\n", "line 3: unknown key 'extra'"},
      // The same key twice, at any level.
      {"fsdp:\n  enabled: true\n  enabled: false\n",
       "line 3: duplicate key 'enabled' (first on line 2)"},
      {"fsdp: {}\nfsdp: {}\n", "line 2: duplicate key 'fsdp' (first on line 1)"},
      {"fsdp:\n  modules:\n    - name: a\n      name: b\n", "line 4: duplicate key 'name'"},
      // A second document, empty or not.
      {"fsdp:\n  modules:\n    - name: a\n---\nfsdp: {}\n", "line 4: a second YAML document"},
      {"fsdp: {}\n---\n", "line 2: a second YAML document"},
      // Unknown keys inside an entry.
      {"fsdp:\n  patterns:\n    - pattern: a.*\n      reshard: true\n",
       "line 4: unknown key 'reshard' in an fsdp.patterns entry"},
      // Non-string keys; names with control bytes.
      {"? [a]\n: 1\n", "line 1: keys must be plain strings"},
      {"fsdp:\n  modules:\n    - name: \"a\\tb\"\n", "not printable ASCII"},
      // An alias that refers to its own ancestor; alias expansion bounded.
      {"a: &a [x, *a]\n", "nested deeper than"},
  };
  for (const auto& c : cases) {
    const std::string e = err(c.text);
    EXPECT_NE(e.find(c.expected), std::string::npos) << "input:\n" << c.text << "error: " << e;
  }
  std::string bomb = "a: &a [x,x,x,x,x,x,x,x,x,x]\n";
  for (char l = 'b'; l <= 'g'; ++l)
    bomb += std::string(1, l) + ": &" + l + " [" + [&] {
      std::string refs;
      for (int i = 0; i < 10; ++i)
        refs += std::string(i ? "," : "") + "*" + char(l - 1);
      return refs;
    }() + "]\n";
  EXPECT_NE(err(bomb).find("more than 100000 YAML nodes"), std::string::npos) << err(bomb);
  // A leading '---' opens the first document and is fine.
  EXPECT_EQ(PassPlan::from_yaml("---\nfsdp:\n  modules: [{name: a}]\n").modules().size(), 1u);
}

TEST(PassPlan, ErrorTextShowsBytesSafely) {
  // Raw control bytes, a NUL and bytes above 0x7e in a key: escaped, never
  // cut at the NUL, and a long key is cut with its length.
  std::string e = error_of([] { PassPlan::from_yaml("fsdp:\n  \"k\\x01\\0\\xffz\": 1\n"); });
  EXPECT_NE(e.find("unknown key 'fsdp.k\\x01\\x00"), std::string::npos) << e;
  EXPECT_EQ(e.find('\0'), std::string::npos);
  EXPECT_EQ(e.find('\x01'), std::string::npos);
  e = error_of([] { PassPlan::from_yaml("fsdp:\n  " + std::string(500, 'x') + ": 1\n"); });
  EXPECT_NE(e.find("... (500 bytes)"), std::string::npos) << e;
  EXPECT_LT(e.size(), 300u) << e;
}

TEST(PassPlan, InputIsBounded) {
  const auto dir = std::filesystem::temp_directory_path();
  // Too large as text, as a file; devices and folders are refused unread.
  std::string big(PassPlan::kMaxYamlBytes + 1, '#');
  EXPECT_NE(error_of([&] { PassPlan::from_yaml(big, "big.yaml"); }).find("more than the limit"),
            std::string::npos);
  const auto path = (dir / ("hp-plan-big-" + std::to_string(::getpid()) + ".yaml")).string();
  std::ofstream(path) << big;
  EXPECT_NE(error_of([&] { PassPlan::load_yaml(path); }).find("more than the limit"),
            std::string::npos);
  std::filesystem::remove(path);
  EXPECT_NE(error_of([] { PassPlan::load_yaml("/dev/zero"); }).find("not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PassPlan::load_yaml(dir.string()); }).find("not a regular file"),
            std::string::npos);
}

}  // namespace
