#!/usr/bin/env bash
# The whole test suite on both targets, one after the other; both must pass:
#   1. PyTorch from pip (this machine, the project's .venv): scripts/test.sh
#      (build/; C++ and Python);
#   2. Debian 13's LibTorch 2.6, in a chroot: scripts/debian13.sh test
#      (build-debian13/; C++; the Debian 13 root is made on first use).
# Arguments go to ctest on both targets. Needs root (apt-get, debootstrap,
# chroot). See docs/torch_versions.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

t0=$SECONDS
echo "test_all: PyTorch from pip (.venv, requirements.txt)"
bash scripts/test.sh "$@"
t1=$SECONDS
echo "test_all: LibTorch 2.6 (Debian 13 chroot)"
bash scripts/debian13.sh test "$@"
t2=$SECONDS
echo "test_all: both targets passed (pip $((t1 - t0)) s, Debian 13 $((t2 - t1)) s)"
