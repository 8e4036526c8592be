// LibTorch version compatibility (see compat.h).
#include "hp/core/compat.h"

namespace hp {

const char* torch_version() {
  return TORCH_VERSION;
}

}  // namespace hp
