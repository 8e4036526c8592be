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
/// Bytes of CPU tensor storage currently allocated through the tracker.
int64_t memory_allocated();
/// Highest memory_allocated() since the last reset_peak_memory().
int64_t peak_memory_allocated();
/// Sets the peak to the current value.
void reset_peak_memory();

}  // namespace hp
