#!/usr/bin/env bash
# The whole test suite on both LibTorch targets, one after the other; both
# must pass:
#   1. Debian 12 (this machine), LibTorch 1.13: scripts/test.sh (build/);
#   2. Debian 13 in a chroot, LibTorch 2.6: scripts/debian13.sh test
#      (build-debian13/; the Debian 13 root is made on first use).
# Arguments go to ctest on both targets. Needs root (apt-get, debootstrap,
# chroot). See docs/torch_versions.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

t0=$SECONDS
echo "test_all: LibTorch 1.13 (Debian 12, native)"
bash scripts/test.sh "$@"
t1=$SECONDS
echo "test_all: LibTorch 2.6 (Debian 13 chroot)"
bash scripts/debian13.sh test "$@"
t2=$SECONDS
echo "test_all: both targets passed (native $((t1 - t0)) s, Debian 13 $((t2 - t1)) s)"
