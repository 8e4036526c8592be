#!/usr/bin/env bash
# Configures and builds hyperparallel into build/ (Release, Ninja, ccache,
# precompiled LibTorch header). Extra arguments go to cmake's configure step;
# HP_BUILD_TARGETS (space-separated) builds only those targets and what they
# link (scripts/run.sh builds the `hp` tool alone), else everything.
# The pip target (default): Debian's packages, then the project's .venv with
# the pinned torch (scripts/setup_python.sh), then C++ and the Python
# extension against that torch. HP_TARGET=debian: Debian's LibTorch (what
# scripts/debian13.sh uses in its Debian 13 root); C++ only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
build=${HP_BUILD_DIR:-build}
jobs=${HP_JOBS:-$(nproc)}
args=()
if [ "${HP_TARGET:-pip}" = "pip" ]; then
  bash scripts/setup_python.sh
  py=$root/.venv/bin/python
  args+=("-DCMAKE_PREFIX_PATH=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
         "-DPython3_EXECUTABLE=$py")
  # The wheel is a CUDA build: its CMake config wants the CUDA toolkit (nvcc).
  [ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
fi
# The Debian 13 run builds fewer tests and no benchmarks (scripts/debian13.sh).
[ -n "${HP_TEST_ROOMS:-}" ] && args+=("-DHP_TEST_ROOMS=$HP_TEST_ROOMS")
[ -n "${HP_BUILD_BENCH:-}" ] && args+=("-DHP_BUILD_BENCH=$HP_BUILD_BENCH")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${HP_BUILD_TYPE:-Release} "${args[@]}" "$@" >/dev/null
targets=()
for t in ${HP_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$jobs" "${targets[@]}"
