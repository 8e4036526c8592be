// LibTorch version compatibility: the ONLY place in hyperparallel that tests
// TORCH_VERSION_*. Everything else uses the names defined here.
#pragma once

#include <torch/version.h>

/// True when the LibTorch we build against is at least MAJOR.MINOR.
#define HP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10::Allocator::allocate lost its const in LibTorch 2.x, which also added
// copy_data as a pure virtual.
#if HP_TORCH_AT_LEAST(2, 3)
#define HP_ALLOCATOR_CONST
#define HP_ALLOCATOR_EXTRA_OVERRIDES                                              \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                          \
  }
#else
#define HP_ALLOCATOR_CONST const
#define HP_ALLOCATOR_EXTRA_OVERRIDES
#endif

namespace hp {

/// The LibTorch version we were built against, e.g. "1.13.1".
const char* torch_version();

namespace compat {

// NOTE [TCPStore and libuv]
// LibTorch 2.4 made libuv the default TCPStore server backend
// (TCPStoreOptions::useLibUV = true), but Debian 13's LibTorch 2.6 is built
// without libuv: rank 0 then cannot host the store at all ("use_libuv was
// requested but PyTorch was build without libuv support"). We always ask for
// the classic backend, the only one LibTorch 1.13 has. A template, so that
// this header needs no c10d include.
template <typename TCPStoreOptions>
inline void use_classic_tcpstore(TCPStoreOptions& options) {
#if HP_TORCH_AT_LEAST(2, 4)
  options.useLibUV = false;
#else
  (void)options;
#endif
}

}  // namespace compat
}  // namespace hp
