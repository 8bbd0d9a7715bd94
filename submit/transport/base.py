"""How meshrun reaches a cluster: one small interface, a local and an SSH (submit/transport/ssh.py) implementation.

Commands are argv lists, never shell strings: the SSH transport joins them with
shlex.join, the local one hands them to exec. Where several steps must share one
round trip, they run as `sh -c CONSTANT_SCRIPT sh VALUE...`: the script is fixed
text and every value arrives as a positional parameter, never parsed as shell.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Protocol, Sequence, Union

from meshrun.launcher.contract.private import DIR_MODE, make_private_dir
from meshrun.submit.errors import ClusterError

Progress = Callable[[int, int], None]
"""progress(bytes_sent, bytes_total), called while a command's input is sent."""


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def check(self, what: str) -> Result:
        if self.returncode != 0:
            detail = (self.stderr or self.stdout).strip().splitlines()
            last = detail[-1] if detail else f"exit code {self.returncode}"
            raise ClusterError(f"{what} failed: {last}")
        return self


@dataclass(frozen=True)
class Upload:
    """One file of a `put`: its bytes (or a local file to read) and its mode on the cluster.
    A path ending in '/' is a folder (its data is ignored)."""

    data: Union[bytes, Path]
    mode: int = 0o600


class Stream(Protocol):
    """A running command's stdout, chunk by chunk; iteration ends when the command exits."""

    def __iter__(self) -> Iterator[bytes]: ...

    def close(self) -> None: ...


class Forward(Protocol):
    """A cluster port reachable on this machine at 127.0.0.1:local_port."""

    @property
    def local_port(self) -> int: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """What meshrun needs from a cluster connection."""

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60.0,
        cwd: Optional[str] = None,
        stdin: Optional[bytes] = None,
        progress: Optional[Progress] = None,
    ) -> Result: ...

    def put(
        self,
        files: Mapping[str, Upload],
        dest: str,
        then: Sequence[str] = (),
        progress: Optional[Progress] = None,
        timeout: float = 600.0,
    ) -> Optional[Result]:
        """Write files (relative paths) under dest (made 0700), then run `then` in the same round trip."""

    def stream(self, argv: Sequence[str]) -> Stream: ...

    def forward(self, remote_port: int, local_port: int = 0) -> Forward: ...

    def write_text(self, path: str, text: str, mode: int = 0o600) -> None: ...

    def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes: ...

    def makedirs(self, path: str, mode: int = 0o700) -> None: ...

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def home(self) -> str: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------ shared helpers

# Unpack a gzipped tar from stdin into "$1" (made 0700, as any parent it creates), then exec the rest of the argv, if any.
PUT_SCRIPT = (
    'd=$1; shift; (umask 077 && mkdir -p "$d") && chmod 0700 "$d" && '
    'tar -x -z -p --no-same-owner -f - -C "$d" || exit 97; [ "$#" -eq 0 ] || exec "$@"'
)
PUT_FAILED = 97


def tar_bytes(files: Mapping[str, Upload]) -> bytes:
    """A gzipped tar of `files` (relative paths; folders implied) with their modes (code compresses ~4x)."""
    import tarfile  # here: every `meshrun` call imports this module, few upload

    buf, stamp = io.BytesIO(), int(time.time())
    folders = {str(Path(p).parent) for p in files} | {p.rstrip("/") for p in files if p.endswith("/")}
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for folder in sorted(folders - {"."}):
            mode = files[folder + "/"].mode if folder + "/" in files else 0o700
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, stamp
            tar.addfile(info)
        for rel, item in sorted(files.items()):
            if rel.endswith("/"):
                continue
            data = item.data.read_bytes() if isinstance(item.data, Path) else item.data
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), item.mode, stamp
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def new_marker() -> str:
    """A separator no command's output can forge: random per call (os.urandom, not secrets, whose hmac import
    would cost every `meshrun` call ~5 ms)."""
    return f"MESHRUN-{os.urandom(8).hex()}"


