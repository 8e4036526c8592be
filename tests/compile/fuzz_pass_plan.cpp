// tests/compile/fuzz_pass_plan.cpp: libFuzzer target for the PassPlan YAML
// reader. Built as a libFuzzer binary with clang (tests/compile/CMakeLists.txt,
// run for a bounded time by ctest); test_fuzz_yaml.cpp also drives it from a
// gtest with any compiler.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hp/compile/pass_config.h"

/// Parses `data` as a pass plan. Anything but std::invalid_argument (or a
/// crash) is a bug; a parsed plan must survive a YAML round trip unchanged.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using hp::compile::PassPlan;
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    PassPlan plan = PassPlan::from_yaml(text, "fuzz.yaml");
    PassPlan back = PassPlan::from_yaml(plan.to_yaml(), "round-trip.yaml");
    if (!(back == plan)) throw std::logic_error("pass plan YAML round trip differs: " + text);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
