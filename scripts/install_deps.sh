#!/usr/bin/env bash
# Installs hyperparallel's build and run dependencies from Debian 12's
# packages with apt-get, only when some are missing. Needs root (or sudo).
# `install_deps.sh --print-packages` prints the list, one a line, and installs
# nothing (scripts/debian13.sh installs the same names in its Debian 13 root).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache git
  libtorch-dev libgloo-dev libopenblas0-openmp
  libgtest-dev libgmock-dev libbenchmark-dev
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev
  iproute2 util-linux
)

if [ "${1:-}" = "--print-packages" ]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
