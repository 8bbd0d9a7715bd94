"""Signals to a process named by a pid from a file: only to that very process, and only inside the job.

A pid read from a file (a heartbeat, a state file, a pid file) may name another process by the time it
is read: pids are reused, and a job's processes share their machine and user with others (on the
testbed both slurmds and every job run as root on one host; on a login node, a user's other jobs and
servers). Every place meshrun signals a process it did not just start itself goes through here:

- `Identity` is a pid plus the kernel's start time of that process; `process_identity(pid)` reads it,
  `own_identity()` is this process's, and a pid file holds both (`write_pid_file`, `read_pid_file`).
- `signal_if_same(identity, sig, job=...)` signals only if the pid still names the process that was
  recorded (same start time) and, given a `JobScope`, only if that process belongs to the job (its
  environment carries the job's id: SLURM_JOB_ID on Slurm, MESHRUN_JOB_ID on `local`).
- `signal_group_if_same(leader, sig, job=...)` is the same for a process group led by `leader`.

Every other read of a process (its state, argv, children, start) goes through here too, on psutil: no other
module reads /proc/PID/ by hand (tests/unit/test_procs.py guards it, and lists the exceptions with their reasons).

Torch-free; psutil only (a dependency of meshrun, small, on every platform meshrun runs), imported inside the
functions that use it: `own_identity` reads /proc alone on Linux, because report() runs in a command job's own
Python (RUN_DIR/.meshrun/pylib), which may have nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional

SLURM_JOB_ENV = "SLURM_JOB_ID"
LOCAL_JOB_ENV = (
    "MESHRUN_JOB_ID"  # meshrun.launcher.contract.records.rundir.JOB_ID_ENV: every process of a `local` job has it
)

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Identity:
    """One process, for as long as it lives: its pid and the kernel's record of when it started.

    `started_at` is opaque: compare it only with another `started_at` read on the same machine. On Linux
    it is the start time in seconds since boot, exact (clock ticks from /proc/PID/stat: no wall-clock or
    boot-time drift between two readers); elsewhere psutil's create_time.
    """

    pid: int
    started_at: float

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "started_at": self.started_at}

    @staticmethod
    def from_json(data: Any) -> Optional[Identity]:
        """The identity a JSON object records ({"pid", "started_at"}), or None when it records none."""
        if not isinstance(data, Mapping):
            return None
        pid, started = data.get("pid"), data.get("started_at")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return None
        if isinstance(started, bool) or not isinstance(started, (int, float)):
            return None
        return Identity(pid, float(started))


@dataclass(frozen=True)
class JobScope:
    """A job, as its processes carry it in their environment: `key`=`value` (e.g. SLURM_JOB_ID=123)."""

    key: str
    value: str


def current_job(environ: Mapping[str, str] = os.environ) -> Optional[JobScope]:
    """The job this process runs in: Slurm's job id, else a `local` job's meshrun id; None outside a job."""
    for key in (SLURM_JOB_ENV, LOCAL_JOB_ENV):
        if environ.get(key):
            return JobScope(key, environ[key])
    return None


def _start_time(pid: int) -> Optional[float]:
    """The kernel's start time of `pid` (see Identity.started_at), or None when no such process runs."""
    if pid <= 0:
        return None
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # comm, in parentheses, may hold anything
            return int(fields[19]) / _TICKS  # field 22 of stat(5): starttime, in clock ticks since boot
        except (OSError, IndexError, ValueError):
            return None
    import psutil  # only off Linux: see the module's docstring

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def process_identity(pid: int) -> Optional[Identity]:
    """The identity of the process `pid` names now, or None when none does."""
    started = _start_time(pid)
    return None if started is None else Identity(pid, started)


def own_identity() -> Identity:
    """This process's identity (what a heartbeat or pid file records)."""
    identity = process_identity(os.getpid())
    assert identity is not None  # this process runs
    return identity


def same_process(pid: int, started_at: float) -> bool:
    """Whether `pid` still names the process that started at `started_at` (not a reuse of its pid)."""
    started = _start_time(pid)
    return started is not None and abs(started - started_at) < 0.5 / _TICKS


