"""The only module that both plans and talks to a cluster.

submit = plan (pure, all errors here) + write the run dir + start the job +
record it. status/logs/cancel read the registry, then ask the cluster: one
batched sacct call per Slurm cluster, or the run dir's state.json on `local`.
"""
from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from submit import local, slurm
from submit.cluster import ClusterProfile, load_profile
from submit.errors import ClusterError, InputError
from submit.plan import Plan
from submit.registry import JobRecord, Registry, now
from submit.render import SCRIPT_NAMES, render
from submit.transport import Transport, connect
from launcher.spec import SPEC_FILE, dumps_run_spec

METRICS_FILE = "metrics.jsonl"


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


def git_sha(cwd: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_run_dir(plan: Plan, transport: Transport) -> str:
    """The run dir with the spec as submitted, the resolved spec and the script; returns the script path."""
    run_dir = plan.run_dir
    transport.makedirs(f"{run_dir}/logs", mode=0o700)
    transport.write_text(f"{run_dir}/job.yaml", yaml.safe_dump(plan.submitted, sort_keys=False))
    transport.write_text(f"{run_dir}/{SPEC_FILE}", dumps_run_spec(plan.run_spec))
    script = f"{run_dir}/{SCRIPT_NAMES[plan.cluster.scheduler]}"
    transport.write_text(script, render(plan), mode=0o700)
    return script


def submit(plan: Plan, registry: Registry, transport: Transport, spec_dir: Path = Path(".")) -> JobRecord:
    """Write the run dir, start the job, record it."""
    script = write_run_dir(plan, transport)
    if plan.cluster.scheduler == "local":
        job_id = local.new_job_id()
        local.start(Path(plan.run_dir), Path(script), job_id)
    else:
        argv = slurm.sbatch_argv(script, plan.spec.name, plan.run_dir)
        job_id = slurm.parse_sbatch(transport.run(argv, timeout=120).check("sbatch").stdout)
    record = JobRecord(job_id=job_id, cluster=plan.cluster.name, name=plan.spec.name, run_dir=plan.run_dir,
                       scheduler=plan.cluster.scheduler, submitted_at=now(), git_sha=git_sha(spec_dir),
                       spec_hash=plan.spec_hash)
    registry.add(record)
    return record


class Clusters:
    """Profiles and open transports, one per cluster for the whole command."""

    def __init__(self) -> None:
        self._profiles: dict[str, ClusterProfile] = {}
        self._transports: dict[str, Transport] = {}

    def profile(self, name: str) -> ClusterProfile:
        if name not in self._profiles:
            self._profiles[name] = load_profile(name)
        return self._profiles[name]

    def transport(self, name: str) -> Transport:
        if name not in self._transports:
            self._transports[name] = connect(self.profile(name).ssh)
        return self._transports[name]

    def adopt(self, profile: ClusterProfile, transport: Transport) -> None:
        """Reuse a connection the caller already opened (one connection per command)."""
        self._profiles[profile.name] = profile
        self._transports[profile.name] = transport

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()


def last_metrics(transport: Transport, run_dir: str) -> dict[str, Any]:
    """The newest complete line of metrics.jsonl (reads only the file's tail)."""
    path = f"{run_dir}/{METRICS_FILE}"
    size = transport.size(path)
    if not size:
        return {}
    tail = transport.read_bytes(path, max(0, size - 8192), 8192).decode(errors="replace")
    for line in reversed(tail.splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def _local_status(record: JobRecord, transport: Transport) -> Status:
    state = local.current_state(Path(record.run_dir))
    name = state.get("state", "UNKNOWN")
    started, ended = state.get("started"), state.get("ended")
    elapsed = int((ended or now()) - started) if started else None
    return Status(job_id=record.job_id, cluster=record.cluster, name=record.name, state=name,
                  run_dir=record.run_dir, submitted_at=record.submitted_at,
                  done=name in slurm.SUCCESS | slurm.FAILURE, succeeded=name in slurm.SUCCESS,
                  elapsed_s=elapsed, time_limit_s=state.get("time_limit_s"), reason=state.get("message") or None,
                  progress=last_metrics(transport, record.run_dir))


def _slurm_states(job_ids: Sequence[str], transport: Transport) -> dict[str, slurm.JobState]:
    acct = transport.run(slurm.sacct_argv(job_ids))
    sacct = slurm.parse_sacct(acct.stdout) if acct.returncode == 0 else {}
    pending = [j for j in job_ids if j not in sacct or not sacct[j].done]
    live: dict[str, slurm.JobState] = {}
    if pending:  # accounting trails squeue by seconds, or is off: ask squeue too
        queue = transport.run(slurm.squeue_argv(pending))
        live = slurm.parse_squeue(queue.stdout) if queue.returncode == 0 else {}
        if acct.returncode != 0 and queue.returncode != 0:
            acct.check("sacct")
    return slurm.merge_states(job_ids, sacct, live)


def _slurm_status(record: JobRecord, job: slurm.JobState, transport: Transport) -> Status:
    return Status(job_id=record.job_id, cluster=record.cluster, name=record.name, state=job.state,
                  run_dir=record.run_dir, submitted_at=record.submitted_at, done=job.done,
                  succeeded=job.succeeded, elapsed_s=slurm.seconds(job.elapsed),
                  time_limit_s=slurm.seconds(job.time_limit), restarts=job.restarts, reason=job.reason,
                  progress=last_metrics(transport, record.run_dir))


def statuses(records: Sequence[JobRecord], clusters: Clusters, registry: Optional[Registry] = None) -> list[Status]:
    """The status of each record, in order: one batched scheduler query per cluster."""
    by_cluster: dict[str, list[JobRecord]] = defaultdict(list)
    for record in records:
        by_cluster[record.cluster].append(record)
    found: dict[tuple[str, str], Status] = {}
    for name, group in by_cluster.items():
        transport = clusters.transport(name)
        slurm_jobs = [r for r in group if r.scheduler == "slurm"]
        states = _slurm_states([r.job_id for r in slurm_jobs], transport) if slurm_jobs else {}
        for record in group:
            status = (_slurm_status(record, states[record.job_id], transport) if record.scheduler == "slurm"
                      else _local_status(record, transport))
            found[(record.cluster, record.job_id)] = status
            if registry is not None and status.state != record.last_state:
                registry.set_state(record, status.state)
    return [found[(r.cluster, r.job_id)] for r in records]


def cancel(record: JobRecord, clusters: Clusters) -> None:
    if record.scheduler == "local":
        if not local.cancel(Path(record.run_dir)):
            raise ClusterError(f"job {record.job_id} is not running (see `meshrun status {record.job_id}`)")
        return
    clusters.transport(record.cluster).run(slurm.scancel_argv(record.job_id)).check("scancel")


def log_path(record: JobRecord, rank: Optional[int]) -> str:
    """rank N's log, or (rank None) the batch shell's / local supervisor's log."""
    if rank is not None:
        if rank < 0:
            raise InputError("--rank", rank, "ranks are numbered from 0")
        return f"{record.run_dir}/logs/rank-{rank}.log"
    if record.scheduler == "local":
        return f"{record.run_dir}/{local.SUPERVISOR_LOG}"
    return f"{record.run_dir}/logs/slurm-{record.job_id}.out"
