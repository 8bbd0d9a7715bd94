"""report(): metrics, TensorBoard and the progress heartbeat from any training script. Torch-free.

    from meshrun.launcher.report import report
    report(step, loss=loss, lr=lr)        # every rank may call it; rank 0 records the numbers

Under meshrun ($MESHRUN_RUN_DIR set by the job script) rank 0 appends {"step", ...scalars,
"time"} to RUN_DIR/metrics.jsonl (what `meshrun status` and the logs read) and writes the
same scalars to RUN_DIR/tensorboard/; every rank stamps its heartbeat in its node's
NodeDir (progress/rank-N.json = {"rank", "step", "phase", "time", "pid", ...}: what hang detection
reads) and arms a stack dump on SIGUSR2 for the sidecar's diagnosis. The built-in trainer stamps the same heartbeat through `Heartbeat`. Outside meshrun
report() does nothing and says so once. Rank 0 also keeps the highest step reported so far in
RUN_DIR/.meshrun/reported-step.json (`ProgressMark`): what the requeue policy (meshrun.launcher.batch.requeue) calls progress.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, MutableMapping, Optional, TextIO

from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.procs import own_identity
from meshrun.launcher.contract.records.rundir import (
    NODE_DIR_ENV,
    NodeDir,
    RunDir,
    job_field,
    node_name,
    read_state,
    write_json,
)
from meshrun.launcher.train.tbwriter import ScalarWriter, scalars_of

RUN_DIR_ENV = "MESHRUN_RUN_DIR"
RESTART_COUNT_ENV = "MESHRUN_RESTART_COUNT"
"""A command job's run number (meshrun.launcher.rank.entry sets it); a requeued run's metrics lines carry it, so status counts it."""
PHASES = ("rendezvous", "setup", "step", "eval", "checkpoint")
"""What a rank is doing; each may get its own hang timeout ("rendezvous": waiting for the other ranks to join,
judged across nodes by launcher/sidecar/rendezvous.py; its own timeout is setup's)."""


def rank_from_env(environ: Optional[dict[str, str]] = None) -> int:
    """The global rank (torchrun's RANK, else Slurm's SLURM_PROCID, else 0)."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK") or env.get("SLURM_PROCID") or 0)


def expose_to_commands(run_dir: str, environ: MutableMapping[str, str]) -> None:
    """Let a `command:` job's own python import meshrun.launcher.report, whichever python3 its PATH finds.

    A folder holding only meshrun/launcher, a link to this package, joins the END of PYTHONPATH: the
    user's own entries keep precedence, no other package of meshrun's environment leaks in, and a python
    that has meshrun installed still sees all of it (meshrun is a namespace package: the two merge).
    Every rank rewrites the link atomically (a requeued job may run another install).
    """
    lib = RunDir(run_dir).pylib
    make_private_dir(lib)
    portion = os.path.join(lib, "meshrun")
    make_private_dir(portion)
    tmp = os.path.join(portion, f".launcher.{os.getpid()}.tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.dirname(os.path.abspath(__file__)), tmp, target_is_directory=True)
    os.replace(tmp, os.path.join(portion, "launcher"))
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if lib not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([*paths, lib])


def node_dir_from_env(run_dir: str) -> NodeDir:
    """This node's NodeDir: $MESHRUN_NODE_DIR (every rank of a meshrun job has it), else the run dir's."""
    given = os.environ.get(NODE_DIR_ENV, "")
    return NodeDir(given) if given else RunDir(run_dir).node_dir("", node_name(os.environ))


STACK_SIGNAL = signal.SIGUSR2
"""On this signal a rank writes every thread's Python stack to its NodeDir.stack file (faulthandler, in C:
it works while the rank is stuck in a collective). The sidecar sends it only to a pid whose heartbeat
names it, so a program that never registered the handler is never signalled."""


class Heartbeat:
    """One rank's progress file, replaced atomically (a reader never sees half a file).

    It also arms the stack dump: faulthandler writes to the open stack file on STACK_SIGNAL.
    """

    def __init__(self, run_dir: str, rank: int) -> None:
        self.rank = rank
        node = node_dir_from_env(run_dir)
        self.path = node.progress(rank)
        self._tmp = f"{self.path}.{os.getpid()}.tmp"
        make_private_dir(os.path.dirname(self.path))
        self.stack_signal = self._arm_stack_dump(node.stack(rank))
        # With the pid, what tells this rank from a later process that reuses its pid: the sidecar signals
        # a pid from this file only while it still names this very process (meshrun.launcher.contract.procs).
        self.started_at = own_identity().started_at

    def _arm_stack_dump(self, path: str) -> Optional[int]:
        if threading.current_thread() is not threading.main_thread():
            return None  # faulthandler.register is process-wide but must be called where signals are allowed
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self._stack_file = os.fdopen(fd, "w", encoding="utf-8")  # kept open: the C handler writes to its fd
            faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError):
            return None
        return int(STACK_SIGNAL)

    def stamp(self, step: int, phase: str = "step", busy_s: Optional[float] = None) -> None:
        """Record that this rank reached `step` in `phase`; `busy_s`: its own work time in the last step
        (what straggler detection compares; synchronous training makes every rank's wall time the same)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r}: use one of {', '.join(PHASES)}")
        beat: dict[str, Any] = {"rank": self.rank, "step": int(step), "phase": phase, "time": time.time()}
        beat["pid"] = os.getpid()
        beat["started_at"] = self.started_at
        if self.stack_signal is not None:
            beat["stack_signal"] = self.stack_signal
        if busy_s is not None:
            beat["busy_s"] = round(float(busy_s), 6)
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(beat))
        os.replace(self._tmp, self.path)


