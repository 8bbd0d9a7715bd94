"""The submitit Python API on the login node: a cluster profile turned into a configured submitit executor.

    from meshrun.submit.api import executor
    ex = executor("testbed", nodes=2, tasks_per_node=2, time="00:10:00")
    job = ex.submit(fn, 1, 2)
    job.result()

`executor()` validates the resources against the profile (as `meshrun submit` does) and carries the
profile's partition, account, QOS, constraint, exclusivity, the signal ahead of the time limit,
requeue, setup lines and NCCL preset. Every submission (`submit`, `map_array`, `submit_array`, a
`batch()`) gets its own run dir under `<work_dir>/runs`; submitit's pickles and logs live in the
run dir's hidden `.meshrun/submitit`, `logs/` links to what a person reads, and each job goes into
meshrun's registry so `meshrun status`, `logs` and `cancel` see it.

Torch-free and launcher-free beyond the run-dir contract, like all of `submit/`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import secrets
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from submitit.core import core, utils
from submitit.local.local import LocalExecutor
from submitit.slurm.slurm import SlurmExecutor

from meshrun.launcher.contract.private import make_private_dir, private_umask_while
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec import schema
from meshrun.launcher.contract.spec.job import Resources
from meshrun.submit.config.cluster import ClusterProfile, Partition, load_profile_file, profile_path
from meshrun.submit.core.plan import parse_time
from meshrun.submit.core.registry import JobRecord, Registry, now
from meshrun.submit.errors import InputError
from meshrun.submit.planning.plan import fit_partition
from meshrun.submit.schedulers import backend, check_profile

WORKER_MODULE = "meshrun.launcher.rank.submitit_worker"
"""What each task of a Slurm job runs (`python -u -m WORKER_MODULE FOLDER`): submitit's worker, one fix added."""

__all__ = ["MeshrunLocalExecutor", "MeshrunSlurmExecutor", "Resources", "executor", "setup_lines"]


def executor(
    cluster: str,
    *,
    folder: Union[str, Path, None] = None,
    nodes: int = 1,
    tasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int = 1,
    time: str = "01:00:00",
    partition: Optional[str] = None,
    name: str = "meshrun",
    python: Optional[str] = None,
    max_num_timeout: int = 3,
    **extra: Any,
) -> Union[MeshrunSlurmExecutor, MeshrunLocalExecutor]:
    """A submitit executor for cluster profile `cluster` (a name or a YAML path), on its login node.

    folder: where the run dirs go (default `<work_dir>/runs` of the profile, `~` expanded here).
    time: the time limit in Slurm's syntax (submitit counts whole minutes, so it is rounded up).
    name: the Slurm job name and the run dirs' prefix.
    python: the interpreter on the nodes (default: the profile's `python`, run after its setup lines;
        on a `local` profile this machine's interpreter).
    max_num_timeout: how often a Checkpointable job may be requeued after reaching its time limit.
    extra: further submitit parameters (SlurmExecutor's names: mem, gres, comment, srun_args...).
    """
    path = profile_path(cluster)
    profile = check_profile(load_profile_file(path))
    if profile.ssh is not None:
        raise InputError(
            "cluster",
            cluster,
            "the Python API runs on the login node itself, not over SSH: run it "
            "there with a profile that has no `ssh` block",
        )
    res = Resources(
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task,
        time=time,
        partition=partition,
    )
    part = check_resources(res, profile)
    check_extra(extra, on_this_machine(profile))
    minutes = math.ceil(parse_time(time, "time") / 60)
    runs = runs_folder(profile, folder)
    origin = _Origin(cluster=profile.name, scheduler=profile.scheduler, name=name, runs=str(runs), profile=str(path))
    if on_this_machine(profile):
        local = MeshrunLocalExecutor(
            origin, python=python or shlex.quote(sys.executable), max_num_timeout=max_num_timeout
        )
        local.update_parameters(
            **{
                "timeout_min": minutes,
                "tasks_per_node": tasks_per_node,
                "nodes": 1,
                "gpus_per_node": gpus_per_node,
                "signal_delay_s": signal_delay(profile, minutes),
                "setup": setup_lines(profile),
                **extra,
            }
        )
        return local
    params = slurm_parameters(profile, part, res, minutes, name)
    extra = {
        **extra,
        "additional_parameters": {**params["additional_parameters"], **extra.get("additional_parameters", {})},
    }
    slurm = MeshrunSlurmExecutor(origin, python=python or profile.python, max_num_timeout=max_num_timeout)
    slurm.update_parameters(**{**params, **extra})
    return slurm


LOCAL_ONLY = frozenset({"visible_gpus"})
"""submitit's LocalExecutor parameters that Slurm's has not (the GPUs of this machine a local job may use)."""


