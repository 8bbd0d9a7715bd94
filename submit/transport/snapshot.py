"""The project's code, shipped with a job as a content-addressed snapshot.

Which files: in a git work tree, every file git does not ignore (tracked, and
untracked-but-not-ignored: a new module you have not `git add`ed yet still ships,
rather than failing the job with an ImportError on the cluster), plus `code.include`,
minus `code.exclude`; outside git, the files under `code.root` (or `code.include`).
meshrun's own state (registry, profiles, caches, ~/.ssh, known_hosts) never ships, even
when those folders sit inside the work tree.

The snapshot lives at `<work_dir>/code/<hash of paths, modes and contents>`: an
unchanged project is found there and uploads nothing; a changed one is uploaded
once, as one gzipped tar, into a temporary folder renamed into place. A folder is
reused only if it verifies (submit/transport/seal.py: its sealed manifest matches the files,
nothing else is there but bytecode, and it and `code/` belong to the user and are
writable by no one else). A published folder is never removed or replaced: jobs
queued or running use it. One that does not verify is left as it is, with a
warning naming what changed, and the code goes to the next free name
(`<digest>-1`, ...); the batch script refuses to start from a folder that does
not verify.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from meshrun.launcher.contract.private import write_private
from meshrun.launcher.contract.spec.job import Code
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.folders import own_cache
from meshrun.submit.transport.base import Progress, Transport, Upload
from meshrun.submit.transport.seal import MANIFEST, VERIFY_FUNCTION, WHY_FUNCTION

# Never shipped, whatever code.include says: build litter, the manifest itself, and SSH host key files
# (meshrun's `trust` writes them; known_hosts reveals every host you reach).
ALWAYS_EXCLUDED = (
    ".git",
    "__pycache__",
    "*.pyc",
    ".DS_Store",
    MANIFEST,
    "known_hosts",
    "known_hosts2",
    "known_hosts.old",
    "*.meshrun-tmp",
)
LEFT_OUT = (
    "*.safetensors",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.distcp",
    "*.u16",
    "*.u32",
    "*.u16.json",
    "*.u32.json",
    "*.npy",
)
"""Model weights, checkpoints and token files (with their records) are not code: left out of the snapshot (and said so), unless
code.include names them. A job reads them by path (`init_from`, `data.path`); one exported into the checkout
(`meshrun export -o model.safetensors`) would otherwise ride along with every later submit."""
MAX_BYTES = 512 * 1024 * 1024
MAX_FILES = 100_000


@dataclass(frozen=True)
class Snapshot:
    root: Path
    """The project folder on this machine."""
    files: tuple[tuple[str, int], ...]
    """(path relative to root, mode on the cluster), sorted."""
    digest: str
    """Content address: a hash of every path, mode and content."""
    size: int
    """Bytes of file content."""
    manifest: str = ""
    """`sha256  path` per file, in `files` order: sealed into the snapshot folder, checked before reuse."""
    listing: str = ""
    """`path<TAB>mode` per file, sorted by bytes as `LC_ALL=C sort` does: the folder must hold exactly these."""
    left_out: tuple[str, ...] = ()
    """Files of the project LEFT_OUT kept out (weights, checkpoints, token files), for the submit's warning."""

    @property
    def manifest_sha(self) -> str:
        return hashlib.sha256(self.manifest.encode()).hexdigest()

    @property
    def listing_sha(self) -> str:
        return hashlib.sha256(self.listing.encode()).hexdigest()


def matches(rel: str, patterns: tuple[str, ...]) -> bool:
    """fnmatch against the relative path (`*` crosses folders); a bare name also matches any file or
    folder of that name at any depth; a folder path matches everything under it."""
    return _matcher(patterns)(rel)


@functools.lru_cache(maxsize=64)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """`matches` for one tuple of patterns, compiled once (a checkout's every file is tested against the same
    few): one regex for the path or any of its leading folders, one for each of its parts (bare names)."""
    stripped = [raw.strip("/") for raw in patterns if raw.strip("/")]
    # fnmatch's own translation, "(?s:...)" and its end anchor: `*` crosses folders, as in fnmatchcase.
    globs = [re.sub(r"\\[Zz]$", "", fnmatch.translate(pattern)) for pattern in stripped]
    path = _any_of([f"{glob}(?s:/.*)?" for glob in globs])  # the path, or a leading folder and all under it
    name = _any_of([glob for pattern, glob in zip(stripped, globs) if "/" not in pattern])
    prefixes = tuple(pattern + "/" for pattern in stripped)

    def test(rel: str) -> bool:
        return bool(path(rel) or rel.startswith(prefixes) or any(name(part) for part in rel.split("/")))

    return test


