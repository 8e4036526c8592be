#!/usr/bin/env bash
# The project's Python environment: .venv in the repository, made with
# Debian's python3 (scripts/install_deps.sh installs python3-venv and
# python3-dev), with requirements.txt installed from PyPI (torch pinned
# there, a CUDA build of several GB that also runs on the CPU). Makes or
# completes it; does nothing when it is complete. Also puts python/ on the
# environment's path, so `import hyperparallel` finds the package and the
# extension scripts/build.sh writes there.
# Settings: HP_VENV (default .venv), HP_PYTHON (default /usr/bin/python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${HP_VENV:-$root/.venv}
base_python=${HP_PYTHON:-/usr/bin/python3}
stamp=$venv/.hp-requirements   # a copy of requirements.txt, written once installed

if [ -f "$stamp" ] && cmp -s "$stamp" requirements.txt && [ -x "$venv/bin/python" ]; then
  echo "setup_python: $venv is complete"
else
  [ -x "$base_python" ] || { echo "setup_python: $base_python not found (apt-get install python3-venv python3-dev)" >&2; exit 1; }
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup_python: making $venv with $base_python"
    "$base_python" -m venv "$venv"
  fi
  t0=$SECONDS
  echo "setup_python: pip install -r requirements.txt (torch is a download of several GB the first time)"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -r requirements.txt
  cp requirements.txt "$stamp"
  echo "setup_python: installed in $((SECONDS - t0)) s"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$root/python" > "$site/hyperparallel-dev.pth"
