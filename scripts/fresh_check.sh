#!/usr/bin/env bash
# The newcomer's measurement: the README's two commands, timed on a fresh
# Debian 12 (bookworm) root made with debootstrap, whose minutes go into the
# README and docs/benchmarks.md. A measurement, not part of the test command.
#
#   scripts/fresh_check.sh [main|test|both]   (default both; run as root)
#
# main: the README's first command (the training job), test: its second (the
# whole test suite), both: the two in the README's order in the same root, as
# a newcomer would run them (the second then finds the first one's .venv and
# build/). The commands are read from README.md's first ```sh block, so they
# are timed exactly as written there.
#
# Each run deletes $HP_FRESH_ROOT (default /var/cache/hyperparallel/fresh-debian12)
# and makes it again: `debootstrap --variant=minbase bookworm` (the smallest
# Debian 12; a cloud image has more, so what works here works there), the
# apt sources and /etc files a real machine has, and a clean copy of this
# working tree (git's tracked and untracked-but-not-ignored files, as a fresh
# clone has: no .venv, no build folders, no ccache) in /root/hyperparallel.
# Inside it runs as root with a fresh login's environment; nothing else is
# installed before the clock starts (see preinstall below). `test` runs
# scripts/debian13.sh inside, which makes its own Debian 13 root in
# /var/cache/hyperparallel/debian13 inside this one (fresh as well).
#
# The table (command, minutes, exit status; for the training job also the
# minute of its first step line) is printed at the end and written to
# $HP_FRESH_ROOT.summary.txt; each command's output, every line prefixed with
# the seconds since its start, to $HP_FRESH_ROOT.main.log / .test.log.
#
# Settings: HP_FRESH_ROOT; HP_FRESH_KEEP=1 keeps the root afterwards (default:
# removed); HP_FRESH_DRY=1 stops just before the first timed command, after
# a look inside the root; HP_FRESH_MIRROR (default http://deb.debian.org/debian);
# HP_FRESH_PREINSTALL (packages installed before timing, default none).
# HP_* variables other than HP_FRESH_* are passed into the root (a newcomer
# sets none; the summary lists them). Every mount is made in a private mount
# namespace and undone on exit, failure or Ctrl-C. Needs util-linux (unshare,
# findmnt), git and tar; installs debootstrap with apt-get when it is missing.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd -P)
ROOT=${HP_FRESH_ROOT:-/var/cache/hyperparallel/fresh-debian12}
MIRROR=${HP_FRESH_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${HP_FRESH_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
KEEP=${HP_FRESH_KEEP:-0}
DRY=${HP_FRESH_DRY:-0}
SUITE=bookworm
DEST=/root/hyperparallel   # the working tree's copy, inside the root

# What the project's scripts need before their own apt-get runs is all in
# minbase (bash, apt, dpkg, coreutils, grep, mawk, diffutils, mount,
# util-linux); python3 comes with python3-venv, ca-certificates with
# python3-pip-whl (through python3-venv), git with install_deps.sh. So none
# of what a cloud image adds (python3, ca-certificates, curl, git, sudo) is
# installed here unless named in HP_FRESH_PREINSTALL; the summary says which.
read -r -a preinstall <<<"${HP_FRESH_PREINSTALL:-}"

log() { echo "[fresh $(dur "$SECONDS")] $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

# Seconds as "12m34s"; as minutes with one decimal.
dur() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

# --------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------
[ $# -le 1 ] || usage
which_cmds=${1:-both}
case "$which_cmds" in
  main | test | both) ;;
  -h | --help | help) usage 0 ;;
  *) log "unknown argument '$which_cmds' (main, test or both)"; usage ;;
esac

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot and mount do)"