def open_metrics(run_dir: str) -> TextIO:
    """RUN_DIR/metrics.jsonl for appending (restarts add to it), 0600 whatever the umask."""
    make_private_dir(run_dir)
    fd = os.open(RunDir(run_dir).metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8")


def reported_step(run_dir: str) -> Optional[int]:
    """The highest step rank 0 ever gave report() in this run dir (across restarts); None before the first."""
    step = read_state(RunDir(run_dir).reported_step).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class ProgressMark:
    """Rank 0's high-water mark of reported steps: only ever raised (a resumed run that reports steps it
    already did before its crash is not progress), written at most once per MARK_EVERY_S (the run dir is
    on shared storage) and on close."""

    MARK_EVERY_S = 1.0

    def __init__(self, run_dir: str) -> None:
        self.path = RunDir(run_dir).reported_step
        known = reported_step(run_dir)
        self.step = -1 if known is None else known
        self.unwritten = False
        self.written_at = 0.0

    def note(self, step: int) -> None:
        if step <= self.step:
            return
        self.step, self.unwritten = int(step), True
        if time.monotonic() - self.written_at >= self.MARK_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.unwritten:
            write_json(self.path, {"step": self.step, "time": time.time()})
            self.unwritten, self.written_at = False, time.monotonic()


class Reporter:
    """What report() writes for one run dir: the heartbeat (every rank), metrics, TensorBoard and the
    progress mark (rank 0)."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.heartbeat = Heartbeat(run_dir, rank)
        self.metrics: Optional[TextIO] = open_metrics(run_dir) if rank == 0 else None
        self.board = ScalarWriter(RunDir(run_dir).tensorboard) if rank == 0 else None
        self.mark = ProgressMark(run_dir) if rank == 0 else None
        restarts = os.environ.get(RESTART_COUNT_ENV, "")
        self.restart = {"restart_count": int(restarts)} if restarts.isdigit() and int(restarts) else {}
        self.job = job_field(os.environ)

    def report(self, step: int, phase: str, scalars: dict[str, float]) -> None:
        self.heartbeat.stamp(step, phase)
        if self.mark is not None:
            self.mark.note(step)
        if self.metrics is None or self.board is None or not scalars:
            return
        now = time.time()
        clean = {k: (v if math.isfinite(v) else None) for k, v in scalars.items()}  # strict JSON: no NaN
        self.metrics.write(json.dumps({"step": int(step), **clean, **self.restart, "time": now, **self.job}) + "\n")
        self.metrics.flush()
        self.board.add(int(step), scalars_of(scalars), now)

    def close(self) -> None:
        if self.mark is not None:
            self.mark.flush()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.board is not None:
            self.board.close()


_reporters: dict[str, Reporter] = {}
_warned = False


def _numbers(scalars: dict[str, Any]) -> dict[str, float]:
    """Every value as a float (a 0-dim tensor or numpy number converts too); a non-number names its key."""
    out = {}
    for key, value in scalars.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"report(): {key}={value!r} is not a number; pass numbers as keyword arguments") from None
    return out


def report(step: int, *, phase: str = "step", **scalars: Any) -> None:
    """Record `scalars` at `step` (rank 0) and stamp this rank's heartbeat (every rank).

    Non-finite values are kept out of TensorBoard and written as null to metrics.jsonl.
    """
    global _warned
    run_dir = os.environ.get(RUN_DIR_ENV, "")
    if not run_dir:
        if not _warned:
            print(
                f"[meshrun] report(): ${RUN_DIR_ENV} is not set (not a meshrun job): nothing is recorded",
                file=sys.stderr,
            )
            _warned = True
        return
    numbers = _numbers(scalars)
    reporter = _reporters.get(run_dir)
    if reporter is None:
        reporter = _reporters[run_dir] = Reporter(run_dir, rank_from_env())
    reporter.report(step, phase, numbers)


@atexit.register
def _close_all() -> None:
    """Flush the event files of a script that simply ends (its last points would be lost otherwise)."""
    for reporter in _reporters.values():
        reporter.close()
    _reporters.clear()
