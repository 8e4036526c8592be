// Tests of hp/core: version compatibility and logging.
#include <gtest/gtest.h>

#include <string>

#include "hp/core/compat.h"
#include "hp/core/logging.h"

TEST(Compat, VersionMatchesMacros) {
  std::string v = hp::torch_version();
  EXPECT_EQ(
      v.rfind(std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR), 0),
      0u)
      << v;
  EXPECT_TRUE(HP_TORCH_AT_LEAST(1, 13));
  EXPECT_FALSE(HP_TORCH_AT_LEAST(99, 0));
}

TEST(Logging, LevelFiltersAndRankPrefix) {
  hp::set_log_level(hp::LogLevel::Warn);
  hp::set_log_rank(3);
  testing::internal::CaptureStderr();
  hp::log(hp::LogLevel::Info, "hidden ", 1);
  hp::log(hp::LogLevel::Warn, "shown ", 2);
  std::string err = testing::internal::GetCapturedStderr();
  hp::set_log_rank(-1);
  hp::set_log_level(hp::LogLevel::Info);
  EXPECT_EQ(err, "[rank 3] warn: shown 2\n");
}