def alive(identity: Identity) -> bool:
    """Whether the recorded process still runs (a zombie, ended but not yet reaped, does not)."""
    import psutil  # here, not at the top: see the module's docstring

    if not same_process(identity.pid, identity.started_at):
        return False
    try:
        return bool(psutil.Process(identity.pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def in_job(pid: int, job: JobScope) -> bool:
    """Whether process `pid` carries `job` in its environment (False when it cannot be read: not ours)."""
    import psutil  # here, not at the top: see the module's docstring

    try:
        return bool(psutil.Process(pid).environ().get(job.key) == job.value)
    except (psutil.Error, OSError):
        return False


def descendant_of(pid: int, ancestor: Identity) -> bool:
    """Whether `pid` is a child, grandchild... of the (still same) process `ancestor`."""
    import psutil  # here, not at the top: see the module's docstring

    if not same_process(ancestor.pid, ancestor.started_at):
        return False
    try:
        return any(parent.pid == ancestor.pid for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def signal_if_same(identity: Identity, sig: int, job: Optional[JobScope] = None) -> bool:
    """Send `sig` to the recorded process only if its pid still names it and (given `job`) it belongs to
    that job. True if sent; False when the process is gone or the pid now names another process.
    Raises PermissionError when the process is ours to name but not to signal."""
    import psutil  # here, not at the top: see the module's docstring

    if not same_process(identity.pid, identity.started_at):
        return False
    if job is not None and not in_job(identity.pid, job):
        return False
    try:
        # psutil checks once more, at the signal itself, that the pid was not reused since it looked.
        psutil.Process(identity.pid).send_signal(sig)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied as exc:
        raise PermissionError(f"pid {identity.pid}: {exc}") from None
    return True


def signal_group_if_same(leader: Identity, sig: int, job: Optional[JobScope] = None) -> bool:
    """Send `sig` to the process group that `leader` started (its pgid is the leader's pid), leader alive
    or not, unless the pid now names another process (then the group is another's). The kernel never
    reuses a pid while a process group of that id still has members, so a group whose leader is gone
    holds only the leader's own descendants. Given `job`, some member must belong to it."""
    current = _start_time(leader.pid)
    if current is not None and abs(current - leader.started_at) >= 0.5 / _TICKS:
        return False  # the pid is another process's now: so is any group of that id
    members = group_members(leader.pid)
    if not members:
        return False
    if job is not None and not any(in_job(pid, job) for pid in members):
        return False
    try:
        os.killpg(leader.pid, sig)
    except ProcessLookupError:
        return False
    return True


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    import psutil  # here, not at the top: see the module's docstring

    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def others_in_job(job: JobScope) -> list[int]:
    """The live processes of `job` on this machine other than this process, its ancestors (who started it:
    a keeper, the local supervisor, a batch shell) and its descendants (its own helpers): the job's ranks
    and what they run, as far as this process can tell without their heartbeats."""
    import psutil  # here, not at the top: see the module's docstring

    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents()), *(p.pid for p in me.children(recursive=True))}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in mine and proc.status() != psutil.STATUS_ZOMBIE and in_job(proc.pid, job):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def children(pid: int) -> list[int]:
    """The direct children of `pid` ([] once it is gone)."""
    import psutil  # here, not at the top: see the module's docstring

    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def write_pid_file(path: str, identity: Optional[Identity] = None) -> None:
    """Record `identity` (default: this process) in `path`, 0600, replaced atomically."""
    data = json.dumps((identity or own_identity()).to_json())
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(data)
    os.replace(tmp, path)


def read_pid_file(path: str) -> Optional[Identity]:
    """The identity `path` records, or None when it is missing, unreadable or records none (a bare pid:
    without its start time a pid cannot be told from its reuse, so it is never signalled)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return Identity.from_json(json.loads(handle.read()))
    except (OSError, ValueError):
        return None


def command_line(pid: int) -> Optional[list[str]]:
    """The process's argv, or None when it is gone or cannot be read."""
    import psutil  # here, not at the top: see the module's docstring

    try:
        return list(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return None


ENDED = ("zombie", "dead")
"""psutil.STATUS_ZOMBIE and psutil.STATUS_DEAD: the states (`state`) of a process that has ended but is not yet
reaped, or is being reaped."""


def state(pid: int) -> Optional[str]:
    """The process's state as psutil names it ("running", "sleeping"... or one of ENDED), or None when it is
    gone or cannot be read."""
    import psutil  # here, not at the top: see the module's docstring

    if pid <= 0:
        return None
    try:
        return str(psutil.Process(pid).status())
    except (psutil.Error, OSError):
        return None


def started_wall(pid: int) -> Optional[float]:
    """When the process started, in seconds since the epoch (psutil's create_time: for comparing with a
    wall-clock time such as a job's submit time; to tell a process from a reuse of its pid, use Identity)."""
    import psutil  # here, not at the top: see the module's docstring

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for `signum` (SigCgt in /proc/PID/status: the one fact here
    psutil does not give). A warning signal it does not catch would kill it (SIGUSR1's default action); False
    when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as handle:
            caught = next((line.split()[1] for line in handle if line.startswith("SigCgt:")), "0")
    except OSError:
        return False
    return bool(int(caught, 16) >> (signum - 1) & 1)
