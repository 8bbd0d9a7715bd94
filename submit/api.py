"""The Python face of meshrun, and the only module that both plans and talks to a cluster.

submit = plan (pure, all errors here) -> `dryrun` (the backend builds the request: script,
argv, run-dir files, each rendered once) -> `schedule` (sends exactly that request over
the transport) -> record. status/logs/cancel/tb/resume read the registry, then reach the
job's cluster through `Clusters` (one connection per cluster for the whole command) and
its scheduler backend. `executor(...)` is the submitit API on a login node.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any, Optional, Sequence

from launcher.contract.private import private_umask_while
from submit.config.cluster import ClusterProfile, is_profile_path, load_profile, load_profile_file
from submit.errors import ClusterError, InputError
from submit.jobs.registry import JobRecord, Registry, now
from submit.jobs.status import METRICS_FILE, Status, last_metrics, statuses
from submit.planning.plan import Plan
from submit.schedulers import backend
from submit.schedulers.base import Request
from submit.transport import connect
from submit.transport import snapshot as snapshots
from submit.transport.base import Progress, Transport

# `executor` is served by the module's __getattr__ (submitit is imported only when it is asked for).
__all__ = [
    "Clusters",
    "METRICS_FILE",
    "Request",
    "Status",
    "cancel",
    "dryrun",
    "executor",  # noqa: F822
    "git_sha",
    "last_metrics",
    "log_path",
    "schedule",
    "statuses",
    "submit",
    "sync_code",
    "with_code_dir",
]


def __getattr__(name: str) -> Any:
    """`from submit.api import executor`: the submitit API, imported (with submitit) only when asked for."""
    if name == "executor":
        from submit.schedulers.executor import executor

        return executor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def git_sha(cwd: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def with_code_dir(
    plan: Plan, snap: Optional[snapshots.Snapshot], in_place: Optional[str] = None, name: Optional[str] = None
) -> Plan:
    """The plan naming the folder its ranks run from: the code snapshot's on the cluster (content-addressed,
    so known before any upload: the script is then rendered once, with the path it will run from and the
    seal it checks; `name`: the copy the probe found, when `code/<digest>` itself changed), or, for
    a backend that runs this machine's files in place, `in_place` (the project's folder), so that a
    command's relative paths (`python3 examples/x.py`) resolve as they do on Slurm."""
    if not backend(plan.cluster.scheduler).ships_code:
        return dataclasses.replace(plan, code_dir=in_place) if in_place else plan
    if snap is None:
        return plan
    return dataclasses.replace(
        plan,
        code_dir=snapshots.remote_dir(plan.work_dir, snap, name),
        code_seal=(snap.manifest_sha, snap.listing_sha),
    )


def dryrun(plan: Plan, after: Sequence[str] = ()) -> Request:
    """Everything a submit would send, rendered once; nothing is touched."""
    return backend(plan.cluster.scheduler).dryrun(plan, after)


def sync_code(
    plan: Plan,
    transport: Transport,
    snap: Optional[snapshots.Snapshot],
    progress: Optional[Progress] = None,
    present: Optional[bool] = None,
) -> bool:
    """Put the plan's code snapshot on the cluster if it is not there yet; True if it was uploaded."""
    if snap is None or plan.code_dir is None:
        return False
    return snapshots.sync(transport, snap, plan.code_dir, progress, present)


def schedule(
    request: Request,
    plan: Plan,
    registry: Registry,
    transport: Transport,
    spec_dir: Path = Path("."),
    profile_path: Optional[str] = None,
) -> list[JobRecord]:
    """Send exactly `request`, then record the job (one record per sweep task)."""
    with private_umask_while():  # a library caller's umask is theirs: what this writes and starts is private
        job_id = backend(request.scheduler).schedule(request, transport)
    base = JobRecord(
        job_id=job_id,
        cluster=plan.cluster.name,
        name=plan.spec.name,
        run_dir=plan.run_dir,
        scheduler=request.scheduler,
        submitted_at=now(),
        git_sha=git_sha(spec_dir),
        spec_hash=plan.spec_hash,
        profile=profile_path,
    )
    records = (
        [base]
        if not plan.tasks
        else [
            dataclasses.replace(
                base,
                job_id=f"{job_id}_{t.index}",
                name=f"{plan.spec.name} [{t.label}]",
                run_dir=t.run_dir,
                spec_hash=t.spec_hash,
            )
            for t in plan.tasks
        ]
    )
    for record in records:
        registry.add(record)
    return records


