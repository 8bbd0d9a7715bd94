"""How meshrun reaches a cluster: one small interface, a local and (later) an SSH implementation.

Commands are argv lists, never shell strings. The SSH transport (paramiko, a
later issue) implements the same methods, joining argv with shlex.join.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence

from submit.errors import ClusterError


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def check(self, what: str) -> "Result":
        if self.returncode != 0:
            detail = (self.stderr or self.stdout).strip().splitlines()
            last = detail[-1] if detail else f"exit code {self.returncode}"
            raise ClusterError(f"{what} failed: {last}")
        return self


class Transport(Protocol):
    """What `api` needs from a cluster connection."""

    def run(self, argv: Sequence[str], timeout: float = 60.0, cwd: Optional[str] = None) -> Result: ...

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None: ...

    def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes: ...

    def makedirs(self, path: str, mode: int = 0o700) -> None: ...

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def home(self) -> str: ...

    def close(self) -> None: ...


class LocalTransport:
    """This machine: the login node itself, the local cluster, the test suite's Slurm."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self._env = dict(env) if env is not None else None

    def run(self, argv: Sequence[str], timeout: float = 60.0, cwd: Optional[str] = None) -> Result:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                  cwd=cwd, env=self._env, check=False)
        except FileNotFoundError:
            raise ClusterError(f"{argv[0]}: command not found on this machine; is this a Slurm login node "
                               f"(or should the cluster profile use `ssh:`)?") from None
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{argv[0]} did not answer within {timeout:.0f} s; is the scheduler up?") from None
        return Result(tuple(argv), done.returncode, done.stdout, done.stderr)

    def write_text(self, path: str, text: str, mode: int = 0o644) -> None:
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text)
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
        os.makedirs(path, mode=mode, exist_ok=True)

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


def connect(ssh: object | None) -> Transport:
    """The transport for a cluster profile's `ssh` section (None: this machine)."""
    if ssh is None:
        return LocalTransport()
    raise ClusterError("this cluster profile has `ssh:`, and submission over SSH is not available in this "
                       "version yet; run meshrun on the login node (remove `ssh:`) for now")
