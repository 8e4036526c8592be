#!/usr/bin/env bash
# The GPU check: on a machine with a GPU, python3 with torch, cmake and a
# compiler, and nothing else (no network, nothing can be installed), build
# the Python extension against that torch and print one table
# (scripts/gpu_check.py: the split on a bf16 transformer block against
# PyTorch's, tests/python on CUDA, two ranks on the one GPU against one
# process, recompute once per block). Meant to finish within 6 minutes on 16
# cores; without a GPU the same rows run on the CPU (smaller, not judged).
#
#   bash scripts/gpu_check.sh [gpu_check.py options, e.g. --json out.json]
#
# Settings: HP_PYTHON (default: the project's .venv if there is one, else
# python3), HP_GPU_BUILD (build folder, default build-gpu), HP_JOBS.
# Exit status: 0 every row ok (or not judged), 1 a row failed, 2 no build.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -n "${HP_PYTHON:-}" ]; then py=$HP_PYTHON
elif [ -x .venv/bin/python ]; then py=$root/.venv/bin/python
else py=$(command -v python3); fi
build=${HP_GPU_BUILD:-build-gpu}
jobs=${HP_JOBS:-$(nproc)}
t0=$SECONDS

echo "gpu_check: $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())')"
command -v nvidia-smi >/dev/null && nvidia-smi -L

# NOTE [A build with nothing but torch] (CMakeLists.txt): the extension and
# the rooms it uses; no yaml-cpp, CLI11, GoogleTest or system JSON needed.
prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || exit 2
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
mkdir -p "$build"
# The extension is written into the tree (python/hyperparallel/); one that a
# full build put there (with _C.compile) is put back when this script ends.
ext=python/hyperparallel/_C$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if [ -f "$ext" ]; then
  cp -p "$ext" "$build/kept_extension.so"
  trap 'cp -p "$build/kept_extension.so" "$ext"' EXIT
fi
echo "gpu_check: configuring $build (log: $build/configure.log)"
# An extension with its own static libstdc++ crashes at import (NOTE
# [libstdc++ before the wheel's libraries], CMakeLists.txt): flags from the
# environment that ask for one are dropped, and the result is checked below.
unset_flags=()
for v in LDFLAGS CXXFLAGS CFLAGS; do
  if [[ "${!v:-}" == *static* ]]; then
    echo "gpu_check: ignoring $v='${!v}' (it links statically)"
    unset_flags+=(-u "$v")
  fi
done
if ! env "${unset_flags[@]}" cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DHP_EXTENSION_ONLY=ON \
     -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$py" >"$build/configure.log" 2>&1; then
  tail -40 "$build/configure.log"
  echo "gpu_check: configure failed (above)" >&2
  exit 2
fi
echo "gpu_check: building the extension with $jobs jobs (log: $build/build.log)"
if ! cmake --build "$build" --target hp_python -j "$jobs" >"$build/build.log" 2>&1; then
  grep -m 20 -B 2 -A 8 "error" "$build/build.log" || tail -40 "$build/build.log"
  echo "gpu_check: build failed (above)" >&2
  exit 2
fi
echo "gpu_check: built in $((SECONDS - t0)) s"
if command -v nm >/dev/null && { nm --defined-only "$ext"; nm -D --defined-only "$ext"; } 2>/dev/null |
     grep -Eq ' _ZNSo9_M_insertIdEERSoT_(@|$)'; then
  echo "gpu_check: $ext carries its own copy of libstdc++ (linked statically); it would crash at import" >&2
  [ -f "$build/build.ninja" ] && ninja -C "$build" -t commands hp_python | tail -1 | cut -c1-3000
  exit 2
fi

PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" timeout 330 "$py" scripts/gpu_check.py "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_check: the checks ran past 330 s and were stopped" >&2
echo "gpu_check: $((SECONDS - t0)) s in all, exit $rc"
exit $rc
