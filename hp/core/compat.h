// LibTorch version compatibility: the ONLY place in hyperparallel that tests
// TORCH_VERSION_*. Everything else uses the names defined here.
#pragma once

#include <torch/version.h>

/// True when the LibTorch we build against is at least MAJOR.MINOR.
#define HP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace hp {

/// The LibTorch version we were built against, e.g. "1.13.1".
const char* torch_version();

}  // namespace hp