def check_extra(extra: dict[str, Any], local: bool) -> None:
    """submitit would raise a ValueError listing every parameter (its LocalExecutor ignores unknown ones
    silently); one line instead. A local executor takes Slurm's names too, so that code written for the
    cluster runs unchanged on `local` (where they have no effect)."""
    valid = SlurmExecutor._valid_parameters() | (LOCAL_ONLY if local else frozenset())
    for key in sorted(set(extra) - valid):
        raise InputError(
            key,
            extra[key],
            f"not a SlurmExecutor parameter{schema.closest(key, valid)}; valid: {', '.join(sorted(valid))}",
        )


def check_resources(res: Resources, profile: ClusterProfile) -> Partition:
    """The resources against the profile's partition, as `meshrun submit` checks a job's."""
    tasks = res.tasks_per_node if res.tasks_per_node is not None else 1
    for key, value in (("nodes", res.nodes), ("tasks_per_node", tasks), ("cpus_per_task", res.cpus_per_task)):
        if value < 1:
            raise InputError(key, value, "must be at least 1")
    if res.gpus_per_node < 0:
        raise InputError("gpus_per_node", res.gpus_per_node, "must be 0 (CPU only) or more")
    if on_this_machine(profile) and res.nodes != 1:
        raise InputError("nodes", res.nodes, "the local cluster is this one machine: use 1")
    return fit_partition(res, tasks, profile, prefix="")


def on_this_machine(profile: ClusterProfile) -> bool:
    """The cluster is this machine (a backend never reached over SSH, i.e. `local`): submitit's
    LocalExecutor, one node. Asked of the backend: only submit/schedulers knows schedulers by name."""
    return not backend(profile.scheduler).over_ssh


