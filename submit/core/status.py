"""Job status: one round trip per cluster per refresh, whatever the scheduler.

Records are grouped by cluster, and each group asks its scheduler backend once (for
Slurm: squeue, one batched sacct and every run's metrics tail in a single remote
command). One unreachable cluster never hides the others' jobs; a changed host key is
shown to the person, not only as UNREACHABLE.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.core.state import FINAL, SUCCESS, JobState
from meshrun.submit.errors import ConnectionLost, MeshrunError
from meshrun.submit.transport.base import Transport

METRICS_FILE = RunDir.METRICS


@dataclass(frozen=True)
class Status:
    job_id: str
    cluster: str
    name: str
    state: JobState
    """meshrun's word for it, whatever the scheduler's (submit/core/state.py)."""
    run_dir: str
    submitted_at: float
    done: bool
    succeeded: bool
    elapsed_s: Optional[int] = None
    elapsed_as_of: Optional[float] = None
    """Unix time `elapsed_s` was seen when the cluster cannot be reached now (the registry's last value); None when
    it is today's."""
    time_limit_s: Optional[int] = None
    restarts: int = 0
    """Slurm's requeues of the job (its restart count)."""
    restarts_in_job: int = 0
    """Restarts inside the allocation, on spare nodes (resilience.spare_nodes), from the job's goodput record."""
    reason: Optional[str] = None
    progress: dict[str, Any] = field(default_factory=dict)
    """The last metrics.jsonl line: step, loss, ... (empty before the first step)."""
    exit_code: Optional[int] = None
    """The job's exit code once it ended (2: bad input), when the scheduler knows it."""
    verdict: Optional[dict[str, Any]] = None
    """A hang's verdict (RUN_DIR/diagnosis/verdict.json: "time", "step", "phase", "verdict", "ranks", ...)."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Ranks persistently slower than the median: [{"rank", "node", "busy_s", "ratio"}]."""
    best_checkpoint: Optional[dict[str, Any]] = None
    """{"step", "val_loss"} of the checkpoint checkpoint.keep_best keeps (one job's detail view only)."""
    env_mismatches: list[str] = field(default_factory=list)
    """Versions that differ between the nodes (asked for one job's detail view only; else [])."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """The job's newest alerts (RUN_DIR/alerts.jsonl records: time, step, rule, value, threshold, rank, node,
    message), oldest first."""
    losses: list[Optional[float]] = field(default_factory=list)
    """The recent steps' losses, oldest first (None: non-finite); asked for by `meshrun top` only."""
    gpus: list[dict[str, Any]] = field(default_factory=list)
    """The newest gpu.jsonl sample of each GPU (util_pct, mem_used_mib, mem_total_mib, ...); `top` only."""
    steps: Optional[int] = None
    """The trainer's total steps (from spec.json; one job's detail view and `top` only)."""
    engine: Optional[str] = None
    """The trainer's engine, e.g. 'deepspeed ZeRO-2, optimizer offload' (from spec.json; one job's detail view
    and `top` only; None for a command job)."""
    goodput: Optional[dict[str, Any]] = None
    """Where the job's allocated time went ({"allocated_s", "parts_s", "effective_pct", "lost_steps",
    "queue_s", "requeue_s", "running", "attempts", ...}: launcher/contract/records/goodput.py), as of its newest
    attempt's start or end."""
    run_goodput: Optional[dict[str, Any]] = None
    """The run dir's total over its jobs (a resume in the run dir is a job of its own) when it has more than one:
    {"jobs", "allocated_s", "productive_s", "lost_steps", "effective_pct"}."""
    chosen: Optional[str] = None
    """Why the job went to this cluster and partition, when `submit -c any` (or `-c a,b`) chose it."""
    usage: Optional[dict[str, Any]] = None
    """What the job used so far (submit/core/usage.py: GPU-hours, energy, cost; one job's detail view and `top`)."""

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TransportSource(Protocol):
    def transport_for(self, record: JobRecord) -> Transport: ...


class StatusReader(Protocol):
    """What status asks of a scheduler backend (submit/schedulers/base.py's Backend has it)."""

    def statuses(
        self, records: Sequence[JobRecord], transport: Transport, detail: bool = False, live: bool = False
    ) -> list[Status]: ...


Schedulers = Callable[[str], StatusReader]
"""The backend of a record's `scheduler`, handed in (api.statuses hands in schedulers.backend): status never
looks a scheduler up."""


def of_job(row: Mapping[str, Any], job_id: Optional[str]) -> bool:
    """Whether a record line is this job's: a resume appends to its parent's run dir under a new id (lines
    without an id come from before ids were written, or from outside a job, and count for any)."""
    return job_id is None or row.get("job") in (None, job_id)


