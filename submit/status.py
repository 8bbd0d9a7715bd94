"""Job status: one round trip per cluster per refresh (per 1000 jobs).

For a Slurm cluster a single remote command (transport.batch) runs `squeue` for
the live jobs, one batched `sacct` for the rest and a `tail` of each run's
metrics.jsonl. A live squeue row wins while accounting trails it; with accounting
off (sacct fails) squeue --states=all alone answers, and a job slurmctld has
already forgotten keeps the last final state meshrun saw. Local-cluster jobs are
read from their run dir's state.json.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from submit import local, slurm
from submit.registry import JobRecord, Registry, now
from submit.errors import MeshrunError
from submit.transport import ConnectionLost, Result, Transport, batch

METRICS_FILE = "metrics.jsonl"
FINAL = slurm.SUCCESS | slurm.FAILURE
BATCH_JOBS = 1000


@dataclass(frozen=True)
class Status:
    job_id: str
    cluster: str
    name: str
    state: str
    run_dir: str
    submitted_at: float
    done: bool
    succeeded: bool
    elapsed_s: Optional[int] = None
    time_limit_s: Optional[int] = None
    restarts: int = 0
    reason: Optional[str] = None
    progress: dict[str, Any] = field(default_factory=dict)
    """The last metrics.jsonl line: step, loss, ... (empty before the first step)."""

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TransportSource(Protocol):
    def transport_for(self, record: JobRecord) -> Transport: ...


def parse_metrics_tail(text: str) -> dict[str, Any]:
    """The newest step line of a metrics.jsonl tail (a line being written is skipped), with the
    newest `checkpoint_step` from any line (checkpoint events are lines of their own)."""
    found: dict[str, Any] = {}
    checkpoint = None
    for line in reversed(text.splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            continue
        if checkpoint is None and row.get("checkpoint_step") is not None:
            checkpoint = row["checkpoint_step"]
        if not found and "event" not in row:
            found = row
        if found and checkpoint is not None:
            break
    if checkpoint is not None:
        found = {**found, "checkpoint_step": checkpoint}
    return found


def last_metrics(transport: Transport, run_dir: str) -> dict[str, Any]:
    """The newest complete line of metrics.jsonl (reads only the file's tail)."""
    path = f"{run_dir}/{METRICS_FILE}"
    size = transport.size(path)
    if not size:
        return {}
    return parse_metrics_tail(transport.read_bytes(path, max(0, size - 8192), 8192).decode(errors="replace"))


def _local_status(record: JobRecord, transport: Transport) -> Status:
    state = local.current_state(Path(record.run_dir))
    name = state.get("state", "UNKNOWN")
    started, ended = state.get("started"), state.get("ended")
    elapsed = int((ended or now()) - started) if started else None
    return Status(job_id=record.job_id, cluster=record.cluster, name=record.name, state=name,
                  run_dir=record.run_dir, submitted_at=record.submitted_at,
                  done=name in FINAL, succeeded=name in slurm.SUCCESS,
                  elapsed_s=elapsed, time_limit_s=state.get("time_limit_s"), reason=state.get("message") or None,
                  progress=last_metrics(transport, record.run_dir))


def query_argvs(records: Sequence[JobRecord]) -> list[list[str]]:
    """squeue, sacct, then one metrics tail per job: what the single round trip runs."""
    ids = [r.job_id for r in records]
    tails = [["tail", "-n", "4", "--", f"{r.run_dir}/{METRICS_FILE}"] for r in records]
    return [slurm.squeue_argv(ids), slurm.sacct_argv(ids), *tails]


def states_from(records: Sequence[JobRecord], squeue: Result, sacct: Result) -> dict[str, slurm.JobState]:
    """Merge both answers; raise only when neither scheduler command worked."""
    if squeue.returncode != 0 and sacct.returncode != 0 and "Invalid job id" not in squeue.stderr:
        sacct.check("sacct and squeue")
    acct = slurm.parse_sacct(sacct.stdout) if sacct.returncode == 0 else {}
    live = slurm.parse_squeue(squeue.stdout) if squeue.returncode == 0 else {}
    merged = slurm.merge_states([r.job_id for r in records], acct, live)
    for record in records:  # accounting off and slurmctld forgot the job: keep what meshrun last saw
        if merged[record.job_id].state == "UNKNOWN" and record.last_state in FINAL:
            merged[record.job_id] = slurm.JobState(job_id=record.job_id, state=record.last_state)
    return merged


def slurm_statuses(records: Sequence[JobRecord], transport: Transport) -> list[Status]:
    """The status of Slurm jobs on one cluster: ONE remote round trip per BATCH_JOBS jobs."""
    if len(records) > BATCH_JOBS:  # keeps one command line well under sshd's packet limit (256 KiB)
        return [s for i in range(0, len(records), BATCH_JOBS)
                for s in slurm_statuses(records[i:i + BATCH_JOBS], transport)]
    results = batch(transport, query_argvs(records), timeout=120)
    states = states_from(records, results[0], results[1])
    out = []
    for record, tail in zip(records, results[2:]):
        job = states[record.job_id]
        progress = parse_metrics_tail(tail.stdout) if tail.returncode == 0 else {}
        out.append(Status(job_id=record.job_id, cluster=record.cluster, name=record.name, state=job.state,
                          run_dir=record.run_dir, submitted_at=record.submitted_at, done=job.done,
                          succeeded=job.succeeded, elapsed_s=slurm.seconds(job.elapsed),
                          time_limit_s=slurm.seconds(job.time_limit),
                          restarts=max(job.restarts, int(progress.get("restart_count") or 0)),
                          reason=job.reason, progress=progress))
    return out


def _cluster_statuses(group: Sequence[JobRecord], transport: Transport) -> list[Status]:
    slurm_jobs = [r for r in group if r.scheduler == "slurm"]
    found = slurm_statuses(slurm_jobs, transport) if slurm_jobs else []
    return found + [_local_status(r, transport) for r in group if r.scheduler != "slurm"]


def _unreachable(record: JobRecord, why: str) -> Status:
    return Status(job_id=record.job_id, cluster=record.cluster, name=record.name, state="UNREACHABLE",
                  run_dir=record.run_dir, submitted_at=record.submitted_at, done=False, succeeded=False,
                  reason=why)


def statuses(records: Sequence[JobRecord], clusters: TransportSource,
             registry: Optional[Registry] = None) -> list[Status]:
    """The status of each record, in order: one round trip per Slurm cluster."""
    by_cluster: dict[str, list[JobRecord]] = defaultdict(list)
    for record in records:
        by_cluster[record.cluster].append(record)
    found: dict[tuple[str, str], Status] = {}
    for group in by_cluster.values():
        try:
            found_here = _cluster_statuses(group, clusters.transport_for(group[0]))
        except ConnectionLost:
            raise  # the caller reconnects
        except MeshrunError as exc:
            if len(by_cluster) == 1:
                raise
            # One unreachable cluster must not hide the others' jobs.
            found_here = [_unreachable(r, str(exc)) for r in group]
        for status in found_here:
            found[(status.cluster, status.job_id)] = status
    result = [found[(r.cluster, r.job_id)] for r in records]
    if registry is not None:
        for record, status in zip(records, result):
            if status.state != record.last_state and status.state != "UNKNOWN":
                registry.set_state(record, status.state)
    return result
