#!/usr/bin/env bash
# The whole test suite of one target: installs dependencies when missing,
# builds, runs ctest (C++), and on the pip target pytest (tests/python).
# Arguments go to ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/build.sh
build=${HP_BUILD_DIR:-build}
(cd "$build" && ctest --output-on-failure -j "${HP_TEST_JOBS:-2}" "$@")
if [ "${HP_TARGET:-pip}" = "pip" ]; then
  .venv/bin/python -m pytest -q -ra tests/python
fi
