"""The project's code, shipped with a job as a content-addressed snapshot.

Which files: in a git work tree, every file git does not ignore (tracked, and
untracked-but-not-ignored: a new module you have not `git add`ed yet still ships,
rather than failing the job with an ImportError on the cluster), plus `code.include`,
minus `code.exclude`; outside git, the files under `code.root` (or `code.include`).
The snapshot lives at `<work_dir>/code/<hash of paths, modes and contents>`: an
unchanged project is found there and uploads nothing; a changed one is uploaded
once, as one gzipped tar, into a temporary folder renamed into place.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launcher.spec import Code
from submit.errors import ClusterError, InputError
from submit.transport import Progress, Transport, Upload

ALWAYS_EXCLUDED = (".git", "__pycache__", "*.pyc", ".DS_Store")
MAX_BYTES = 512 * 1024 * 1024
MAX_FILES = 100_000
# Move the uploaded folder into place; if another submit published the same snapshot first, keep theirs.
PUBLISH_SCRIPT = 'mv -T "$1" "$2" 2>/dev/null || rm -rf "$1"; test -d "$2"'


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


def matches(rel: str, patterns: tuple[str, ...]) -> bool:
    """fnmatch against the relative path (`*` crosses folders); a bare name also matches any file or
    folder of that name at any depth; a folder path matches everything under it."""
    parts = rel.split("/")
    for raw in patterns:
        pattern = raw.strip("/")
        if not pattern:
            continue
        if fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern + "/"):
            return True
        if "/" not in pattern and any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts))):
            return True
    return False


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
            raise InputError("code.root", code.root, f"{root} is not a folder; give the project folder, "
                                                     f"relative to the job spec")
        return root
    top = _git(spec_dir.resolve(), "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top and top.strip() else None


def _walk(root: Path) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != ".git")
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in names]
    return found


def candidates(root: Path, code: Code) -> list[str]:
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if listed is not None:
        files = set(filter(None, listed.split("\0")))
        if code.include:
            files |= {rel for rel in _walk(root) if matches(rel, code.include)}
    else:
        files = {rel for rel in _walk(root) if not code.include or matches(rel, code.include)}
    excluded = ALWAYS_EXCLUDED + code.exclude
    return sorted(rel for rel in files if not matches(rel, excluded) and (root / rel).is_file())


def collect(spec_dir: Path, code: Code) -> Optional[Snapshot]:
    """The snapshot of the job's project, or None when there is nothing to ship."""
    if not code.sync:
        return None
    root = project_root(spec_dir, code)
    if root is None:
        return None
    rels = candidates(root, code)
    if len(rels) > MAX_FILES:
        raise InputError("code", str(root), f"{len(rels)} files would ship; add code.exclude globs or set "
                                            f"code.sync: false")
    digest, files, size = hashlib.sha256(), [], 0
    for rel in rels:
        path = root / rel
        mode = 0o700 if os.access(path, os.X_OK) else 0o600
        data = path.read_bytes()
        size += len(data)
        if size > MAX_BYTES:
            raise InputError("code", str(root), f"the snapshot would exceed {MAX_BYTES >> 20} MiB (at {rel}); "
                                                f"exclude data and checkpoints with code.exclude")
        digest.update(f"{rel}\0{mode:o}\0{hashlib.sha256(data).hexdigest()}\n".encode())
        files.append((rel, mode))
    return Snapshot(root=root, files=tuple(files), digest=digest.hexdigest()[:24], size=size)


# From the home folder: print $HOME, then whether "$1" (a path relative to home, or absolute) is a folder.
PROBE_SCRIPT = ('cd "$HOME" 2>/dev/null; printf "%s\\n" "$HOME"; '
                'if [ -n "$1" ] && [ -d "$1" ]; then echo present; else echo absent; fi')


def remote_dir(work_dir: str, snapshot: Snapshot) -> str:
    return f"{work_dir.rstrip('/')}/code/{snapshot.digest}"


def probe(transport: Transport, work_dir: str, snapshot: Optional[Snapshot]) -> tuple[str, Optional[bool]]:
    """ONE round trip before planning: the cluster user's home (for `~` in the profile's paths) and
    whether the snapshot is already there (None when there is no snapshot)."""
    base = "." if work_dir == "~" else work_dir[2:] if work_dir.startswith("~/") else work_dir
    rel = remote_dir(base, snapshot) if snapshot is not None else ""
    # The last two lines: a chatty shell start-up file may print before the command runs.
    lines = transport.run(["sh", "-c", PROBE_SCRIPT, "sh", rel]).check("reading $HOME").stdout.splitlines()[-2:]
    if len(lines) < 2 or not lines[0].startswith("/"):
        raise ClusterError(f"the cluster's shell gave no home folder (got {lines!r}); check ssh.user")
    return lines[0], (lines[1] == "present") if snapshot is not None else None


def sync(transport: Transport, snapshot: Snapshot, code_dir: str, progress: Optional[Progress] = None,
         present: Optional[bool] = None) -> bool:
    """Make sure code_dir holds the snapshot (`present`: already known from probe); True if uploaded."""
    if present if present is not None else transport.exists(code_dir):
        return False
    tmp = f"{code_dir.rsplit('/', 1)[0]}/.tmp-{snapshot.digest}-{secrets.token_hex(3)}"
    uploads = {rel: Upload(snapshot.root / rel, mode) for rel, mode in snapshot.files}
    done = transport.put(uploads, tmp, then=["sh", "-c", PUBLISH_SCRIPT, "sh", tmp, code_dir], progress=progress)
    assert done is not None
    done.check(f"publishing the code snapshot {code_dir}")
    return True
