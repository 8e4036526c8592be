// tests/schedule/fuzz_parse.cpp: libFuzzer target for the action and CSV
// parsers (and validate/lower on whatever parses). Built as a libFuzzer binary
// with clang; test_fuzz_corpus.cpp also drives it from a gtest with g++.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hp/schedule/action.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/schedule.h"

/// Parses `data` as one action and as a schedule CSV. Anything but
/// std::invalid_argument (or a crash) is a bug; a parsed action must print and
/// parse back to itself, a parsed schedule must survive a CSV round trip.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace hp::schedule;
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    Action a = parse_action(text);
    if (parse_action(to_string(a)) != a) throw std::logic_error("action round trip: " + text);
  } catch (const std::invalid_argument&) {
  }
  try {
    Schedule s = from_csv(text);
    Schedule back = from_csv(to_csv(s));
    if (back.actions != s.actions || back.stage_rank != s.stage_rank || back.routes != s.routes ||
        back.num_microbatches != s.num_microbatches)
      throw std::logic_error("csv round trip differs");
    // Keep the work bounded: validate only small schedules.
    if (static_cast<long>(s.num_stages) * s.num_microbatches <= 100000) {
      try {
        validate(s);
        if (!s.lowered) validate(lower(s));
      } catch (const std::invalid_argument&) {
      }
    }
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