def _any_of(regexes: list[str]) -> Callable[[str], object]:
    if not regexes:
        return lambda _text: None
    return re.compile("|".join(f"(?:{regex})" for regex in regexes)).fullmatch


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def project_root(spec_dir: Path, code: Code) -> Optional[Path]:
    """code.root (relative to the spec's folder), else the git work tree holding the spec, else None."""
    if code.root is not None:
        root = (spec_dir / os.path.expanduser(code.root)).resolve()
        if not root.is_dir():
            raise InputError(
                "code.root", code.root, f"{root} is not a folder; give the project folder, relative to the job spec"
            )
        return root
    return work_tree(spec_dir.resolve())


def work_tree(folder: Path) -> Optional[Path]:
    """The git work tree holding `folder` (the nearest with a `.git` folder, or a `.git` file as a linked
    worktree or a submodule has), found without starting git: `git rev-parse --show-toplevel` cost ~5 ms of
    every `render` and `submit`."""
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists():
            return candidate
    return None


def _walk(root: Path) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != ".git")
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in names]
    return found


def private_dirs() -> list[Path]:
    """meshrun's state, profiles and caches (XDG and default places) and ~/.ssh: never code."""
    home = Path(os.path.expanduser("~"))
    found = [
        home / ".ssh",
        home / ".local" / "state" / "meshrun",
        home / ".config" / "meshrun",
        home / ".cache" / "meshrun",
    ]
    for var, default in (
        ("XDG_STATE_HOME", ".local/state"),
        ("XDG_CONFIG_HOME", ".config"),
        ("XDG_CACHE_HOME", ".cache"),
    ):
        found.append(Path(os.environ.get(var) or home / default) / "meshrun")
    if os.environ.get("MESHRUN_SSH_CONFIG"):
        found.append(Path(os.environ["MESHRUN_SSH_CONFIG"]))
    return found


def _private_prefixes(root: Path) -> list[str]:
    """The private dirs that lie inside root, as paths relative to it."""
    real_root, found = root.resolve(), []
    for folder in private_dirs():
        try:
            found.append(folder.resolve().relative_to(real_root).as_posix())
        except (ValueError, OSError):
            continue  # outside the project: nothing to exclude
    return [p for p in found if p != "."]


def candidates(root: Path, code: Code) -> list[str]:
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed is not None:
        files = set(filter(None, listed.split("\0")))
        if code.include:
            files |= {rel for rel in _walk(root) if matches(rel, code.include)}
    else:
        files = {rel for rel in _walk(root) if not code.include or matches(rel, code.include)}
    excluded = ALWAYS_EXCLUDED + code.exclude
    private = tuple(_private_prefixes(root))
    return sorted(
        rel
        for rel in files
        if not matches(rel, excluded)
        and not rel.startswith(tuple(p + "/" for p in private))
        and rel not in private
        and (root / rel).is_file()
    )


def split_left_out(rels: list[str], code: Code) -> tuple[list[str], tuple[str, ...]]:
    """(what ships, what LEFT_OUT keeps back): weights and token files stay unless code.include names them."""
    held = tuple(rel for rel in rels if matches(rel, LEFT_OUT) and not matches(rel, code.include))
    return [rel for rel in rels if rel not in set(held)], held


def left_out_warning(snapshot: Snapshot) -> list[str]:
    """One line naming the files LEFT_OUT kept out of the snapshot, and how to ship them after all."""
    if not snapshot.left_out:
        return []
    shown = ", ".join(snapshot.left_out[:3]) + (
        f" and {len(snapshot.left_out) - 3} more" if len(snapshot.left_out) > 3 else ""
    )
    return [
        f"not shipped with the code: {shown} (weights, checkpoints and token files are read by path: init_from, "
        f"data.path); to ship one, name it in code.include"
    ]


