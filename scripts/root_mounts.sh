# shellcheck shell=bash
# Sourced by scripts/debian13.sh and scripts/fresh_check.sh: what a script
# that mounts into a Debian root (in its own mount namespace) needs to find
# and undo those mounts. Uses the caller's `log`.

# Every mount point at or below $1, one per line.
mounts_under() {
  findmnt -rn -o TARGET | awk -v d="$1" '$0 == d || index($0, d "/") == 1'
}

# Unmounts everything below $1; returns 1 (having said what) when something
# is still mounted afterwards.
unmount_tree() {
  local r=$1
  if ! umount -R "$r" 2>/dev/null; then
    # Something inside still holds a mount busy: detach it now, the kernel
    # frees it when the last user goes (at the latest with this namespace).
    log "umount -R $r failed (busy); detaching lazily"
    umount -R -l "$r" || true
  fi
  local left
  left=$(mounts_under "$r")
  if [ -n "$left" ]; then
    log "error: still mounted after cleanup:"
    echo "$left" >&2
    return 1
  fi
}
