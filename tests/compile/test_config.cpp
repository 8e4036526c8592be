// PassConfig and PassPlan contracts: validation, exact-before-pattern lookup
// in insertion order, merge (other wins, inputs untouched), and the YAML of
// the seed §4.2 incl. malformed files whose errors name the line.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
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
  // Not a map at the top.
  e = err("- a\n- b\n");
  EXPECT_NE(e.find("line 1"), std::string::npos) << e;
  e = error_of([] { PassPlan::load_yaml("/nonexistent/plan.yaml"); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
}

}  // namespace
