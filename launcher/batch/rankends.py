"""How a rank ended, in words: from an exit code (the local controller's record: -N for signal N) or from
srun's own line for a task (`srun: error: n1: task 0: Killed`). Torch-free, stdlib only: the batch script's
requeue decision reads srun's lines with it, the local supervisor its controller's record.

A rank killed by a signal writes nothing of its own, and its peers then fail with a collective's
"connection closed by peer": the first rank that died, and how, is what a person needs first.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Collection, Iterable, Optional


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, wherever it was read (srun's line for a task, the local controller's record)."""

    rank: int
    code: int
    """Its exit code; -N: killed by signal N (a command job's rank reports its program's death by N as 128 + N)."""
    time: float = 0.0
    """When, in seconds since the epoch; 0 where the source has no times (srun's lines come in order)."""
    node: str = ""
    """The node it ran on, where the source names it."""

    def words(self) -> str:
        """'rank 1 (on n1) was killed by SIGKILL ...', 'rank 0 exited with code 3'."""
        return f"rank {self.rank}{f' (on {self.node})' if self.node else ''} {how(self.code)}"


def first_death(ends: Iterable[RankEnd], clean: Collection[int] = ()) -> Optional[RankEnd]:
    """The first rank to end other than with a `clean` code: the earliest by time, the first given among equals."""
    bad = [end for end in ends if end.code not in clean]
    return min(bad, key=lambda end: end.time) if bad else None


def how(code: int) -> str:
    """A rank's end in words: 'was killed by SIGKILL ...' or 'exited with code 1'. A command job's rank
    reports its program's death by signal N as 128 + N, as a shell does."""
    if code < 0:
        return f"was killed by {signal_words(-code)}"
    if by_signal(code):
        return f"exited with code {code} (its program was killed by {signal_words(code - 128)})"
    return f"exited with code {code}"


def by_signal(code: int) -> bool:
    """Whether a rank's end (as `how` reads it) was a signal's, which leaves the rank no chance to say why."""
    return code < 0 or 128 < code < 128 + 65


def signal_words(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    if number == signal.SIGKILL:
        return f"{name} (kill -9, or the kernel's out-of-memory killer: see `dmesg`)"
    return name


_SRUN_TASK_END = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<task>\d+)(?:[-,]\S*)?: (?P<what>.+?)\s*$")
_EXITED = re.compile(r"^Exited with exit code (\d+)$")
_BY_DESCRIPTION = {signal.strsignal(s) or s.name: s for s in signal.Signals}
"""srun names a task's killing signal by its description ("Killed", "Terminated", "Segmentation fault")."""


def srun_code(what: str) -> Optional[int]:
    """srun's words for a task's end as an exit code (-N: signal N), None for words it does not know."""
    exited = _EXITED.match(what)
    if exited:
        return int(exited.group(1))
    sig = _BY_DESCRIPTION.get(what)
    return -int(sig) if sig is not None else None


def srun_ends(batch_log: str, attempt_line: str) -> list[RankEnd]:
    """The ends of tasks srun reported after `attempt_line` (this attempt's start line in the batch log), in order;
    srun reports only the tasks that ended badly."""
    start = batch_log.rfind(attempt_line)
    if start < 0:
        return []
    return [
        RankEnd(int(match.group("task")), code, node=match.group("node"))
        for line in batch_log[start:].splitlines()
        if (match := _SRUN_TASK_END.match(line)) and (code := srun_code(match.group("what"))) is not None
    ]


_SRUN_COMPLAINT = re.compile(r"^srun: (?:unrecognized option|invalid option|option requires|fatal: |error: )")
_SRUN_ARGV = re.compile(r"^srun: (?:unrecognized option|invalid option|option requires)")
"""srun refusing its own command line: the same script fails the same way at every start."""


def launch_failure(batch_log: str, attempt_line: str) -> Optional[str]:
    """srun's own complaint in this attempt when none of its tasks ended (the ranks never started): the first
    `srun: unrecognized option ...`, `srun: fatal: ...` or `srun: error: ...` line that is no task's end; None
    when a task ended (the ranks ran: their own errors say why) or srun said nothing."""
    start = batch_log.rfind(attempt_line)
    if start < 0:
        return None
    lines = batch_log[start:].splitlines()
    if any(_SRUN_TASK_END.match(line) for line in lines):
        return None
    return next((line.strip() for line in lines if _SRUN_COMPLAINT.match(line)), None)


def refused_argv(complaint: str) -> bool:
    """Whether srun refused its own options (a profile's srun flags it does not know, e.g. Pyxis's
    --container-image where Pyxis is not installed): no requeue can help."""
    return bool(_SRUN_ARGV.match(complaint))
