#!/usr/bin/env bash
# The whole test suite: installs dependencies when missing, builds, runs ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/build.sh
build=${HP_BUILD_DIR:-build}
cd "$build"
ctest --output-on-failure -j "${HP_TEST_JOBS:-2}" "$@"
