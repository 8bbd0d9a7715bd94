"""The only module that both plans and talks to a cluster.

submit = plan (pure, all errors here) + sync the code snapshot + write the run dir
and `sbatch --parsable` in one round trip + record it. status/logs/cancel/tb read
the registry, then reach the job's cluster through `Clusters`: one connection per
cluster for the whole command, reopened after a drop.
"""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import yaml

from launcher.spec import SPEC_FILE, dumps_run_spec
from submit import local, slurm, snapshot as snapshots
from submit.cluster import ClusterProfile, load_profile, load_profile_file
from submit.errors import ClusterError, InputError
from submit.plan import Plan
from submit.registry import JobRecord, Registry, now
from submit.render import SCRIPT_NAMES, render
from submit.status import METRICS_FILE, Status, last_metrics, statuses
from submit.transport import Progress, Transport, Upload, connect

__all__ = ["Clusters", "METRICS_FILE", "Status", "cancel", "git_sha", "last_metrics", "log_path", "run_dir_files",
           "statuses", "submit", "sync_code"]


def git_sha(cwd: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_dir_files(plan: Plan) -> dict[str, Upload]:
    """The run dir: the spec as submitted, the resolved spec, the script, logs/ (and each sweep task's)."""
    files = {
        "job.yaml": Upload(yaml.safe_dump(plan.submitted, sort_keys=False).encode()),
        SPEC_FILE: Upload(dumps_run_spec(plan.run_spec).encode()),
        SCRIPT_NAMES[plan.cluster.scheduler]: Upload(render(plan).encode(), 0o700),
        "logs/": Upload(b"", 0o700),
    }
    for task in plan.tasks:
        files[f"tasks/{task.index}/{SPEC_FILE}"] = Upload(dumps_run_spec(task.run_spec).encode())
        files[f"tasks/{task.index}/logs/"] = Upload(b"", 0o700)
    return files


def sync_code(plan: Plan, transport: Transport, snap: Optional[snapshots.Snapshot],
              progress: Optional[Progress] = None, present: Optional[bool] = None) -> tuple[Plan, bool]:
    """Put the code snapshot on the cluster (if not there yet); the plan then names it. (plan, uploaded)"""
    if snap is None or plan.cluster.scheduler != "slurm":
        return plan, False
    code_dir = snapshots.remote_dir(plan.work_dir, snap)
    uploaded = snapshots.sync(transport, snap, code_dir, progress, present)
    return dataclasses.replace(plan, code_dir=code_dir), uploaded


def submit(plan: Plan, registry: Registry, transport: Transport, spec_dir: Path = Path("."),
           after: Sequence[str] = (), profile_path: Optional[str] = None) -> list[JobRecord]:
    """Write the run dir and start the job in one round trip, then record it (one record per sweep task)."""
    script = f"{plan.run_dir}/{SCRIPT_NAMES[plan.cluster.scheduler]}"
    if plan.cluster.scheduler == "local":
        transport.put(run_dir_files(plan), plan.run_dir)
        job_id = local.new_job_id()
        local.start(Path(plan.run_dir), Path(script), job_id)
    else:
        argv = slurm.sbatch_argv(script, plan.spec.name, plan.run_dir, after)
        done = transport.put(run_dir_files(plan), plan.run_dir, then=argv, timeout=120)
        assert done is not None
        job_id = slurm.parse_sbatch(done.check("sbatch").stdout)
    base = JobRecord(job_id=job_id, cluster=plan.cluster.name, name=plan.spec.name, run_dir=plan.run_dir,
                     scheduler=plan.cluster.scheduler, submitted_at=now(), git_sha=git_sha(spec_dir),
                     spec_hash=plan.spec_hash, profile=profile_path)
    records = [base] if not plan.tasks else [
        dataclasses.replace(base, job_id=f"{job_id}_{t.index}", name=f"{plan.spec.name} [{t.label}]",
                            run_dir=t.run_dir, spec_hash=t.spec_hash) for t in plan.tasks]
    for record in records:
        registry.add(record)
    return records


class Clusters:
    """Profiles and open transports: one connection per cluster for the whole command."""

    def __init__(self) -> None:
        self._profiles: dict[str, ClusterProfile] = {}
        self._transports: dict[str, Transport] = {}
        self._paths: dict[str, str] = {}

    def profile(self, name: str) -> ClusterProfile:
        if name not in self._profiles:
            path = self._paths.get(name)
            if path is not None and not Path(path).is_file():
                raise InputError("cluster profile", path, f"the file job(s) on {name!r} were submitted with is "
                                                          f"gone; restore it")
            self._profiles[name] = load_profile_file(Path(path)) if path else load_profile(name)
        return self._profiles[name]

    def transport(self, name: str) -> Transport:
        if name not in self._transports:
            # Errors name the cluster as the user gave it (a profile file's path, or its name).
            self._transports[name] = connect(self.profile(name).ssh, self._paths.get(name, name))
        return self._transports[name]

    def transport_for(self, record: JobRecord) -> Transport:
        """The connection to the record's cluster (its profile reloaded from the file it was submitted with)."""
        if record.profile and record.cluster not in self._paths:
            self._paths[record.cluster] = record.profile
        return self.transport(record.cluster)

    def reconnect(self, name: str) -> Transport:
        """Drop the (lost) connection and open a new one."""
        old = self._transports.pop(name, None)
        if old is not None:
            try:
                old.close()
            except Exception:
                pass  # it is already gone
        return self.transport(name)

    def adopt(self, profile: ClusterProfile, transport: Transport, path: Optional[str] = None) -> None:
        """Reuse a connection the caller already opened (one connection per command)."""
        self._profiles[profile.name] = profile
        self._transports[profile.name] = transport
        if path:
            self._paths[profile.name] = path

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()


def cancel(records: Sequence[JobRecord], clusters: Clusters) -> None:
    """Cancel a job, or a whole job array (records: its tasks)."""
    record = records[0]
    if record.scheduler == "local":
        if not local.cancel(Path(record.run_dir)):
            raise ClusterError(f"job {record.job_id} is not running (see `meshrun status {record.job_id}`)")
        return
    job_id = record.job_id.split("_")[0] if len(records) > 1 else record.job_id
    clusters.transport_for(record).run(slurm.scancel_argv(job_id)).check("scancel")


def log_path(record: JobRecord, rank: Optional[int]) -> str:
    """rank N's log, or (rank None) the batch shell's / local supervisor's log."""
    if rank is not None:
        if rank < 0:
            raise InputError("--rank", rank, "ranks are numbered from 0")
        return f"{record.run_dir}/logs/rank-{rank}.log"
    if record.scheduler == "local":
        return f"{record.run_dir}/{local.SUPERVISOR_LOG}"
    return f"{record.run_dir}/logs/slurm-{record.job_id}.out"