ROOT=$(realpath -m "$ROOT")
case "$ROOT/" in
  "$repo"/*) die "HP_FRESH_ROOT ($ROOT) must be outside the repository ($repo)" ;;
esac
[ "$ROOT" != / ] || die "HP_FRESH_ROOT must not be /"
SUMMARY=$ROOT.summary.txt

# Mount points at or below a folder, as this mount namespace sees them.
# shellcheck source=scripts/root_mounts.sh
. "$(dirname "${BASH_SOURCE[0]}")/root_mounts.sh"  # mounts_under, unmount_tree

# Removes a folder, but never one that has anything mounted below it.
safe_remove() {
  local d=$1
  [ -e "$d" ] || return 0
  [ -z "$(mounts_under "$d")" ] || die "refusing to remove $d: something is mounted below it"
  rm -rf --one-file-system "$d"
}

# --------------------------------------------------------------------------
# A private mount namespace, as in scripts/debian13.sh: the script runs
# itself again under `unshare --mount --propagation private`, so no mount
# made here is seen by the host and all go away with the namespace. The
# outer process then checks the host holds no mount below the root, and
# removes the root unless HP_FRESH_KEEP=1.
# --------------------------------------------------------------------------
if [ -z "${HP_FRESH_IN_NS:-}" ]; then
  command -v unshare >/dev/null || die "unshare (util-linux) not found"
  command -v findmnt >/dev/null || die "findmnt (util-linux) not found"
  command -v git >/dev/null || die "git not found (it lists the files to copy)"
  # Ctrl-C goes to the whole process group; the inner script cleans up and
  # exits, then this one carries on below. (A no-op trap, not an ignored
  # signal, which the inner script would inherit.)
  # One run at a time per root.
  mkdir -p "$(dirname "$ROOT")"
  exec 9>"$ROOT.lock"
  flock -n 9 || die "another fresh_check.sh is using $ROOT ($ROOT.lock)"
  trap : INT
  rc=0
  HP_FRESH_IN_NS=1 unshare --mount --propagation private -- \
    bash "$0" "$which_cmds" || rc=$?
  trap - INT
  left=$(mounts_under "$ROOT")
  if [ -n "$left" ]; then
    echo "[fresh] error: mounts left behind on the host (root not removed):" >&2
    echo "$left" >&2
    exit 1
  fi
  if [ "$KEEP" = 1 ]; then
    echo "[fresh] root kept: $ROOT (HP_FRESH_KEEP=1)" >&2
  elif [ -e "$ROOT" ]; then
    echo "[fresh] removing $ROOT" >&2
    safe_remove "$ROOT"
  fi
  exit "$rc"
fi
exec 9>&-   # the lock stays with the outer process

# --------------------------------------------------------------------------
# Mounts, and their cleanup on every exit path.
# --------------------------------------------------------------------------
mounted=0

# The root as a running machine sees it: the kernel file systems, /dev with
# /dev/pts and a /dev/shm (the training job's shared-memory rings), and a
# /run tmpfs (ip netns keeps its namespaces under /run/netns). The root is
# first made a mount point of its own, so one `umount -R` undoes it all; the
# nested chroot of scripts/debian13.sh mounts the same inside its own root.
mount_root() {
  mounted=1
  mount --bind "$ROOT" "$ROOT"
  mount --make-rprivate "$ROOT"
  mount -t proc proc "$ROOT/proc"
  mount -t sysfs sysfs "$ROOT/sys"
  mount --bind /dev "$ROOT/dev"
  mount --bind /dev/pts "$ROOT/dev/pts"
  mount -t tmpfs -o mode=1777,nosuid,nodev shm "$ROOT/dev/shm"
  mount -t tmpfs -o mode=755,nosuid,nodev run "$ROOT/run"
  # The CUDA toolkit of this machine's image, read-only: the pip target
  # builds against torch's CUDA wheel, whose CMake configuration refuses to
  # load without a CUDA toolkit ("Your installed Caffe2 version uses CUDA but
  # I cannot find the CUDA libraries"): the scripts do not install one (see
  # docs/benchmarks.md, "A fresh machine").
  if [ -d /usr/local/cuda-13.0 ]; then
    mkdir -p "$ROOT/usr/local/cuda-13.0"
    mount --bind /usr/local/cuda-13.0 "$ROOT/usr/local/cuda-13.0"
    mount -o remount,bind,ro "$ROOT/usr/local/cuda-13.0"
    ln -sfn /usr/local/cuda-13.0 "$ROOT/usr/local/cuda"
  fi
  # pip's wheel folder of this machine (PIP_FIND_LINKS), read-only.
  if [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then
    mkdir -p "$ROOT$PIP_FIND_LINKS"
    mount --bind "$PIP_FIND_LINKS" "$ROOT$PIP_FIND_LINKS"
    mount -o remount,bind,ro "$ROOT$PIP_FIND_LINKS"
  fi
}

unmount_root() {
  [ "$mounted" = 1 ] || return 0
  mounted=0
  unmount_tree "$ROOT" || return 1
  log "unmounted everything below $ROOT"
}

# --------------------------------------------------------------------------
# The summary: a row per timed command, written to $SUMMARY as each ends and
# printed at the end (also after a failure or Ctrl-C: what was measured).
# --------------------------------------------------------------------------
rows=()
notes=()
header=""

write_summary() {
  [ -n "$header" ] || return 0
  {
    echo "$header"
    echo
    printf '%-8s %8s %5s  %s\n' job minutes exit command
    local r
    for r in "${rows[@]}"; do echo "$r"; done
    [ ${#notes[@]} -eq 0 ] || printf '%s\n' "" "${notes[@]}"
  } >"$SUMMARY"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  unmount_root || rc=1
  if [ -n "$header" ]; then
    write_summary
    echo >&2
    cat "$SUMMARY" >&2
    echo "(written to $SUMMARY)" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM HUP

# --------------------------------------------------------------------------
# Running commands inside the root.
# --------------------------------------------------------------------------

# A fresh root login's environment; HP_* settings (not ours) are passed on.
passed_env=()
net_env=()
for v in $(compgen -e); do
  case "$v" in
    HP_FRESH_*) ;;
    HP_*) passed_env+=("$v=${!v}") ;;
    # The network's setting (see "carried" below): pip's and the TLS trust.
    PIP_* | SSL_CERT_FILE | SSL_CERT_DIR | REQUESTS_CA_BUNDLE | CURL_CA_BUNDLE | http_proxy | \
      https_proxy | no_proxy | HTTP_PROXY | HTTPS_PROXY | NO_PROXY)
      net_env+=("$v=${!v}") ;;
  esac
done
in_root() {
  chroot "$ROOT" env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" USER=root LOGNAME=root \
    SHELL=/bin/bash PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    "${net_env[@]}" "${passed_env[@]}" "$@"
}

# --------------------------------------------------------------------------
# The README's two commands: the lines of its first ```sh block that are
# neither blank nor comments.
# --------------------------------------------------------------------------
mapfile -t readme_cmds < <(awk '
  /^```sh[[:space:]]*$/ && !done { inside = 1; next }
  inside && /^```/ { inside = 0; done = 1; next }
  inside && NF && $1 !~ /^#/ { print }' "$repo/README.md")
[ ${#readme_cmds[@]} -eq 2 ] ||
  die "README.md's first \`\`\`sh block holds ${#readme_cmds[@]} commands, not the two expected"
jobs=()
case "$which_cmds" in
  main) jobs=(main) ;;
  test) jobs=(test) ;;
  both) jobs=(main test) ;;
esac
command_of() { if [ "$1" = main ]; then echo "${readme_cmds[0]}"; else echo "${readme_cmds[1]}"; fi; }

# --------------------------------------------------------------------------
# 1. A fresh Debian 12 root.
# --------------------------------------------------------------------------
log "mode $which_cmds; root $ROOT$([ "$DRY" = 1 ] && echo ' (dry run)')"
if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap on this machine"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; } ||
    die "debootstrap is missing and could not be installed (apt-get install debootstrap)"
fi
mkdir -p "$(dirname "$ROOT")"
log "removing the previous root"
safe_remove "$ROOT"
rm -f "$SUMMARY" "$ROOT.main.log" "$ROOT.test.log" "$ROOT.preinstall.log"

t0=$SECONDS
log "debootstrap --variant=minbase $SUITE into $ROOT ($MIRROR; log $ROOT.debootstrap.log)"
debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 || {
  tail -n 20 "$ROOT.debootstrap.log" >&2
  die "debootstrap failed (log: $ROOT.debootstrap.log)"
}
t_debootstrap=$((SECONDS - t0))
log "debootstrap done in $(dur "$t_debootstrap")"

# What an installed Debian 12 has and debootstrap leaves out: its apt sources
# with updates and security (as /etc/apt/sources.list.d/debian.sources),
# a hostname, /etc/hosts and a working resolver. No packages.
log "configuring the root (apt sources, hostname, hosts, resolv.conf)"
rm -f "$ROOT/etc/apt/sources.list"
cat >"$ROOT/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
# The root shares this machine's host name (no UTS namespace): it must
# resolve, as a machine's own name does (torchrun --standalone looks it up).
host=$(uname -n)
echo "$host" >"$ROOT/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
  "$host" >"$ROOT/etc/hosts"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
# This machine's network setting, which a fresh machine on the same network
# has too: the certificate authorities it trusts beyond Debian's (an
# intercepting proxy's; kept by the root's own ca-certificates package, which
# adds /usr/local/share/ca-certificates to the bundle it makes) and pip's
# configuration. Its wheel folder (PIP_FIND_LINKS) is mounted below.
carried=()
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
  mkdir -p "$ROOT/usr/local/share/ca-certificates" "$ROOT/etc/ssl/certs"
  cp -a /usr/local/share/ca-certificates/. "$ROOT/usr/local/share/ca-certificates/"
  cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  carried+=("CA certificates")
fi
if [ -f /etc/pip.conf ]; then
  cp -L /etc/pip.conf "$ROOT/etc/pip.conf"
  carried+=("/etc/pip.conf")
fi

# --------------------------------------------------------------------------
# 2. The working tree, as a fresh clone has it.
# --------------------------------------------------------------------------
log "copying the working tree (git ls-files: tracked and untracked, not ignored) to $DEST"
list=$ROOT.files
git -c safe.directory="$repo" -C "$repo" ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do
    # Files deleted in the working tree are still in git's index.
    if [ -e "$repo/$f" ] || [ -L "$repo/$f" ]; then printf '%s\0' "$f"; fi
  done >"$list"
mkdir -p "$ROOT$DEST"
tar -C "$repo" --null -T "$list" -cf - | tar -C "$ROOT$DEST" -xf -
n_files=$(tr -cd '\0' <"$list" | wc -c)
rm -f "$list"
log "copied $n_files files ($(du -sh "$ROOT$DEST" | cut -f1))"
for d in .venv build build-debian13 .git; do
  [ ! -e "$ROOT$DEST/$d" ] || die "the copy holds $d, which a fresh clone does not"
done

mount_root
log "mounted /proc, /sys, /dev, /dev/pts, /dev/shm, /run inside the root"

if [ ${#preinstall[@]} -gt 0 ]; then
  log "installing ${preinstall[*]} before timing (HP_FRESH_PREINSTALL)"
  # In a subshell: a redirection on a function call holds for this shell while
  # it runs, so a Ctrl-C's messages would go to the log.
  # shellcheck disable=SC2016 # expanded inside the root
  (in_root bash -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq &&
    apt-get install -y -qq --no-install-recommends "$@" && apt-get clean' sh "${preinstall[@]}") \
    >"$ROOT.preinstall.log" 2>&1 || {
    tail -n 20 "$ROOT.preinstall.log" >&2
    die "apt-get install ${preinstall[*]} failed (log: $ROOT.preinstall.log)"
  }
fi

host_desc="$(nproc) CPU cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) memory"
env_desc="none (a fresh login's)"
[ ${#passed_env[@]} -eq 0 ] || env_desc="${passed_env[*]}"
net_desc="${carried[*]:-nothing}"
[ ${#net_env[@]} -eq 0 ] || net_desc+=", ${#net_env[@]} variables (PIP_*, TLS trust)"
[ -z "${PIP_FIND_LINKS:-}" ] || net_desc+=", the wheel folder $PIP_FIND_LINKS"
[ ! -d /usr/local/cuda-13.0 ] || net_desc+=", the CUDA toolkit /usr/local/cuda-13.0 (read-only)"
header="fresh_check: the README's commands on a fresh Debian $(cat "$ROOT/etc/debian_version") root
  (debootstrap --variant=minbase $SUITE, $(dur "$t_debootstrap"), not counted), $(date -u +%F), $host_desc
  packages installed before timing: ${preinstall[*]:-none}
  environment passed in: $env_desc
  carried from this machine (its network's setting): $net_desc"

# --------------------------------------------------------------------------
# 3. A look inside; HP_FRESH_DRY=1 stops here.
# --------------------------------------------------------------------------
log "inside the root:"
# shellcheck disable=SC2016 # expanded inside the root
in_root bash -c 'cd "$1" && ls && head -3 README.md &&
  echo "--- $(. /etc/os-release && echo "$PRETTY_NAME"), debian_version $(cat /etc/debian_version)" &&
  { if command -v python3 >/dev/null; then python3 --version; else
      echo "python3: not installed (python3-venv brings it, through install_deps.sh)"; fi; } &&
  for t in bash apt-get dpkg-query mount umount unshare findmnt flock awk chroot cmp nproc; do
    command -v "$t" >/dev/null || { echo "missing: $t"; exit 1; }
  done && echo "tools the scripts need before apt-get: present" &&
  unshare --mount --propagation private -- sh -c "mount -t tmpfs probe /mnt && umount /mnt" &&
  echo "nested mount namespace and mount (scripts/debian13.sh): work" &&
  findmnt -rn -o TARGET | sed "s/^/mounted: /"' sh "$DEST" >&2 ||
  die "the look inside the root failed"

if [ "$DRY" = 1 ]; then
  log "dry run: stopping before the timed commands; would run in $DEST, timing each:"
  for j in "${jobs[@]}"; do
    echo "  $j: $(command_of "$j")" >&2
    rows+=("$(printf '%-8s %8s %5s  %s' "$j" - - "$(command_of "$j")")")
  done
  notes+=("dry run (HP_FRESH_DRY=1): nothing was timed")
  exit 0
fi

# --------------------------------------------------------------------------
# 4. The README's commands, timed with `date +%s`; each output line is
# prefixed with the seconds since the command started.
# --------------------------------------------------------------------------
final_rc=0
for j in "${jobs[@]}"; do
  cmd=$(command_of "$j")
  jlog=$ROOT.$j.log
  log "timing $j: $cmd (output: $jlog)"
  start=$(date +%s)
  set +e
  # shellcheck disable=SC2016 # expanded inside the root
  in_root bash -c 'cd "$1" && eval "$2"' sh "$DEST" "$cmd" </dev/null 2>&1 |
    while IFS= read -r line || [ -n "$line" ]; do
      printf -v now '%(%s)T' -1
      printf '%6ds %s\n' $((now - start)) "$line"
    done | tee "$jlog"
  rc=${PIPESTATUS[0]}
  set -e
  end=$(date +%s)
  secs=$((end - start))
  log "$j ended after $(dur "$secs") with exit status $rc"
  rows+=("$(printf '%-8s %8s %5s  %s' "$j" "$(minutes "$secs")" "$rc" "$cmd")")
  if [ "$j" = main ]; then
    # `hp train` prints "hp train: <model>, ..." when its build is done and it
    # starts the ranks, then rank 0's progress line "[####....] step N/M ..."
    # (hp/train/progress.h): off a terminal, every tenth of the run, so the
    # first one is step M/10 (step 2 of the README's 20).
    launch=$(grep -m1 -E '^ *[0-9]+s hp train: ' "$jlog" | awk '{ print $1 }' | tr -d s || true)
    first=$(grep -m1 -E '^ *[0-9]+s \[[#.]+\] step [0-9]+/[0-9]+' "$jlog" || true)
    if [ -n "$launch" ]; then
      notes+=("main: built and launched (\"hp train: ...\") after $(minutes "$launch") min")
    fi
    if [ -n "$first" ]; then
      first_s=$(awk '{ print $1 }' <<<"$first" | tr -d s)
      first_step=$(grep -oE 'step [0-9]+/[0-9]+' <<<"$first")
      notes+=("main: first step after $(minutes "$first_s") min (its first progress line: $first_step)")
    else
      notes+=("main: no progress line seen (see $jlog)")
    fi
  fi
  if [ "$j" = test ]; then
    # scripts/test_all.sh announces its second target (Debian 13's LibTorch).
    second=$(grep -m1 -E '^ *[0-9]+s test_all: LibTorch' "$jlog" | awk '{ print $1 }' | tr -d s || true)
    [ -z "$second" ] ||
      notes+=("test: the pip target took $(minutes "$second") min, the Debian 13 chroot (debootstrap included) $(minutes $((secs - second))) min")
  fi
  [ "$rc" -eq 0 ] || final_rc=$rc
  write_summary
done
[ "${#jobs[@]}" -lt 2 ] ||
  notes+=("test ran after main in the same root, as the README lists them (it reused main's .venv and build/)")
notes+=("logs: $ROOT.<job>.log, each line prefixed with the seconds since its command started")
[ "$final_rc" -eq 0 ] || exit "$final_rc"
