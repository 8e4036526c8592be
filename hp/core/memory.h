// CPU memory accounting: a tracking wrapper around LibTorch's CPU allocator
// that counts bytes currently allocated and the peak since the last reset.
#pragma once

#include <cstdint>

namespace hp {

/// Keeps freed CPU memory in the process for reuse instead of returning it to
/// the kernel after every large free (see NOTE [glibc malloc and page faults]).
/// Process-wide; the `hp` ranks and the benchmarks call it at startup.
void keep_freed_memory_mapped();

/// Installs the tracking allocator (once per process; later calls do nothing).
/// Tensors allocated before keep their original allocator and are not counted.
void install_memory_tracker();
/// True once install_memory_tracker() ran.
bool memory_tracker_installed();
/// While one lives on a thread, CPU tensors allocated on that thread take
/// their memory from a pool of blocks freed by earlier such tensors, and give
/// it back to the pool when they die (NOTE [The step cache] in memory.cpp).
/// Installs the tracking allocator. Tensors allocated outside any scope are
/// untouched.
class StepCacheScope {
 public:
  StepCacheScope();
  ~StepCacheScope();
  StepCacheScope(const StepCacheScope&) = delete;
  StepCacheScope& operator=(const StepCacheScope&) = delete;
};
/// True while a StepCacheScope lives on the calling thread.
bool step_cache_active();
/// Bytes of free blocks the step cache holds.
int64_t step_cache_free_bytes();
/// Hands every free block of the step cache back to malloc.
void empty_step_cache();

/// Bytes of CPU tensor storage currently allocated through the tracker.
int64_t memory_allocated();
/// Highest memory_allocated() since the last reset_peak_memory().
int64_t peak_memory_allocated();
/// Sets the peak to the current value.
void reset_peak_memory();

}  // namespace hp
