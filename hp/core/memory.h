// CPU memory accounting: a tracking wrapper around LibTorch's CPU allocator
// that counts bytes currently allocated and the peak since the last reset.
#pragma once

#include <cstdint>

namespace hp {

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
