"""What a requeued job leaves out, and how many nodes it asks for: the one decision for a rank failure's or a
hang's requeue (meshrun.launcher.batch.requeue) and a failed health check's (meshrun.launcher.batch.gate), on the batch host. Torch-free,
stdlib only.

The nodes left out: those this end blames, those this allocation left earlier (spare nodes took their place) and
the ledger's suspects; a job with spares asks for fewer nodes (down to resources.nodes) when the partition cannot
spare those beside nodes + spares, so a requeue never lands on a node it just left.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from meshrun.launcher.contract.records import suspects
from meshrun.launcher.contract.records.rundir import job_of
from meshrun.launcher.rank.hostlist import expand_hostlist

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import RunSpec

LEFT_OUT_ENV = "MESHRUN_LEFT_OUT"
"""Set by the batch script of a job with spare nodes: the allocation's nodes its ranks no longer run on
(space-separated): they failed earlier in this allocation."""
Runner = Callable[[Sequence[str]], Optional[str]]
"""Runs a Slurm query; its stdout, or None when it failed (tests hand in recorded answers)."""


def run_slurm(argv: Sequence[str]) -> Optional[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def job_excluded(job: str, run: Runner) -> tuple[list[str], str]:
    """The job's excluded nodes and its partition, from `scontrol show job -o`."""
    out = run(["scontrol", "show", "job", "-o", job]) or ""
    fields = dict(word.split("=", 1) for word in out.split() if "=" in word)
    listed = fields.get("ExcNodeList", "(null)")
    return ([] if listed in ("", "(null)") else expand_hostlist(listed)), fields.get("Partition", "")


def partition_nodes(partition: str, run: Runner) -> list[str]:
    out = run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"]) if partition else None
    return sorted({line.strip() for line in (out or "").splitlines() if line.strip()})


@dataclass(frozen=True)
class Leaving:
    """What a requeued job leaves out and how many nodes it asks for (`leave_out`)."""

    reasons: Mapping[str, str]
    """Every node it would leave out (this end's, the allocation's earlier ones, the ledger's), and why."""
    before: tuple[str, ...]
    """The job's ExcNodeList before this requeue (Slurm's)."""
    excluded: tuple[str, ...]
    """Its ExcNodeList after it: `before` with the nodes it leaves out (the last set tried when none fits)."""
    room: int
    """The partition's nodes outside `excluded` (`asked` when Slurm did not name the partition's nodes)."""
    asked: int
    """The nodes this allocation has."""
    least: int
    """The fewest the requeued job may ask for: resources.nodes for a job with spares (they are given up), else
    `asked`."""

    @property
    def fits(self) -> bool:
        return self.room >= self.least

    @property
    def nodes(self) -> int:
        """How many nodes the requeued job asks for."""
        return min(self.room, self.asked)

    def fewer(self) -> str:
        """The clause the logs add when the requeued job asks for fewer nodes ('' when it does not)."""
        if not self.fits or self.nodes >= self.asked:
            return ""
        counted = f"{self.nodes} node" + ("s" if self.nodes != 1 else "")
        return (
            f"; it asks for {counted} instead of {self.asked}, its spares given up (the partition cannot spare the "
            f"nodes it leaves out beside {self.asked})"
        )


def leave_out(
    spec: Optional[RunSpec],
    blamed: Mapping[str, str],
    environ: Mapping[str, str],
    run: Runner = run_slurm,
    now: Optional[float] = None,
) -> Optional[Leaving]:
    """The one decision of what a requeued job leaves out, for a rank failure or hang (requeue_leaves_out) and for a
    failed health check (meshrun.launcher.batch.gate.judge): the nodes this end blames (`blamed`), the nodes this allocation left
    out earlier (spare nodes took their place: a failure, a hang or a health check blamed them) and the cluster's
    other suspects in the ledger (unless resilience.avoid_suspects is off); None when there are none.

    A job with spare nodes asks for nodes + spares again; when the partition cannot spare the nodes beside that
    many, it asks for fewer (down to resources.nodes), so the requeue cannot land on a node it just left. When not
    even that fits, the job's own nodes (this end's and the allocation's earlier ones) are tried without the
    ledger's, then this end's alone; `fits` is False when not even those fit."""
    job = job_of(environ) or "?"
    own = {**left_out_here(environ), **blamed}
    known: dict[str, str] = {}
    if spec is not None and spec.job.resilience.avoid_suspects and spec.run.suspects_file:
        rows = suspects.parse(_lines(spec.run.suspects_file))
        found = suspects.suspects(rows, time.time() if now is None else now, spec.job.resilience.forget_after_h * 3600)
        known = {node: f.evidence for node, f in found.items()}
    if not own and not known:
        return None
    asked = len(expand_hostlist(environ.get("SLURM_JOB_NODELIST", ""))) or 1
    spares = spec is not None and spec.job.resilience.spare_nodes > 0
    least = min(spec.job.resources.nodes, asked) if spec is not None and spares else asked
    excluded, partition = job_excluded(job, run)
    members = partition_nodes(partition, run)
    tiers: list[Mapping[str, str]] = []
    for wanted in ({**known, **own}, own, blamed):
        if wanted and set(wanted) not in [set(t) for t in tiers]:
            tiers.append(wanted)
    tried = [fitting(wanted, excluded, members, asked, least) for wanted in tiers]
    return replace(next((t for t in tried if t.fits), tried[-1]), reasons={**known, **own})


def left_out_here(environ: Mapping[str, str]) -> dict[str, str]:
    """The nodes this allocation's ranks no longer ran on (the batch script's MESHRUN_LEFT_OUT: a failure, a hang or
    a health check blamed them and a spare took their place): the job's own findings, left out of its requeue
    whatever resilience.avoid_suspects says, as the nodes this end blames are."""
    return {node: "left out of this allocation earlier" for node in environ.get(LEFT_OUT_ENV, "").split()}


def fitting(
    wanted: Mapping[str, str], excluded: Sequence[str], members: Sequence[str], asked: int, least: int
) -> Leaving:
    """The job's excluded nodes with `wanted` added, and the room the partition has beside them (a partition Slurm
    did not name is taken to have room): the requeued job asks for as many nodes as before when there is room for
    them, fewer (down to `least`: the spare nodes given up) when there is room for those (`Leaving.fits`)."""
    leaving = tuple(sorted({*excluded, *wanted}))
    room = len(set(members) - set(leaving)) if members else asked
    return Leaving(dict(wanted), tuple(sorted(excluded)), leaving, room, asked, least)


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