def batch(transport: Transport, argvs: Sequence[Sequence[str]], timeout: float = 60.0) -> list[Result]:
    """Run several commands in ONE round trip; one Result each (their output kept apart by a random marker)."""
    marker = new_marker()
    lines = [
        f"{shlex.join(argv)} </dev/null; s=$?; printf '\\n%s %s\\n' {marker} $s; printf '\\n%s %s\\n' {marker} $s >&2"
        for argv in argvs
    ]
    # The script goes on stdin, not as `sh -c SCRIPT`: one argument is capped at 128 KiB (Linux's
    # MAX_ARG_STRLEN, on the login node and in the remote shell sshd starts) and 1,000 jobs' status is
    # ~500 kB. Each command reads /dev/null, so none can swallow the rest of the script.
    done = transport.run(["sh", "-s"], timeout=timeout, stdin="\n".join(lines).encode())
    outs, errs = _split(done.stdout, marker), _split(done.stderr, marker)
    if len(outs) < len(argvs):
        done.check("remote commands")
        raise ClusterError(f"remote commands: the output ended early ({len(outs)} of {len(argvs)} answered)")
    return [
        Result(tuple(argv), code, out, errs[i][1] if i < len(errs) else "")
        for i, (argv, (code, out)) in enumerate(zip(argvs, outs))
    ]


def _split(text: str, marker: str) -> list[tuple[int, str]]:
    parts = re.split(rf"\n{marker} (\d+)\n", text)
    return [(int(parts[i + 1]), parts[i]) for i in range(0, len(parts) - 1, 2)]


# ------------------------------------------------------------------ this machine


class _ProcessStream:
    """A local command's stdout as chunks; close() ends it (and its process group)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self._proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def __iter__(self) -> Iterator[bytes]:
        assert self._proc.stdout is not None
        while True:
            chunk = os.read(self._proc.stdout.fileno(), 65536)
            if not chunk:
                self._proc.wait()
                return
            yield chunk

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@dataclass(frozen=True)
class _SamePort:
    """On the login node itself there is nothing to forward."""

    local_port: int

    def close(self) -> None:
        pass


class LocalTransport:
    """This machine: the login node itself, the local cluster, the test suite's Slurm."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self._env = dict(env) if env is not None else None

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60.0,
        cwd: Optional[str] = None,
        stdin: Optional[bytes] = None,
        progress: Optional[Progress] = None,
    ) -> Result:
        try:
            done = subprocess.run(
                list(argv),
                capture_output=True,
                timeout=timeout,
                cwd=cwd,
                env=self._env,
                input=stdin if stdin is not None else b"",
                check=False,
            )
        except FileNotFoundError:
            raise ClusterError(
                f"{argv[0]}: command not found on this machine; is this a Slurm login node "
                f"(or should the cluster profile use `ssh:`)?"
            ) from None
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{argv[0]} did not answer within {timeout:.0f} s; is the scheduler up?") from None
        if progress is not None and stdin:
            progress(len(stdin), len(stdin))
        return Result(
            tuple(argv), done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        )

    def put(
        self,
        files: Mapping[str, Upload],
        dest: str,
        then: Sequence[str] = (),
        progress: Optional[Progress] = None,
        timeout: float = 600.0,
    ) -> Optional[Result]:
        total = sum(len(f.data) if isinstance(f.data, bytes) else f.data.stat().st_size for f in files.values())
        if os.path.exists(dest) and not os.path.isdir(dest):
            raise ClusterError(f"cannot write {dest}: it exists and is not a folder")
        self.makedirs(dest, mode=0o700)
        os.chmod(dest, 0o700)
        for rel, item in files.items():
            target = Path(dest) / rel
            if rel.endswith("/"):
                target.mkdir(parents=True, exist_ok=True, mode=item.mode)
                continue
            make_private_dir(target.parent)
            data = item.data.read_bytes() if isinstance(item.data, Path) else item.data
            self._write_bytes(target, data, item.mode)
        if progress is not None:
            progress(total, total)
        return self.run(then, timeout=timeout) if then else None

    def stream(self, argv: Sequence[str]) -> Stream:
        return _ProcessStream(argv)

    def forward(self, remote_port: int, local_port: int = 0) -> Forward:
        return _SamePort(remote_port)

    def write_text(self, path: str, text: str, mode: int = 0o600) -> None:
        self._write_bytes(Path(path), text.encode(), mode)

    @staticmethod
    def _write_bytes(target: Path, data: bytes, mode: int) -> None:
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)  # readers never see a half-written file

    def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                return handle.read(limit)
        except FileNotFoundError:
            return b""

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        if mode == DIR_MODE:
            make_private_dir(path)  # os.makedirs gives new parents the umask's mode (0755, or 0777 under 000)
            return
        missing = [p for p in [Path(path), *Path(path).parents] if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir(mode=mode, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        try:
            return os.path.getsize(path)
        except OSError:
            return 0

    def home(self) -> str:
        return os.path.expanduser("~")

    def close(self) -> None:
        pass
