"""The plan: a job resolved against its cluster, ready to render and submit; what planning makes and every
backend renders, checks and sends (here, below both, so that neither imports the other). Its time limit's
syntax is here too: the spec's `resources.time` and a partition's `max_time` are Slurm's."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from meshrun.launcher.contract.spec import schema
from meshrun.launcher.contract.spec.job import JobSpec, RunSpec
from meshrun.submit.config.cluster import ClusterProfile, Partition
from meshrun.submit.errors import InputError

_TIME = re.compile(r"(?:(?P<d>[0-9]+)-)?(?P<rest>[0-9]+(?::[0-9]+){0,2})")


@dataclass(frozen=True)
class Plan:
    """A job ready to render and submit."""

    spec: JobSpec
    """The validated spec."""
    submitted: dict[str, Any]
    """The spec as the user wrote it, overrides applied (saved as job.yaml)."""
    cluster: ClusterProfile
    """Where it runs."""
    partition: Optional[Partition]
    """The partition (None on the local cluster)."""
    run_dir: str
    """The run dir on the cluster."""
    time_seconds: int
    """The time limit in seconds."""
    run_spec: RunSpec
    """What the ranks read (spec.json)."""
    work_dir: str = ""
    """The cluster's work dir with `~` resolved: run dirs and code snapshots live under it."""
    code_dir: Optional[str] = None
    """The project's code snapshot on the cluster, once synced: the ranks' PYTHONPATH and cwd."""
    code_seal: Optional[tuple[str, str]] = None
    """The snapshot's (manifest sha256, listing sha256): the batch script checks its folder's sealed files
    against the first (files a job wrote beside them do not stop it), the probe the whole folder against both."""
    tasks: tuple[Task, ...] = ()
    """A sweep's array tasks, each with its own run dir and spec (empty for a single job)."""

    @property
    def spec_hash(self) -> str:
        text = json.dumps(schema.to_plain(self.spec), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Task:
    """One task of a sweep (a Slurm job array): its overrides, run dir and spec."""

    index: int
    """SLURM_ARRAY_TASK_ID."""
    overrides: tuple[tuple[str, str], ...]
    """The swept keys and this task's values."""
    run_dir: str
    """<run dir>/tasks/<index>: the task's own spec.json, logs, metrics."""
    run_spec: RunSpec
    """What the task's ranks read."""
    spec_hash: str
    """Hash of the task's validated spec."""

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.overrides)


def parse_time(text: str, key: str = "resources.time") -> int:
    """Slurm's time syntax (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> seconds."""
    match = _TIME.fullmatch(text.strip())
    if not match:
        raise InputError(key, text, "use Slurm's time syntax: MINUTES, HH:MM:SS or D-HH:MM:SS")
    days = int(match["d"] or 0)
    parts = [int(p) for p in match["rest"].split(":")]
    if match["d"] is not None:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = parts
    total = ((days * 24 + h) * 60 + m) * 60 + s
    if total <= 0:
        raise InputError(key, text, "the time limit must be positive")
    return total


def format_time(seconds: int) -> str:
    """Seconds -> D-HH:MM:SS (what sbatch --time accepts)."""
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"