def slurm_parameters(
    profile: ClusterProfile, part: Partition, res: Resources, minutes: int, name: str
) -> dict[str, Any]:
    """SlurmExecutor's parameters: the resources plus what the profile carries."""
    d = profile.defaults
    params: dict[str, Any] = {
        "job_name": name,
        "partition": part.name,
        "time": minutes,
        "nodes": res.nodes,
        "ntasks_per_node": res.tasks_per_node,
        "cpus_per_task": res.cpus_per_task,
        "signal_delay_s": signal_delay(profile, minutes),
        "setup": setup_lines(profile),
        # Explicit: a cluster whose JobRequeue=0 would refuse submitit's `scontrol requeue`.
        "additional_parameters": {"requeue": True},
    }
    if res.gpus_per_node:
        params["gpus_per_node"] = res.gpus_per_node
    optional = {"account": d.account, "qos": d.qos, "constraint": d.constraint, "exclusive": d.exclusive or None}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def signal_delay(profile: ClusterProfile, minutes: int) -> int:
    """Seconds before the time limit that submitit's signal (USR2) reaches the tasks: the profile's, at most
    half the limit (as the batch template does): a signal due before the function has installed submitit's
    handler would kill it."""
    return min(profile.defaults.signal_seconds, max(minutes * 60 // 2, 1))


def setup_lines(profile: ClusterProfile) -> list[str]:
    """The profile's setup lines (trusted, verbatim), then its NCCL preset, each only if unset (as the
    batch template does: a user's own export wins), every value shell-quoted."""
    nccl = [
        f'if [ -z "${{{key}+x}}" ]; then export {key}={shlex.quote(value)}; fi'
        for key, value in sorted(profile.interconnect.nccl.items())
    ]  # keys are validated by the profile
    return [*profile.setup, *nccl]


def runs_folder(profile: ClusterProfile, folder: Union[str, Path, None]) -> Path:
    """Where the run dirs go: `folder`, else the profile's `<work_dir>/runs` (`~` is this user's home)."""
    base = Path(folder) if folder is not None else Path(profile.paths.work_dir) / "runs"
    return base.expanduser().absolute()


def new_run_dir(runs: str, name: str, when: Optional[_dt.datetime] = None) -> RunDir:
    """<runs>/submitit-<name>-<UTC time>-<random>: unique, sortable, and says where it came from."""
    stamp = (when or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9_+-]", "_", name).strip("_")[:64] or "job"
    return RunDir(f"{runs}/submitit-{slug}-{stamp}-{secrets.token_hex(4)}")


@dataclass(frozen=True)
class _Origin:
    """What the registry needs to know about where this executor's jobs come from."""

    cluster: str
    scheduler: str
    """The profile's scheduler, as the registry records it."""
    name: str
    runs: str
    profile: Optional[str]
    """The profile file's absolute path: status/logs/cancel reach the job's cluster through it, as for
    `meshrun submit` (a job always goes back to its own cluster)."""


class _Registering:
    """Mixin: each submission gets a fresh run dir, and each job is recorded in meshrun's registry.

    Every submitit entry point (submit, map_array, submit_array, batch) goes through
    `_internal_process_submissions`, so this is the one place to hook.
    """

    has_batch_log: bool
    """A batch shell writes a log of its own (Slurm's sbatch --output), linked as logs/slurm-JOBID.out."""
    _origin: _Origin
    _run_dir: Optional[RunDir]
    folder: Path
    parameters: dict[str, Any]

    def _start_run_dir(self) -> RunDir:
        run_dir = new_run_dir(self._origin.runs, self._origin.name)
        make_private_dir(Path(run_dir.root).parent)
        Path(run_dir.root).mkdir(mode=0o700)  # private, like every meshrun run dir (and new: never reused)
        # Slurm opens the batch log before any of our code runs: its folder must exist now.
        make_private_dir(run_dir.submitit)
        self.folder = Path(run_dir.submitit)
        self._run_dir = run_dir
        return run_dir

    def _internal_process_submissions(self, delayed_submissions: list[utils.DelayedSubmission]) -> list[core.Job[Any]]:
        # The caller's process is theirs: the private umask only while submitit writes its pickles and starts
        # the job (sbatch hands the job the umask it was called with; a local job's processes inherit it).
        with private_umask_while():
            run_dir = self._start_run_dir()
            jobs: list[core.Job[Any]] = super()._internal_process_submissions(delayed_submissions)  # type: ignore[misc]
            self._record(run_dir, jobs, delayed_submissions)
        return jobs

    def _record(
        self, root: RunDir, jobs: Sequence[core.Job[Any]], submissions: Sequence[utils.DelayedSubmission]
    ) -> None:
        array = len(jobs) > 1
        sha = _git_sha()
        registry = Registry()
        try:
            for index, (job, delayed) in enumerate(zip(jobs, submissions)):
                run_dir = root.task(index) if array else root
                _link_logs(run_dir, job, batch_log=self.has_batch_log)
                registry.add(
                    JobRecord(
                        job_id=str(job.job_id),
                        cluster=self._origin.cluster,
                        name=f"{self._origin.name} [{index}]" if array else self._origin.name,
                        run_dir=run_dir.root,
                        scheduler=self._origin.scheduler,
                        submitted_at=now(),
                        git_sha=sha,
                        spec_hash=_call_hash(delayed, self.parameters),
                        profile=self._origin.profile,
                    )
                )
        finally:
            registry.close()

    @property
    def run_dir(self) -> Optional[Path]:
        """The run dir of the latest submission (None before the first); an array's task N is
        `run_dir / "tasks" / str(N)`."""
        return Path(self._run_dir.root) if self._run_dir is not None else None


class MeshrunSlurmExecutor(_Registering, SlurmExecutor):
    """submitit's SlurmExecutor, each submission in its own meshrun run dir and registry record."""

    has_batch_log = True

    def __init__(self, origin: _Origin, python: str, max_num_timeout: int = 3) -> None:
        self._origin, self._run_dir = origin, None
        # Until the first submission picks its run dir, submitit's folder is the runs folder.
        super().__init__(origin.runs, max_num_timeout=max_num_timeout, python=python)

    @property
    def _submitit_command_str(self) -> str:
        # submitit's worker with a requeue that survives its own SIGTERM (launcher/rank/submitit_worker.py).
        return " ".join([self.python, "-u -m", WORKER_MODULE, shlex.quote(str(self.folder))])


class MeshrunLocalExecutor(_Registering, LocalExecutor):
    """submitit's LocalExecutor (a `local` profile), each submission in its own run dir and registry record."""

    has_batch_log = False

    def __init__(self, origin: _Origin, python: str, max_num_timeout: int = 3) -> None:
        self._origin, self._run_dir = origin, None
        with private_umask_while():  # submitit's LocalExecutor makes its folder (and any above) now
            super().__init__(origin.runs, max_num_timeout=max_num_timeout, python=python)


def _link_logs(run_dir: RunDir, job: core.Job[Any], batch_log: bool) -> None:
    """logs/ as a person reads it: rank-N.log (stdout), rank-N.err (stderr) and the batch log, linked to
    submitit's files in .meshrun/submitit (relative links: the run dir may be moved or mounted elsewhere)."""
    logs = Path(run_dir.logs)
    make_private_dir(logs)
    links = {f"rank-{t}.err": job.task(t).paths.stderr for t in range(job.num_tasks)}
    links.update({f"rank-{t}.log": job.task(t).paths.stdout for t in range(job.num_tasks)})
    if batch_log:  # Slurm's batch shell writes into task 0's stdout file (submitit's sbatch --output)
        links[Path(run_dir.batch_log(str(job.job_id))).name] = job.paths.stdout
    for name, target in links.items():
        link = logs / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(target, logs))


def _call_hash(delayed: utils.DelayedSubmission, parameters: dict[str, Any]) -> str:
    """Stands in for a spec's hash: the function's name and the executor's parameters."""
    fn = delayed.function
    label = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    text = json.dumps({"function": label, "parameters": parameters}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _git_sha() -> Optional[str]:
    """The commit of the checkout the caller runs in, if any (recorded like `meshrun submit` does)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None
