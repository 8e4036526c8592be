#!/usr/bin/env bash
# hyperparallel on Debian 13 (trixie, LibTorch 2.6) from a Debian 12 host
# (LibTorch 1.13): a Debian 13 root made with debootstrap, outside the
# repository, in which the project is built and tested with its own scripts.
#
#   scripts/debian13.sh setup [--with-python]   make (or update) the Debian 13 root
#   scripts/debian13.sh test [CTEST_ARGS...]    setup, then build into build-debian13/ and run ctest
#   scripts/debian13.sh shell                   an interactive shell inside, in /src
#   scripts/debian13.sh run -- CMD [ARGS...]    run one command inside, in /src
#
# The root lives in $HP_DEBIAN13_ROOT (default /var/cache/hyperparallel/debian13)
# and is reused once its marker file says it is complete; re-running setup only
# installs the packages that are missing. `--with-python` adds python3-torch.
# Inside, the repository is mounted at /src and a persistent ccache folder
# ($HP_DEBIAN13_CCACHE, default /var/cache/hyperparallel/ccache-debian13) at
# /var/cache/ccache. Every mount is made in a private mount namespace and
# undone on exit, whatever happened (see cleanup below).
#
# Other settings: HP_DEBIAN13_MIRROR (default http://deb.debian.org/debian).
# HP_* variables (HP_JOBS, HP_TEST_JOBS, HP_BUILD_TYPE, ...) and OMP_NUM_THREADS
# are passed into the root, where HP_TARGET=debian (Debian's LibTorch; see
# scripts/install_deps.sh); `test` sets HP_BUILD_DIR=build-debian13.
# Needs root and util-linux (unshare, findmnt, flock); installs debootstrap
# with apt-get when it is missing.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd -P)
ROOT=${HP_DEBIAN13_ROOT:-/var/cache/hyperparallel/debian13}
CCACHE_HOST=${HP_DEBIAN13_CCACHE:-/var/cache/hyperparallel/ccache-debian13}
MIRROR=${HP_DEBIAN13_MIRROR:-http://deb.debian.org/debian}
SUITE=trixie
MARKER=.hp-debian13-complete   # inside the root; written last
BUILD_DIR=build-debian13       # relative to the repository (ignored by build*/)

log() { echo "[debian13] $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

# Seconds as "12m34s".
dur() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# --------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------
[ $# -ge 1 ] || usage
all_args=("$@")   # as given, for running again in the mount namespace
cmd=$1
shift
with_python=0
passthrough=()
case "$cmd" in
  setup)
    for a in "$@"; do
      case "$a" in
        --with-python) with_python=1 ;;
        *) die "setup: unknown option $a" ;;
      esac
    done
    ;;
  test)
    # Options of ours first, the rest (after an optional --) goes to ctest.
    while [ $# -gt 0 ]; do
      case "$1" in
        --with-python) with_python=1; shift ;;
        --) shift; break ;;
        *) break ;;
      esac
    done
    passthrough=("$@")
    ;;
  shell)
    [ $# -eq 0 ] || die "shell takes no arguments"
    ;;
  run)
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || die "run: no command given (scripts/debian13.sh run -- CMD ...)"
    passthrough=("$@")
    ;;
  -h | --help | help) usage 0 ;;
  *) die "unknown subcommand '$cmd' (setup, test, shell, run)" ;;
esac

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot and mount do)"

