"""The seal of a code snapshot folder, as shell: what `submit` runs on the login node before reusing a
snapshot, and what the batch script runs before its ranks start from one. Stdlib only, no imports: the
renderer reads it too.

A snapshot folder is sealed when it is uploaded: `.meshrun-manifest` holds `sha256  path` per file. It
verifies when the manifest is the expected one (its sha256), the files (path and mode) are exactly those
listed, every hash checks, and it and all in it are the user's, writable by no one else, plain files and
folders only. `__pycache__/` folders are not part of the seal: bytecode is never shipped, and Python may
write it beside the sources it imports (the batch script tells it not to; one run by hand may). Their
owner and modes are still checked: only the user can have put them there.
"""

from __future__ import annotations

MANIFEST = ".meshrun-manifest"
"""In each snapshot folder: `sha256  path` lines (what `sha256sum -c` reads), written with the files."""

# `v CODE SNAP MANIFEST_SHA LISTING_SHA` prints one word: `unsafe` when CODE (followed if a link) is not
# the user's or is writable by others (anyone could swap snapshots under us); `absent`; `changed` unless
# SNAP verifies (above); else `present`. GNU find/sha256sum, as on any Linux login node. An empty
# LISTING_SHA skips the "exactly these files, with these modes, no links" steps: the batch script's check,
# where what a job wrote beside the sealed files (outputs, caches, wandb's `latest-run` link) must not stop
# it from starting again; everything in the folder must still be the user's and writable by no one else.
VERIFY_FUNCTION = r"""v() {
u=$(id -u)
[ -n "$(find -H "$1" -maxdepth 0 -type d -user "$u" ! -perm /022 2>/dev/null)" ] || { echo unsafe; return; }
[ -e "$2" ] || [ -L "$2" ] || { echo absent; return; }
[ -z "$(if [ -n "$4" ]; then find "$2" \( ! -user "$u" -o -perm /022 -o ! \( -type f -o -type d \) \) -print -quit
       else find "$2" \( ! -user "$u" -o \( ! -type l -perm /022 \) \) -print -quit; fi 2>&1)" ] &&
[ -d "$2" ] && [ ! -L "$2" ] &&
[ -f "$2/.meshrun-manifest" ] && [ "$(sha256sum < "$2/.meshrun-manifest" | cut -c1-64)" = "$3" ] &&
{ [ -z "$4" ] || [ "$(cd "$2" && find . -name __pycache__ -type d -prune -o -type f ! -path ./.meshrun-manifest \
     -printf '%P\t%m\n' | LC_ALL=C sort | sha256sum | cut -c1-64)" = "$4" ]; } &&
(cd "$2" && sha256sum --quiet --strict -c .meshrun-manifest >/dev/null 2>&1) && echo present || echo changed
}"""

# `w SNAP MANIFEST_SHA` (SNAP did not verify): one line saying why, with the first path at fault:
# `private PATH` (not the user's, writable by others, or not a plain file), `seal` (the manifest itself),
# `content PATH` (a sealed file changed or is gone), `extra PATH` (a file that was never uploaded), or
# `modes` (a file's mode).
WHY_FUNCTION = r"""w() {
u=$(id -u)
p=$(find "$1" \( ! -user "$u" -o -perm /022 -o ! \( -type f -o -type d \) \) -print -quit 2>&1)
[ -z "$p" ] || { echo "private ${p#"$1"/}"; return; }
[ -f "$1/.meshrun-manifest" ] && [ "$(sha256sum < "$1/.meshrun-manifest" | cut -c1-64)" = "$2" ] ||
  { echo seal; return; }
p=$(cd "$1" && sha256sum --strict -c .meshrun-manifest 2>/dev/null | grep -v ': OK$' | head -n 1)
[ -z "$p" ] || { echo "content ${p%: *}"; return; }
p=$(cd "$1" && find . -name __pycache__ -type d -prune -o -type f ! -path ./.meshrun-manifest -printf '%P\n' |
    awk 'FNR == NR { sealed[substr($0, 67)] = 1; next } !($0 in sealed) { print; exit }' .meshrun-manifest -)
[ -z "$p" ] || { echo "extra $p"; return; }
echo modes
}"""
