// Tests of hp/core: version compatibility, logging and memory accounting.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "hp/core/compat.h"
#include "hp/core/logging.h"
#include "hp/core/memory.h"

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

TEST(Memory, TrackerCountsAllocationsFreesAndPeak) {
  hp::install_memory_tracker();
  ASSERT_TRUE(hp::memory_tracker_installed());
  const int64_t before = hp::memory_allocated();
  hp::reset_peak_memory();
  {
    auto t = torch::empty({1 << 20}, torch::kFloat32);  // 4 MiB
    EXPECT_EQ(hp::memory_allocated() - before, int64_t(4) << 20);
    // The size header keeps the data as aligned as LibTorch's own allocator.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
    auto small = torch::ones({3}, torch::kFloat64);
    EXPECT_EQ(hp::memory_allocated() - before, (int64_t(4) << 20) + 24);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data_ptr()) % 64, 0u);
    EXPECT_EQ(small.sum().item<double>(), 3.0);
  }
  EXPECT_EQ(hp::memory_allocated(), before);
  EXPECT_GE(hp::peak_memory_allocated() - before, int64_t(4) << 20);
  // LibTorch's raw_allocate path needs the data pointer as the context.
  c10::Allocator* alloc = c10::GetCPUAllocator();
  void* p = alloc->raw_allocate(1000);
  EXPECT_EQ(hp::memory_allocated() - before, 1000);
  alloc->raw_deallocate(p);
  EXPECT_EQ(hp::memory_allocated(), before);
}
