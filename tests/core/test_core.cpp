// Tests of hp/core: version compatibility, logging and memory accounting.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
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

TEST(Memory, StepCacheReusesBlocksFreedInAScope) {
  hp::empty_step_cache();
  ASSERT_EQ(hp::step_cache_free_bytes(), 0);
  const int64_t before = hp::memory_allocated();
  void* first = nullptr;
  {
    hp::StepCacheScope scope;
    ASSERT_TRUE(hp::memory_tracker_installed());
    {
      auto t = torch::full({1000}, 7.0f);  // 4000 bytes: the class of 4032
      first = t.data_ptr();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
      EXPECT_EQ(hp::memory_allocated() - before, 4000);  // what was asked, not the class
    }
    EXPECT_EQ(hp::step_cache_free_bytes(), 4032);
    EXPECT_EQ(hp::memory_allocated(), before);
    // The same class takes the same block back, with the tensor's own values.
    auto u = torch::zeros({997}, torch::kFloat32);
    EXPECT_EQ(u.data_ptr(), first);
    EXPECT_EQ(hp::step_cache_free_bytes(), 0);
    const float* z = u.data_ptr<float>();
    EXPECT_TRUE(std::all_of(z, z + 997, [](float x) { return x == 0.0f; }));
    // Another class does not.
    auto v = torch::ones({1250}, torch::kFloat32);  // 5000 bytes: the class of 5120
    EXPECT_NE(v.data_ptr(), first);
    u = torch::Tensor();
    v = torch::Tensor();
    EXPECT_EQ(hp::step_cache_free_bytes(), 4032 + 5120);
  }
  // Out of any scope: malloc, and freed to malloc.
  {
    auto w = torch::ones({1000}, torch::kFloat32);
    EXPECT_NE(w.data_ptr(), first);
    EXPECT_EQ(hp::step_cache_free_bytes(), 4032 + 5120);
  }
  EXPECT_EQ(hp::step_cache_free_bytes(), 4032 + 5120);
  // A pooled block freed on another thread, out of any scope, goes back too.
  torch::Tensor moved;
  {
    hp::StepCacheScope scope;
    moved = torch::ones({1000}, torch::kFloat32);
    EXPECT_EQ(moved.data_ptr(), first);
  }
  std::thread([t = std::move(moved)]() mutable { t = torch::Tensor(); }).join();
  EXPECT_EQ(hp::step_cache_free_bytes(), 4032 + 5120);
  // Blocks over 64 MiB are never pooled.
  {
    hp::StepCacheScope scope;
    auto big = torch::empty({(int64_t(64) << 20) / 4 + 16}, torch::kFloat32);
    EXPECT_EQ(hp::memory_allocated() - before, (int64_t(64) << 20) + 64);
  }
  EXPECT_EQ(hp::step_cache_free_bytes(), 4032 + 5120);
  EXPECT_EQ(hp::memory_allocated(), before);
  hp::empty_step_cache();
  EXPECT_EQ(hp::step_cache_free_bytes(), 0);
}
