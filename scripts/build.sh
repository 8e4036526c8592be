#!/usr/bin/env bash
# Configures and builds hyperparallel into build/ (Release, Ninja, ccache,
# precompiled LibTorch header). Extra arguments go to cmake's configure step.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
build=${HP_BUILD_DIR:-build}
jobs=${HP_JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${HP_BUILD_TYPE:-Release} "$@" >/dev/null
cmake --build "$build" -j "$jobs"
