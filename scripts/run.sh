#!/usr/bin/env bash
# Builds (when needed) and runs the `hp` command line tool with the given
# arguments, e.g. `bash scripts/run.sh demo split`. It builds the tool and
# what it links only; the tests, benchmarks and the Python extension are
# built by scripts/test.sh (or scripts/build.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
HP_BUILD_TARGETS=hp bash scripts/build.sh >&2
exec "${HP_BUILD_DIR:-build}/tools/hp/hp" "$@"