def submit(
    plan: Plan,
    registry: Registry,
    transport: Transport,
    spec_dir: Path = Path("."),
    after: Sequence[str] = (),
    profile_path: Optional[str] = None,
    force: bool = False,
) -> list[JobRecord]:
    """dryrun + schedule: build the request, send it, record the job. A GPU job that cannot fit its
    partition's memory is refused first (InputError, as `meshrun submit` does), unless `force`."""
    from submit.planning.plan import check_files, check_fit
    from submit.transport.base import LocalTransport

    if isinstance(transport, LocalTransport):
        check_files(plan)  # over SSH, the ranks check their files when they start
    if not force:
        check_fit(plan)
    return schedule(dryrun(plan, after), plan, registry, transport, spec_dir, profile_path)


class Clusters:
    """Profiles and open transports: one connection per cluster for the whole command.

    A cluster is keyed by the profile FILE a job was submitted with (the registry keeps its path), so
    a job always goes back to its own cluster, whatever other profiles are called today."""

    def __init__(self) -> None:
        self._profiles: dict[str, ClusterProfile] = {}
        self._transports: dict[str, Transport] = {}

    @staticmethod
    def key(record: JobRecord) -> str:
        return record.profile or record.cluster

    def profile(self, key: str) -> ClusterProfile:
        """The profile behind a key: a profile file's path, or (records of old) a profile name."""
        if key not in self._profiles:
            if is_profile_path(key):
                if not Path(key).is_file():
                    raise InputError(
                        "cluster profile", key, "the profile file this job was submitted with is gone; restore it"
                    )
                self._profiles[key] = load_profile_file(Path(key))
            else:
                self._profiles[key] = load_profile(key)
        return self._profiles[key]

    def profile_for(self, record: JobRecord) -> ClusterProfile:
        return self.profile(self.key(record))

    def transport(self, key: str) -> Transport:
        if key not in self._transports:
            # The key, not the profile's name: a refused host key's fix (`meshrun trust KEY`) must name
            # the file a job was submitted with (-c my.yaml), which `meshrun trust NAME` would not find.
            self._transports[key] = connect(self.profile(key).ssh, key)
        return self._transports[key]

    def transport_for(self, record: JobRecord) -> Transport:
        """The connection to the record's cluster (its profile reloaded from the file it was submitted with)."""
        return self.transport(self.key(record))

    def reconnect(self, record: JobRecord) -> Transport:
        """Drop the (lost) connection to the record's cluster and open a new one."""
        old = self._transports.pop(self.key(record), None)
        if old is not None:
            try:
                old.close()
            except Exception:
                pass  # it is already gone
        return self.transport_for(record)

    def adopt(self, profile: ClusterProfile, transport: Transport, path: str) -> None:
        """Reuse a connection the caller already opened (one connection per command)."""
        self._profiles[path] = profile
        self._transports[path] = transport

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()


def cancel(records: Sequence[JobRecord], clusters: Clusters, registry: Optional[Registry] = None) -> None:
    """Cancel a job, or a whole job array (records: its tasks); a job that already ended is an error."""
    found = statuses(records, clusters, registry)
    if all(s.done for s in found):
        states = sorted({s.state for s in found})
        raise ClusterError(
            f"job {records[0].job_id if len(records) == 1 else records[0].job_id.split('_')[0]} "
            f"already ended ({', '.join(states)}): nothing to cancel"
        )
    record = records[0]
    backend(record.scheduler).cancel(records, clusters.transport_for(record))


def log_path(record: JobRecord, rank: Optional[int]) -> str:
    """rank N's log, or (rank None) the batch shell's / local supervisor's log."""
    if rank is not None and rank < 0:
        raise InputError("--rank", rank, "ranks are numbered from 0")
    return backend(record.scheduler).log_path(record, rank)