def parse_metrics_tail(text: str, job_id: Optional[str] = None) -> dict[str, Any]:
    """The newest step line of a metrics.jsonl tail (a line being written is skipped), with the
    highest `checkpoint_step` of any line (checkpoint events are lines of their own) and the newest
    `val_loss` with its `val_step` (evaluations are every eval_every steps), and `stopped`: the newest stop that was
    no finish when no step line came after it ("stopped by preemption at step 40"); `job_id`: that job's lines only."""
    found: dict[str, Any] = {}
    checkpoint, validated, stopped = None, None, None
    for line in reversed(text.splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or not of_job(row, job_id):
            continue
        # A save staged on node-local scratch is not a checkpoint yet: the sidecar's "copied" event is. The
        # highest, not the newest line: a copier's backlog can commit an older step after a newer one.
        step = row.get("checkpoint_step")
        if isinstance(step, int) and not isinstance(step, bool) and not row.get("staged"):
            checkpoint = step if checkpoint is None else max(checkpoint, step)
        if not found and stopped is None and row.get("event") == "stopped" and isinstance(row.get("why"), str):
            stopped = row[
                "why"
            ]  # a stop that was no finish (meshrun.launcher.batch.requeue), with no step line after it
        if not found and "event" not in row:
            found = row
        if validated is None and "val_loss" in row and "event" not in row:
            validated = {"val_loss": row["val_loss"], "val_step": row.get("step")}
    if checkpoint is not None:
        found = {**found, "checkpoint_step": checkpoint}
    if validated is not None and found:
        found = {**found, **validated}
    if stopped is not None:
        found = {**found, "stopped": stopped}
    return found


HISTORY_LINES = 60
"""`meshrun top`'s loss history: the newest metrics lines it fetches (a few kB per job)."""


def parse_losses(text: str, job_id: Optional[str] = None) -> list[Optional[float]]:
    """The step lines' losses of a metrics tail, oldest first (None for a diverged step's null loss)."""
    losses: list[Optional[float]] = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "event" not in row and "loss" in row and of_job(row, job_id):
            loss = row["loss"]
            ok = isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)
            losses.append(float(loss) if ok else None)
    return losses[-HISTORY_LINES:]


METRICS_TAIL_BYTES = 8192
"""How much of metrics.jsonl's end status reads: bytes, not lines, so that the newest step line is in it
however many event lines (checkpoint staged / copied, one per node's copy) the sidecars appended after it.
(Four lines were read on Slurm: after a run's last step its copy events filled them, and a finished job
showed no step and no restart.) A partial first line is skipped by the parsers."""
METRICS_HISTORY_BYTES = 65536
"""With `live` (`meshrun top`): enough for the loss history."""


def metrics_tail_bytes(live: bool = False) -> int:
    return METRICS_HISTORY_BYTES if live else METRICS_TAIL_BYTES


def metrics_tail(transport: Transport, run_dir: str, live: bool = False) -> str:
    """The tail of metrics.jsonl: its last METRICS_TAIL_BYTES (with `live`, enough for the loss history)."""
    path = RunDir(run_dir).metrics
    size = transport.size(path)
    if not size:
        return ""
    want = metrics_tail_bytes(live)
    return transport.read_bytes(path, max(0, size - want), want).decode(errors="replace")


def last_metrics(transport: Transport, run_dir: str) -> dict[str, Any]:
    """The newest complete line of metrics.jsonl (reads only the file's tail)."""
    return parse_metrics_tail(metrics_tail(transport, run_dir))


def _unreachable(record: JobRecord, why: str) -> Status:
    return Status(
        job_id=record.job_id,
        cluster=record.cluster,
        name=record.name,
        state=JobState.UNREACHABLE,
        run_dir=record.run_dir,
        submitted_at=record.submitted_at,
        done=False,
        succeeded=False,
        reason=why,
        elapsed_s=record.last_elapsed_s,  # the last known value, shown with its age, not '-'
        elapsed_as_of=record.last_seen_at if record.last_elapsed_s is not None else None,
    )


def _kept_or_unreachable(record: JobRecord, why: str) -> Status:
    """A job whose cluster cannot be reached now: the final state meshrun saw before, when it had ended
    (it will not change: its step, loss and checkpoint stay shown), else UNREACHABLE with the reason."""
    known = next((state for state in FINAL if state.value == record.last_state), None)
    if known is None:
        return _unreachable(record, why)
    return Status(
        job_id=record.job_id,
        cluster=record.cluster,
        name=record.name,
        state=known,
        run_dir=record.run_dir,
        submitted_at=record.submitted_at,
        done=True,
        succeeded=known in SUCCESS,
        elapsed_s=record.last_elapsed_s,  # seen with its final state: it will not change either
        restarts=record.last_restarts or 0,
        restarts_in_job=record.last_restarts_in_job or 0,
    )