def collect(spec_dir: Path, code: Code) -> Optional[Snapshot]:
    """The snapshot of the job's project, or None when there is nothing to ship."""
    if not code.sync:
        return None
    root = project_root(spec_dir, code)
    if root is None:
        return None
    rels, left_out = split_left_out(candidates(root, code), code)
    if len(rels) > MAX_FILES:
        raise InputError(
            "code", str(root), f"{len(rels)} files would ship; add code.exclude globs or set code.sync: false"
        )
    digest, files, size, manifest = hashlib.sha256(), [], 0, []
    known = FileHashes(root)
    for rel in rels:
        path = root / rel
        mode = 0o700 if os.access(path, os.X_OK) else 0o600
        sha, length = known.sha(rel, path)
        size += length
        if size > MAX_BYTES:
            raise InputError(
                "code",
                str(root),
                f"the snapshot would exceed {MAX_BYTES >> 20} MiB (at {rel}); "
                f"exclude data and checkpoints with code.exclude",
            )
        digest.update(f"{rel}\0{mode:o}\0{sha}\n".encode())
        files.append((rel, mode))
        manifest.append(f"{sha}  {rel}\n")
    known.save()
    listing = "".join(sorted((f"{rel}\t{mode:o}\n" for rel, mode in files), key=str.encode))
    return Snapshot(
        root=root,
        files=tuple(files),
        digest=digest.hexdigest()[:24],
        size=size,
        manifest="".join(manifest),
        listing=listing,
        left_out=left_out,
    )


