#!/usr/bin/env bash
# Builds (when needed) and runs the `hp` command line tool with the given
# arguments, e.g. `bash scripts/run.sh demo split`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/build.sh >&2
exec "${HP_BUILD_DIR:-build}/tools/hp/hp" "$@"
