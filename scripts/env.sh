# Sourced by the scripts in this folder: shared paths, PATH fixes and small helpers.
# shellcheck shell=bash

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Everything built or downloaded lives here, outside the clone, so repeated runs are fast
# and a fresh clone never depends on it.
export FLAMEFLEET_CACHE="${FLAMEFLEET_CACHE:-/var/cache/flamefleet}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$FLAMEFLEET_CACHE/target}"

# A root shell's PATH (su, sudo's secure_path) may lack the usual Go and Rust locations.
for _d in /usr/local/go/bin "$HOME/.cargo/bin" "$HOME/go/bin" ${SUDO_USER:+"/home/$SUDO_USER/.cargo/bin"}; do
  [[ -d "$_d" && ":$PATH:" != *":$_d:"* ]] && PATH="$_d:$PATH"
done
unset _d
export PATH

step() { printf '\n== %s: %s\n' "$(basename "$0")" "$*"; }
die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }
require_root() {
  [[ $EUID -eq 0 ]] || die "must run as root ($1)"
}