class FileHashes:
    """Each file's sha256, kept by its stat (size, mtime, ctime, inode) in the user's cache between calls, as
    git's index does: hashing a checkout's every file took ~20 ms of every `render` and `submit`. A file whose
    times are within RACY_NS of when the record was written is hashed again next time (an edit in the same
    clock tick would keep its times), and so is every file when the cache folder is not privately ours."""

    RACY_NS = 2_000_000_000

    def __init__(self, root: Path) -> None:
        folder = own_cache("file-hashes")
        self.path = None if folder is None else folder / (hashlib.sha256(str(root).encode()).hexdigest()[:24] + ".json")
        self.old: dict[str, list[Any]] = self._load()
        self.new: dict[str, list[Any]] = {}

    def _load(self) -> dict[str, list[Any]]:
        try:
            found = json.loads(self.path.read_text()) if self.path else {}
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def sha(self, rel: str, path: Path) -> tuple[str, int]:
        """(sha256 hex, size) of the file at `path`, from the record when its stat is unchanged."""
        st = os.stat(path)
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = self.old.get(rel)
        if isinstance(entry, list) and entry[:4] == key and len(entry) == 5:
            sha = str(entry[4])
        else:
            data = path.read_bytes()
            sha, key[0] = hashlib.sha256(data).hexdigest(), len(data)
        self.new[rel] = [*key, sha]
        return sha, key[0]

    def save(self) -> None:
        """Write the record (atomically, 0600) when it changed; racy entries are left out."""
        settled = time.time_ns() - self.RACY_NS
        kept = {rel: entry for rel, entry in self.new.items() if max(entry[1], entry[2]) < settled}
        if self.path is None or kept == self.old:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            write_private(tmp, json.dumps(kept, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk costs the next call its hashing, nothing else


MAX_COPIES = 20
"""Copies of one digest the probe looks through (`<digest>`, `<digest>-1`, ...) before giving up."""
MARKER_LINE = "meshrun-probe"
"""The probe's output starts after this line: a chatty shell start-up file may print before it."""

# From the home folder: print the marker and $HOME; make the work dir, runs/ and code/ private (0700) if
# they are new (not when "$5" asks to write nothing); the cluster's suspect-node ledger "$7", each line after
# `suspect ` (launcher/contract/records/suspects.py: a submit leaves them out); then, for the snapshot "$2" (none when empty), walk
# its copies: `code/$2`, `code/$2-1`, ... A copy that does not verify is reported (`changed NAME WHY`) and
# left as it is: a job queued or running may use it. The last line is `WORD NAME`: the first copy that
# verifies (present) or the first free name (absent); `unsafe` or `full` stop the walk.
PROBE_SCRIPT = (
    VERIFY_FUNCTION
    + "\n"
    + WHY_FUNCTION
    + r"""
cd "$HOME" 2>/dev/null; echo meshrun-probe; printf '%s\n' "$HOME"
[ -z "$7" ] || [ ! -f "$7" ] || tail -c 65536 -- "$7" | sed 's/^/suspect /'
[ -z "$1" ] || [ -n "$5" ] || (umask 077 && mkdir -p -- "$1/runs" "$1/code") 2>/dev/null
[ -n "$2" ] || { echo none; exit 0; }
if [ -n "$5" ] && [ ! -e "$1/code" ]; then echo "absent $2"; exit 0; fi
n=$2 i=0
while r=$(v "$1/code" "$1/code/$n" "$3" "$4") && [ "$r" = changed ]; do
  echo "changed $n $(w "$1/code/$n" "$3")"
  i=$((i + 1)); n="$2-$i"
  [ "$i" -lt "$6" ] || { r=full; break; }
done
echo "$r $n"
"""
)

# After the upload into "$1" (a temporary name): move it to "$2", a name the probe found free. If "$2" is
# taken meanwhile, keep it when it verifies (another submit published the same code first), else leave it
# as it is (never replace a folder a job may run from) and fail. Then "$2" must verify.
PUBLISH_SCRIPT = (
    VERIFY_FUNCTION
    + r"""
c=$(dirname "$2")
if ! mv -T "$1" "$2" 2>/dev/null; then
  rm -rf "$1"
  r=$(v "$c" "$2" "$3" "$4")
  [ "$r" = present ] || { echo "$2 appeared meanwhile and does not verify ($r): left as it is; submit again" >&2; exit 1; }
fi
r=$(v "$c" "$2" "$3" "$4"); [ "$r" = present ] || { echo "the snapshot $2 does not verify ($r)" >&2; exit 1; }"""
)


@dataclass(frozen=True)
class Found:
    """What the probe found of a snapshot on the cluster."""

    name: str
    """The folder under `code/` the job runs from: the copy that verifies, else the first free name."""
    present: bool
    """That copy is there and verifies: nothing to upload."""
    changed: tuple[tuple[str, str], ...] = ()
    """(folder, why) for each copy of this digest that did not verify: left as it is (a job may use it)."""


_WHY = {
    "private": "{path} in it is not yours, is writable by others, or is not a plain file",
    "seal": "its seal ({manifest}) was changed",
    "content": "{path} in it was changed or removed",
    "extra": "it holds {path}, which was never uploaded (a job writing into its working folder? "
    "write outputs under $MESHRUN_RUN_DIR)",
    "modes": "a file's mode was changed",
}


def changed_warning(work_dir: str, found: Found) -> list[str]:
    """One line per copy that did not verify: which one, the first thing at fault, and what happens."""
    lines = []
    for name, why in found.changed:
        kind, _, path = why.partition(" ")
        text = _WHY.get(kind, "it does not verify ({kind})").format(path=path, manifest=MANIFEST, kind=why)
        lines.append(
            f"the code snapshot {work_dir.rstrip('/')}/code/{name} changed since it was uploaded: {text}; "
            f"it is left as it is for any job that still runs from it (remove it once none does), and this "
            f"job runs from {work_dir.rstrip('/')}/code/{found.name}"
        )
    return lines


def remote_dir(work_dir: str, snapshot: Snapshot, name: Optional[str] = None) -> str:
    """The snapshot's folder on the cluster: `code/<digest>`, or the copy the probe found (`<digest>-N`)."""
    return f"{work_dir.rstrip('/')}/code/{name or snapshot.digest}"


def _from_home(work_dir: str) -> str:
    """work_dir as the probe's shell (in $HOME) names it: `~/x` -> `x`."""
    return "." if work_dir == "~" else work_dir[2:] if work_dir.startswith("~/") else work_dir


def _check_answer(word: str, work_dir: str) -> None:
    if word == "unsafe":
        raise ClusterError(
            f"{work_dir.rstrip('/')}/code on the cluster is not yours or is writable by others: "
            f"anyone who can write there could change the code your jobs run; make it private "
            f"(`chmod 700` it, as its owner) or choose another paths.work_dir"
        )
    if word == "full":
        raise ClusterError(
            f"{MAX_COPIES} copies of this code snapshot under {work_dir.rstrip('/')}/code changed since they "
            f"were uploaded; remove those no job runs from"
        )
    if word not in ("present", "absent", "changed"):
        raise ClusterError(
            f"checking the code snapshot under {work_dir} gave {word!r}; is this a Linux login node "
            f"(GNU find and sha256sum)?"
        )


def _home_line(lines: list[str]) -> str:
    if not lines or not lines[0].startswith("/"):
        raise ClusterError(f"the cluster's shell gave no home folder (got {lines!r}); check ssh.user")
    return lines[0]


@dataclass(frozen=True)
class Probed:
    """What the one round trip before a submit learns."""

    home: str
    found: Optional[Found]
    suspect_lines: tuple[str, ...] = ()
    """The cluster's suspect-node ledger's newest lines (launcher/contract/records/suspects.py parses them)."""


def probe(
    transport: Transport, work_dir: str, snapshot: Optional[Snapshot], read_only: bool = False
) -> tuple[str, Optional[Found]]:
    """`probe_all`'s home and snapshot copy."""
    probed = probe_all(transport, work_dir, snapshot, read_only)
    return probed.home, probed.found


def probe_all(
    transport: Transport, work_dir: str, snapshot: Optional[Snapshot], read_only: bool = False, ledger: str = ""
) -> Probed:
    """ONE round trip before planning: the cluster user's home (for `~` in the profile's paths), the work
    dir's folders made private if new (unless `read_only`), the suspect-node ledger's lines (`ledger`, under
    the work dir; none when ""), and which copy of the snapshot the job runs from (None when there is no
    snapshot): one that verifies, else a free name to upload to."""
    args = [
        _from_home(work_dir),
        *((snapshot.digest, snapshot.manifest_sha, snapshot.listing_sha) if snapshot is not None else ("", "", "")),
        "read-only" if read_only else "",
        str(MAX_COPIES),
        _from_home(f"{work_dir.rstrip('/')}/{ledger}") if ledger else "",
    ]
    done = transport.run(["sh", "-c", PROBE_SCRIPT, "sh", *args], timeout=300).check("reading $HOME")
    lines = done.stdout.splitlines()
    mark = max((i for i, line in enumerate(lines) if line == MARKER_LINE), default=-1)
    lines = lines[mark + 1 :] if mark >= 0 else []
    home = _home_line(lines)
    suspect_lines = tuple(line[len("suspect ") :] for line in lines if line.startswith("suspect "))
    lines = [line for line in lines if not line.startswith("suspect ")]
    if snapshot is None:
        return Probed(home, None, suspect_lines)
    word, _, name = (lines[-1] if len(lines) > 1 else "").partition(" ")
    _check_answer(word, work_dir)
    changed = tuple(
        (parts[1], parts[2] if len(parts) > 2 else "")
        for parts in (line.split(" ", 2) for line in lines[1:-1] if line.startswith("changed "))
    )
    found = Found(name=name or snapshot.digest, present=word == "present", changed=changed)
    return Probed(home, found, suspect_lines)


def remote_home(transport: Transport) -> str:
    """The cluster user's real home (what `~` means there), in one round trip; for `doctor` over SSH."""
    done = transport.run(["sh", "-c", 'cd "$HOME" 2>/dev/null; printf "%s\\n" "$HOME"']).check("reading $HOME")
    return _home_line(done.stdout.splitlines()[-1:])


def verify(transport: Transport, snapshot: Snapshot, code_dir: str) -> bool:
    """Is code_dir a verified copy of the snapshot? (One command, which also makes the work dir's folders
    private if new; over SSH, probe does both in its round trip.)"""
    script = VERIFY_FUNCTION + '\n(umask 077 && mkdir -p -- "$(dirname "$1")/runs" "$1") 2>/dev/null; v "$@"'
    code = code_dir.rsplit("/", 1)[0]
    done = transport.run(
        ["sh", "-c", script, "sh", code, code_dir, snapshot.manifest_sha, snapshot.listing_sha], timeout=300
    ).check(f"verifying {code_dir}")
    word = (done.stdout.split() or [""])[-1]
    _check_answer(word, code.rsplit("/", 1)[0])
    return word == "present"


def sync(
    transport: Transport,
    snapshot: Snapshot,
    code_dir: str,
    progress: Optional[Progress] = None,
    present: Optional[bool] = None,
) -> bool:
    """Make sure code_dir holds the snapshot, verified (`present`: already known from probe); True if
    uploaded. The upload goes to a temporary name and is renamed into place, its manifest with it; a
    folder already at code_dir that does not verify is never replaced (ClusterError)."""
    if present if present is not None else verify(transport, snapshot, code_dir):
        return False
    tmp = f"{code_dir.rsplit('/', 1)[0]}/.tmp-{snapshot.digest}-{secrets.token_hex(3)}"
    uploads = {rel: Upload(snapshot.root / rel, mode) for rel, mode in snapshot.files}
    uploads[MANIFEST] = Upload(snapshot.manifest.encode(), 0o600)
    then = ["sh", "-c", PUBLISH_SCRIPT, "sh", tmp, code_dir, snapshot.manifest_sha, snapshot.listing_sha]
    done = transport.put(uploads, tmp, then=then, progress=progress)
    assert done is not None
    done.check(f"publishing the code snapshot {code_dir}")
    return True
