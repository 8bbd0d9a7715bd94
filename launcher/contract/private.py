"""Private by default, whatever the umask: the one place that says how meshrun's files and folders are made.

Two layers, because neither alone covers everything a job writes:
- `private_umask()` at every entry point meshrun controls (the CLI, each rank, the local supervisor, the
  sidecar, the batch script's `umask 077`, submitit's jobs): files others write for us (torch's DCP shards,
  TensorBoard's event files, submitit's pickles, Slurm's output file) get 0600 and folders 0700 from birth,
  so nothing is readable by another user even while it is being written.
- `make_private_dir()` for the folders meshrun creates itself: 0700 set explicitly (mkdir's mode is filtered
  by the umask, and `os.makedirs` gives the parents it creates the umask's default), so a folder is private
  also where the umask is not ours (a library caller's process, a user's `command:` program).

Torch-free and stdlib-only: both `submit` and `launcher` use it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

PRIVATE_UMASK = 0o077
"""Nothing for group or others."""
DIR_MODE, FILE_MODE = 0o700, 0o600

PathLike = Union[str, "os.PathLike[str]"]


def private_umask() -> int:
    """Make this process (and every child it starts) create files 0600 and folders 0700; the old umask."""
    return os.umask(PRIVATE_UMASK)


@contextmanager
def private_umask_while() -> Iterator[None]:
    """The private umask for a while, then the caller's again: for a library call inside a user's own
    process (the submitit API), whose umask is theirs outside meshrun's work."""
    old = private_umask()
    try:
        yield
    finally:
        os.umask(old)


def make_private_dir(path: PathLike, keep_existing: bool = False) -> None:
    """mkdir -p with every folder it creates 0700, and `path` itself 0700 when it is ours (unless
    `keep_existing`: a folder the user named, such as `meshrun data --out`'s, keeps the mode it has).

    A folder that already existed above `path` (a home, a shared checkpoint root, /tmp) is left alone.
    """
    path = Path(path)
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        folder.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(folder, DIR_MODE)  # mkdir's mode is filtered by the umask
    if keep_existing and not missing:
        return
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o777 != DIR_MODE:  # no chmod per call on shared storage
        os.chmod(path, DIR_MODE)


def make_private_below(top: PathLike, path: PathLike) -> None:
    """`path` private (made as make_private_dir makes it) and every folder of ours between `top` and it too:
    meshrun's own chain on a node's scratch (`meshrun-$USER/RUN/NODE`), which an older meshrun or another
    umask may have left 0755, is made 0700 again; `top` itself (/tmp, /scratch) is never touched."""
    make_private_dir(path)
    top, folder = Path(top), Path(path)
    if top not in folder.parents:
        return
    for parent in folder.parents:
        if parent == top:
            return
        if parent.stat().st_uid == os.getuid():
            os.chmod(parent, DIR_MODE)


def make_private_files(folder: PathLike) -> None:
    """chmod 0600 every file and 0700 every folder under `folder` (what others wrote with their own modes)."""
    for parent, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(parent, name), DIR_MODE)
        for name in files:
            os.chmod(os.path.join(parent, name), FILE_MODE)


def write_private(path: PathLike, text: str, fsync: bool = False) -> None:
    """Create or truncate `path` as a 0600 file holding `text`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), FILE_MODE)  # an existing file keeps its mode through O_CREAT
        handle.write(text)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())


def append_line(path: str, line: str) -> None:
    """One line appended to a private (0600) file in its private folder, in one write (O_APPEND: the lines of
    two writers of this machine never interleave)."""
    make_private_dir(os.path.dirname(path))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
