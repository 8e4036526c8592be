#!/usr/bin/env bash
# Installs hyperparallel's build and run dependencies from Debian's packages
# with apt-get, only when some are missing. Needs root (or sudo).
#
#   install_deps.sh                        the packages of this machine's target
#   install_deps.sh --print-packages [T]   print target T's list, install nothing
#
# Targets (docs/torch_versions.md): "pip" (the default: PyTorch from PyPI in
# the project's .venv, made by scripts/setup_python.sh; Debian gives the
# compiler, the libraries and Python) and "debian" (Debian's LibTorch
# package; scripts/debian13.sh uses it inside its Debian 13 root, where
# HP_TARGET=debian is set). HP_TARGET picks the target when none is given.
set -euo pipefail

COMMON=(
  build-essential cmake ninja-build ccache git
  libgtest-dev libgmock-dev libbenchmark-dev
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev
  iproute2 util-linux
)
# clang and its sanitizer runtimes (libclang-rt-dev, not among clang's own
# dependencies): the libFuzzer targets (cmake/fuzz.cmake).
PIP=(python3-venv python3-dev clang libclang-rt-dev)
DEBIAN=(libtorch-dev libgloo-dev libopenblas0-openmp)

packages_of() {
  case "$1" in
    pip) printf '%s\n' "${COMMON[@]}" "${PIP[@]}" ;;
    debian) printf '%s\n' "${COMMON[@]}" "${DEBIAN[@]}" ;;
    *) echo "install_deps: unknown target '$1' (pip or debian)" >&2; exit 2 ;;
  esac
}

target=${HP_TARGET:-pip}
if [ "${1:-}" = "--print-packages" ]; then
  packages_of "${2:-$target}"
  exit 0
fi

mapfile -t wanted < <(packages_of "$target")
missing=()
for p in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#wanted[@]} packages of the $target target present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