# The root must not be inside the repository: the repository is mounted
# inside the root, and build*/ globbing or cleaning must never reach it.
ROOT=$(realpath -m "$ROOT")
CCACHE_HOST=$(realpath -m "$CCACHE_HOST")
case "$ROOT/" in
  "$repo"/*) die "HP_DEBIAN13_ROOT ($ROOT) must be outside the repository ($repo)" ;;
esac
mkdir -p "$(dirname "$ROOT")" "$CCACHE_HOST"
PARTIAL=$ROOT.partial   # debootstrap builds here; renamed to $ROOT when complete

# Mount points at or below a folder, as this mount namespace sees them.
# shellcheck source=scripts/root_mounts.sh
. "$(dirname "${BASH_SOURCE[0]}")/root_mounts.sh"  # mounts_under, unmount_tree

# --------------------------------------------------------------------------
# A private mount namespace: the script runs itself again under
# `unshare --mount --propagation private`, so that no mount made here is ever
# seen by the host, and all of them go away with the namespace even if this
# script is killed. The outer process then checks that the host holds no
# mount below the root.
# --------------------------------------------------------------------------
if [ -z "${HP_DEBIAN13_IN_NS:-}" ]; then
  command -v unshare >/dev/null || die "unshare (util-linux) not found"
  rc=0
  HP_DEBIAN13_IN_NS=1 unshare --mount --propagation private -- bash "$0" "${all_args[@]}" || rc=$?
  left=$( (mounts_under "$ROOT"; mounts_under "$PARTIAL") | sort -u)
  if [ -n "$left" ]; then
    log "error: mounts left behind on the host:"
    echo "$left" >&2
    exit 1
  fi
  exit "$rc"
fi

# --------------------------------------------------------------------------
# Mounts, and their cleanup on every exit path.
# --------------------------------------------------------------------------
mounted_root=""   # the root currently mounted, if any

# mount_root DIR [full]: makes DIR a mount point (a bind mount of itself) so
# that one `umount -R DIR` undoes everything below, then mounts the kernel
# file systems; with "full", also /run (ip netns keeps its namespaces under
# /run/netns), the repository at /src and the ccache folder.
mount_root() {
  local r=$1 full=${2:-}
  mounted_root=$r
  mount --bind "$r" "$r"
  mount --make-rprivate "$r"
  mount -t proc proc "$r/proc"
  mount -t sysfs sysfs "$r/sys"
  mount --bind /dev "$r/dev"
  mount --bind /dev/pts "$r/dev/pts"
  mount -t tmpfs -o mode=1777,nosuid,nodev shm "$r/dev/shm"
  if [ "$full" = full ]; then
    mount -t tmpfs -o mode=755,nosuid,nodev run "$r/run"
    mkdir -p "$r/src" "$r/var/cache/ccache"
    mount --bind "$repo" "$r/src"
    mount --bind "$CCACHE_HOST" "$r/var/cache/ccache"
  fi
}

unmount_root() {
  [ -n "$mounted_root" ] || return 0
  local r=$mounted_root
  mounted_root=""
  unmount_tree "$r"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  unmount_root || rc=1
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM HUP

# --------------------------------------------------------------------------
# Running commands inside a root.
# --------------------------------------------------------------------------

# A clean environment for the root: the host's PATH and locale mean nothing
# there; HP_* settings and OMP_NUM_THREADS are passed on.
chroot_env() {
  local v
  env_args=(env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}"
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
            CCACHE_DIR=/var/cache/ccache DEBIAN_FRONTEND=noninteractive
            HP_TARGET=debian)
  for v in $(compgen -e); do
    case "$v" in
      HP_DEBIAN13_* | HP_TARGET) ;;
      HP_* | OMP_NUM_THREADS) env_args+=("$v=${!v}") ;;
    esac
  done
}

# in_root DIR CMD...: runs CMD inside DIR (which must be mounted).
in_root() {
  local r=$1
  shift
  chroot_env
  chroot "$r" "${env_args[@]}" "$@"
}

# --------------------------------------------------------------------------
# Packages.
# --------------------------------------------------------------------------

# The project's own list (scripts/install_deps.sh) under trixie's names, which
# are the same, plus what this root needs besides.
packages() {
  bash "$repo/scripts/install_deps.sh" --print-packages debian
  echo ca-certificates
  [ "$with_python" -eq 0 ] || echo python3-torch
}

# Packages of the list not installed in root DIR.
missing_packages() {
  local r=$1 p
  for p in $(packages); do
    # shellcheck disable=SC2016 # ${Status} is dpkg-query's, not ours
    chroot "$r" dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

# apt_install DIR PKG...: installs into a mounted root; apt's and dpkg's
# output goes to $ROOT.apt.log (its end is shown when something fails).
apt_install() {
  local r=$1 aptlog=$ROOT.apt.log
  shift
  cp -L /etc/resolv.conf "$r/etc/resolv.conf"
  log "apt-get install $* (log: $aptlog)"
  {
    in_root "$r" apt-get update -q &&
      in_root "$r" apt-get install -y -q --no-install-recommends "$@" &&
      in_root "$r" apt-get clean
  } >"$aptlog" 2>&1 || {
    tail -n 30 "$aptlog" >&2
    die "apt-get failed inside $r (log: $aptlog)"
  }
}

# Settings written once into a new root: no daemons started by package
# scripts, no recommended packages, and dpkg without fsync (a build root that
# can always be made again).
configure_root() {
  local r=$1
  printf '#!/bin/sh\nexit 101\n' >"$r/usr/sbin/policy-rc.d"
  chmod 755 "$r/usr/sbin/policy-rc.d"
  echo 'APT::Install-Recommends "0";' >"$r/etc/apt/apt.conf.d/90hp-no-recommends"
  echo 'force-unsafe-io' >"$r/etc/dpkg/dpkg.cfg.d/90hp-unsafe-io"
  mkdir -p "$r/src" "$r/var/cache/ccache"
}

# Removes a folder, but never one that has anything mounted below it (the
# repository is bind-mounted inside a root while it is in use).
safe_remove() {
  local d=$1
  [ -e "$d" ] || return 0
  [ -z "$(mounts_under "$d")" ] || die "refusing to remove $d: something is mounted below it"
  rm -rf --one-file-system "$d"
}

# --------------------------------------------------------------------------
# setup: make the root when it is missing, else install what is missing.
# --------------------------------------------------------------------------
setup() {
  # One setup at a time per root.
  exec 9>"$ROOT.lock"
  flock 9

  if [ -d "$ROOT" ] && [ ! -f "$ROOT/$MARKER" ]; then
    log "$ROOT has no marker ($MARKER): an interrupted setup; making it again"
    safe_remove "$ROOT"
  fi

  if [ ! -d "$ROOT" ]; then
    if ! command -v debootstrap >/dev/null; then
      log "installing debootstrap on this machine"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
          apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; } ||
        die "debootstrap is missing and could not be installed (apt-get install debootstrap)"
    fi
    safe_remove "$PARTIAL"
    local t0=$SECONDS
    log "debootstrap --variant=minbase $SUITE into $PARTIAL ($MIRROR)"
    debootstrap --variant=minbase "$SUITE" "$PARTIAL" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 || {
      tail -n 20 "$ROOT.debootstrap.log" >&2
      die "debootstrap failed (log: $ROOT.debootstrap.log)"
    }
    local t1=$SECONDS
    log "debootstrap done in $(dur $((t1 - t0)))"
    configure_root "$PARTIAL"
    mount_root "$PARTIAL"
    # shellcheck disable=SC2046
    apt_install "$PARTIAL" $(packages)
    unmount_root
    local t2=$SECONDS
    log "packages installed in $(dur $((t2 - t1)))"
    # Complete: rename into place, then write the marker.
    mv "$PARTIAL" "$ROOT"
    printf 'suite=%s\nmirror=%s\ncreated=%s\n' "$SUITE" "$MIRROR" "$(date -u +%FT%TZ)" >"$ROOT/$MARKER"
    log "root ready: $ROOT ($(dur $((t2 - t0))))"
  else
    local missing
    missing=$(missing_packages "$ROOT")
    if [ -n "$missing" ]; then
      local t0=$SECONDS
      mount_root "$ROOT"
      # shellcheck disable=SC2086
      apt_install "$ROOT" $missing
      unmount_root
      log "packages installed in $(dur $((SECONDS - t0)))"
    else
      log "root ready: $ROOT (all packages present)"
    fi
  fi
  # shellcheck disable=SC2016 # ${Version} is dpkg-query's
  log "$(chroot "$ROOT" dpkg-query -W -f='libtorch-dev ${Version}' libtorch-dev)"

  exec 9>&-
}

# --------------------------------------------------------------------------
# The subcommands.
# --------------------------------------------------------------------------
case "$cmd" in
  setup)
    setup
    ;;
  test)
    setup
    mount_root "$ROOT" full
    t0=$SECONDS
    log "building into $BUILD_DIR/ and running ctest (scripts/test.sh)"
    rc=0
    # What differs between LibTorch versions: the rooms that touch LibTorch's
    # API and their tests; the torch-free schedule room, the launcher and the
    # benchmarks are the pip target's alone (docs/torch_versions.md).
    HP_TEST_ROOMS=${HP_TEST_ROOMS:-core;autograd;recompute;distributed;moe;pipeline;compile} \
      HP_BUILD_BENCH=${HP_BUILD_BENCH:-OFF} \
      HP_BUILD_DIR=$BUILD_DIR in_root "$ROOT" bash -c 'cd /src && exec bash scripts/test.sh "$@"' test.sh \
      "${passthrough[@]}" || rc=$?
    log "build and tests took $(dur $((SECONDS - t0))) (exit status $rc)"
    exit "$rc"
    ;;
  shell)
    [ -f "$ROOT/$MARKER" ] || setup
    mount_root "$ROOT" full
    log "shell inside $ROOT (repository at /src); exit to leave"
    # Ctrl-C belongs to the shell inside; a no-op trap (not an ignored
    # signal, which the shell would inherit) keeps it from ending this script.
    trap : INT
    rc=0
    in_root "$ROOT" bash -c 'cd /src && exec bash -i' || rc=$?
    exit "$rc"
    ;;
  run)
    [ -f "$ROOT/$MARKER" ] || setup
    mount_root "$ROOT" full
    rc=0
    in_root "$ROOT" bash -c 'cd /src && exec "$@"' run "${passthrough[@]}" || rc=$?
    exit "$rc"
    ;;
esac