def _cluster_statuses(
    group: Sequence[JobRecord], transport: Transport, schedulers: Schedulers, detail: bool, live: bool
) -> list[Status]:
    by_scheduler: dict[str, list[JobRecord]] = defaultdict(list)
    for record in group:
        by_scheduler[record.scheduler].append(record)
    return [
        s
        for name, records in by_scheduler.items()
        for s in schedulers(name).statuses(records, transport, detail=detail, live=live)
    ]


def warn_to_stderr(message: str) -> None:
    print(f"meshrun: warning: {message}", file=sys.stderr)


def with_chosen(record: JobRecord, status: Status) -> Status:
    """The status with the registry's word on why its cluster was chosen (`submit -c any`), if it has one."""
    return dataclasses.replace(status, chosen=record.chosen) if record.chosen else status


def statuses(
    records: Sequence[JobRecord],
    clusters: TransportSource,
    schedulers: Schedulers,
    registry: Optional[Registry] = None,
    warn: Callable[[str], None] = warn_to_stderr,
    detail: bool = False,
    live: bool = False,
) -> list[Status]:
    """The status of each record, in order: one round trip per cluster. `detail` also compares
    the nodes' environment records (one job's view: the records of many jobs would be a lot to fetch);
    `live` also brings the loss history and the newest GPU samples (`meshrun top`), in the same trip.
    `schedulers` gives each record's backend (api.statuses hands in schedulers.backend)."""
    by_cluster: dict[str, list[JobRecord]] = defaultdict(list)
    for record in records:
        by_cluster[record.profile or record.cluster].append(record)  # the profile file: one cluster
    found: dict[tuple[str, str], Status] = {}
    for cluster, group in by_cluster.items():
        try:
            found_here = _cluster_statuses(group, clusters.transport_for(group[0]), schedulers, detail, live)
        except ConnectionLost:
            raise  # the caller reconnects
        except MeshrunError as exc:
            kept = [_kept_or_unreachable(r, str(exc)) for r in group]
            alone = len(by_cluster) == 1
            if alone and all(s.state == JobState.UNREACHABLE for s in kept):
                raise  # nothing to show: the error is the answer
            # One unreachable cluster must not hide the others' jobs, nor the ends meshrun saw before; and the
            # person must know its rows are what status saw last (a new user's trial read a stale RESTARTS as today's).
            warn(f"{cluster}: {exc}" if alone else f"{cluster}: {exc} (its jobs show what status saw last)")
            found_here = kept
        for status in found_here:
            found[(status.cluster, status.job_id)] = status
    result = [with_chosen(r, kept_at_end(r, found[(r.cluster, r.job_id)])) for r in records]
    if registry is not None:
        for record, status in zip(records, result):
            if _news_for_the_registry(record, status):
                final = status.done and bool(status.progress)
                reason = status.reason if status.done else None
                restarts = (status.restarts, status.restarts_in_job) if status.done else None
                progress = json.dumps(status.progress) if final else None
                registry.set_state(record, status.state.value, progress, reason, restarts)
        registry.set_seen(seen_elapsed(records, result), time.time())
    return result


def _news_for_the_registry(record: JobRecord, status: Status) -> bool:
    """A state meshrun has not recorded yet, or an ended job's reason or restarts read after its end was seen
    (Slurm's accounting may say FAILED before the batch log's last line is there)."""
    if status.state in (JobState.UNKNOWN, JobState.UNREACHABLE) or status.elapsed_as_of is not None:
        return False
    if status.state.value != record.last_state:
        return True
    return status.done and (
        (status.reason is not None and status.reason != record.last_reason)
        or (status.restarts, status.restarts_in_job) != (record.last_restarts or 0, record.last_restarts_in_job or 0)
    )


def seen_elapsed(records: Sequence[JobRecord], result: Sequence[Status]) -> list[tuple[JobRecord, int]]:
    """The ELAPSED values this refresh read from the clusters themselves (not a kept or unreachable one)."""
    return [
        (record, status.elapsed_s)
        for record, status in zip(records, result)
        if status.elapsed_s is not None
        and status.elapsed_as_of is None
        and status.state is not JobState.UNREACHABLE
        and not (status.done and status.elapsed_s == record.last_elapsed_s)
    ]


def kept_at_end(record: Any, status: Status) -> Status:
    """A finished job shows what status saw when it ended wherever today's reading has less: a resume in the same
    run dir pushes its lines out of the metrics tail (its loss went '-') and removes the run dir's rank error (its
    reason went). What is still read (its goodput record's step and checkpoint) is kept over it."""
    if not status.done:
        return status
    try:
        kept = json.loads(record.last_progress or "{}")
    except ValueError:
        kept = {}
    progress = {**kept, **status.progress} if isinstance(kept, dict) else status.progress
    return dataclasses.replace(status, progress=progress, reason=status.reason or record.last_reason)
