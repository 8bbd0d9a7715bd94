"""`submit -c any` / `-c a,b`: which of the clusters and partitions asked takes the job, and by which rule.

Slurm's estimate for an idle partition is the moment it was asked, and the partitions are asked seconds apart:
compared as they come, the first one asked would always win. So each estimate is read against the cluster's own
clock at the moment it answered (the wait, in seconds), waits within TIE_S of the soonest tie, and a tie is
broken on what matters to the user: the earlier predicted finish (the planner's run time where it knows one,
else the job's time limit), then the more free (idle) nodes in the partition, then the order written.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

TIE_S = 10.0
"""Starts this close tie: more than the seconds between the cluster's clock read and Slurm's answer (and
Slurm's own rounding), far less than any real wait in a queue."""


@dataclass(frozen=True)
class Candidate:
    """One cluster and partition a `-c any` submit asked, and its answer."""

    cluster: str
    """The profile's name."""
    partition: str
    start: Optional[str]
    """When it would start (Slurm's estimate, or `now` for a cluster that starts jobs at once); None: it cannot."""
    why: str
    """Slurm's estimate, or why the job cannot run there (the first failed check)."""
    given: str = ""
    """The profile as `-c` named it (a name or a file): what the submit then goes to."""
    step_s: Optional[float] = None
    """The planner's step time there (doctor's calibration first, else datasheet figures); None: unknown."""
    steps: int = 0
    """The job's train.steps: with step_s, how long it runs."""
    wait_s: Optional[float] = None
    """Seconds from the cluster's clock when it answered to its estimated start (0: at once); None: unknown."""
    limit_s: Optional[int] = None
    """The job's time limit there: how long it may run when the planner cannot say how long it will."""
    free_nodes: Optional[int] = None
    """Idle nodes in the partition when asked (`sinfo`); None: not known."""

    @property
    def ok(self) -> bool:
        return self.start is not None

    @property
    def run_s(self) -> Optional[float]:
        """How long the job would train there (steps x step time), when the step time is known."""
        return self.step_s * self.steps if self.step_s is not None else None

    @property
    def runs_s(self) -> Optional[float]:
        """How long it runs for the finish's prediction: the planner's run time, else the time limit."""
        return self.run_s if self.run_s is not None else self.limit_s


@dataclass(frozen=True)
class Choice:
    """The candidate taken and the rule that decided it, as the `-c any` table's last line says it."""

    candidate: Candidate
    rule: str


def wait_seconds(start: str, now: str) -> Optional[float]:
    """Slurm's estimated start less the cluster's clock (both the login node's local time, as `sbatch` and
    `date` print them), never below 0; None when either is not a date."""
    try:
        wait = (dt.datetime.fromisoformat(start) - dt.datetime.fromisoformat(now)).total_seconds()
    except ValueError:
        return None
    return max(0.0, wait)


def _wait(c: Candidate) -> Optional[float]:
    return 0.0 if c.start == "now" else c.wait_s


def _tied_on_start(ready: Sequence[Candidate]) -> list[Candidate]:
    """Those whose start ties with the soonest: waits within TIE_S of it; where no wait is known (an estimate
    without the cluster's clock), the same estimate (ISO dates compare as text)."""
    known = [c for c in ready if _wait(c) is not None]
    if known:
        best = min(w for c in known if (w := _wait(c)) is not None)
        return [c for c in known if (_wait(c) or 0.0) <= best + TIE_S]
    first = min(str(c.start) for c in ready)
    return [c for c in ready if c.start == first]


def _narrowed(tied: list[Candidate], key: Callable[[Candidate], float]) -> list[Candidate]:
    best = min(key(c) for c in tied)
    return [c for c in tied if key(c) == best]


def _finish_key(c: Candidate) -> float:
    runs = c.runs_s
    return float(round(runs)) if runs is not None else float("inf")


def _free_key(c: Candidate) -> float:
    return -float(c.free_nodes) if c.free_nodes is not None else 1.0  # more free first, unknown last


def _runs(c: Candidate) -> str:
    if c.run_s is not None:
        return f"runs {_span(c.run_s)} by the planner"
    return f"its time limit {_span(c.limit_s)}" if c.limit_s is not None else "run time unknown"


def _span(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def choose(found: Sequence[Candidate]) -> Optional[Choice]:
    """The candidate that starts first; of those that tie on start, the earlier predicted finish, then the more
    free nodes, then the one written first. None when none can run the job."""
    ready = [c for c in found if c.ok]
    if not ready:
        return None
    tied = _tied_on_start(ready)
    if len(tied) == 1:
        return Choice(tied[0], "the soonest start")
    rivals = ", ".join(f"{c.cluster}/{c.partition}" for c in tied)
    rules: list[str] = []
    finishing = _narrowed(tied, _finish_key)
    if len(finishing) < len(tied):
        others = sorted({_runs(c) for c in tied if c not in finishing})
        rules.append(f"earlier predicted finish ({_runs(finishing[0])}, against {'; '.join(others)})")
    free = _narrowed(finishing, _free_key)
    if len(free) < len(finishing):
        rules.append(f"more free nodes ({free[0].free_nodes} idle)")
    if len(free) > 1:
        rules.append("the first written")
    said = f"tie on start ({rivals} start within {TIE_S:.0f} s of each other)"
    return Choice(free[0], f"{said}: {', then '.join(rules)}")


def soonest(found: Sequence[Candidate]) -> Optional[Candidate]:
    """The chosen candidate (`choose`), without the rule."""
    chosen = choose(found)
    return chosen.candidate if chosen is not None else None
