"""What many tests build the same way: a hostile string for injection tests, a registry record, a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from meshrun.submit.config.cluster import ClusterProfile, load_profile
from meshrun.submit.core.plan import Plan
from meshrun.submit.core.registry import JobRecord
from meshrun.submit.core.state import JobState
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers import backend

REPO = Path(__file__).resolve().parents[2]

# Every shell construct the injection tests feed the product, one per entry ({canary}: the test's own file,
# which a shell that ran the value would create). No commas (--set splits a list on them), no backslash, and
# never ending in "/" (the value is also a file name); joined, short enough for a job name (at most 128
# characters with the `canary` fixture's path).
HOSTILE_PARTS = (
    "$(touch {canary})",  # command substitution
    "`touch {canary}`",  # backticks
    "'single'",  # single quotes
    '"double"',  # double quotes
    "spaces;x",  # a separator inside a word
    "; rm -rf /",  # a separate command after spaces
    "&& touch {canary}",  # a chained command
)


def hostile(canary: Path) -> str:
    """A value (and file name) holding every HOSTILE_PARTS construct, that creates `canary` if a shell ran it."""
    return " ".join(HOSTILE_PARTS).format(canary=canary)


def record(
    job_id: str = "1",
    *,
    cluster: str = "c",
    name: str = "n",
    run_dir: Union[str, Path] = "/r",
    scheduler: str = "slurm",
    submitted_at: float = 0.0,
    git_sha: Optional[str] = None,
    spec_hash: str = "h",
    last_state: str = JobState.SUBMITTED.value,
    profile: Optional[str] = None,
    last_progress: Optional[str] = None,
) -> JobRecord:
    """A registry record, as submit adds it, with the fields a test does not care about filled in."""
    return JobRecord(
        job_id,
        cluster,
        name,
        str(run_dir),
        scheduler,
        submitted_at,
        git_sha,
        spec_hash,
        last_state,
        profile,
        last_progress,
    )


def plan(
    example: Union[str, Path],
    profile: Union[str, ClusterProfile],
    *overrides: str,
    home: Optional[str] = "/home/u",
    run_dir: Optional[str] = "/r",
    checked: bool = False,
) -> Plan:
    """`example` (a file name under examples/, or any spec's path) planned on `profile` (a profile's name, or a
    loaded one) with these `--set` overrides; `checked`: with the profile's scheduler's own checks too, as
    `meshrun submit` plans (api.plan_job's)."""
    cluster = load_profile(profile) if isinstance(profile, str) else profile
    check = backend(cluster.scheduler).check if checked else None
    return plan_file(REPO / "examples" / example, cluster, list(overrides), run_dir, home, check)
