"""`meshrun status` as the job count grows (10, 100, 1,000): time and remote round trips, on the real testbed.

    .venv/bin/python bench/status_scale.py [--runs N] [--sizes 10,100,1000] [--keep] [--quick]

One status refresh (meshrun.submit.api.statuses, what `meshrun status` runs) over N Slurm records, from the
login node (the local transport, its commands counted by a wrapper) and from a laptop over SSH (the
testbed's sshd; round trips counted by meshrun.submit.transport.ssh.STATS). Prints the median time of --runs refreshes,
the round trips (goal: 1 per cluster up to meshrun.submit.schedulers.slurm.BATCH_JOBS jobs), and the ratio
against 10 jobs measured in the same run. The records are written straight into a list with real run
dirs (metrics.jsonl each), their ids unknown to slurmctld: squeue and sacct are asked about all N ids.
Starts the testbed when it is not running and stops it again unless --keep. --quick (CI's check that
the bench runs): 10 and 100 jobs, one refresh each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshrun.submit import api  # noqa: E402
from meshrun.submit.config.cluster import load_profile, load_profile_file  # noqa: E402
from meshrun.submit.core.registry import JobRecord  # noqa: E402
from meshrun.submit.transport.base import LocalTransport, Result  # noqa: E402
from meshrun.submit.transport.ssh import STATS  # noqa: E402
from tests.helpers import sshbed  # noqa: E402
from tests.testbed import testbed as tb  # noqa: E402

FIRST_ID = 7_000_000
"""Far above the testbed's own job ids."""


class CountingLocal(LocalTransport):
    """The login node's transport, counting the commands it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.commands = 0

    def run(self, argv: Sequence[str], *args: Any, **kwargs: Any) -> Result:
        self.commands += 1
        return super().run(argv, *args, **kwargs)


def records(runs: Path, n: int, cluster: str, profile: Optional[str]) -> list[JobRecord]:
    """n Slurm records whose run dirs (made once, shared by both transports) each hold a metrics line."""
    found = []
    for i in range(n):
        run_dir = runs / f"job-{i}"
        if not run_dir.is_dir():
            run_dir.mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text(json.dumps({"step": i, "loss": 1.0}) + "\n")
        job = JobRecord(str(FIRST_ID + i), cluster, "many", str(run_dir), "slurm", 1e9 + i, None, "0" * 64)
        found.append(JobRecord(**{**job.__dict__, "last_state": "RUNNING", "profile": profile}))
    return found


def refresh(clusters: api.Clusters, jobs: list[JobRecord], runs: int) -> float:
    """Median seconds of `runs` status refreshes; checks that every job's metrics tail came back."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        found = api.statuses(jobs, clusters)
        times.append(time.perf_counter() - start)
        assert [s.progress.get("step") for s in found] == list(range(len(jobs))), "a metrics tail is missing"
    return statistics.median(times)


def login_node(runs_dir: Path, n: int, runs: int) -> tuple[float, float]:
    """(median seconds, round trips per refresh) on the login node."""
    transport, clusters = CountingLocal(), api.Clusters()
    clusters.adopt(load_profile("testbed"), transport, "testbed")
    seconds = refresh(clusters, records(runs_dir, n, "testbed", None), runs)
    return seconds, transport.commands / runs


def over_ssh(runs_dir: Path, profile: Path, n: int, runs: int) -> tuple[float, float]:
    """(median seconds, round trips per refresh) from a laptop over SSH (connected before timing)."""
    clusters = api.Clusters()
    try:
        jobs = records(runs_dir, n, "sshbed", str(profile))
        clusters.transport_for(jobs[0]).home()
        before = STATS.snapshot().round_trips
        seconds = refresh(clusters, jobs, runs)
        return seconds, (STATS.snapshot().round_trips - before) / runs
    finally:
        clusters.close()


def table(sizes: list[int], runs: int, tmp: Path) -> None:
    profile = sshbed.profile(tmp)
    load_profile_file(profile)  # a bad profile fails here, not mid-table
    print(f"status refresh, median of {runs}; ratio: time / time of {sizes[0]} jobs")
    base: dict[str, float] = {}
    for n in sizes:
        for where, (seconds, trips) in (
            ("login node", login_node(tmp / "runs", n, runs)),
            ("over SSH", over_ssh(tmp / "runs", profile, n, runs)),
        ):
            base.setdefault(where, seconds)
            print(
                f"status of {n:,} jobs {where:<10}: {trips:g} round trip{'s' if trips != 1 else ''}, "
                f"{seconds * 1000:,.0f} ms, {seconds / n * 1e6:,.0f} us/job, ratio {seconds / base[where]:.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5, help="median of this many refreshes per size")
    parser.add_argument("--sizes", default="10,100,1000", help="job counts; the first is the baseline")
    parser.add_argument("--keep", action="store_true", help="leave the testbed running")
    parser.add_argument("--quick", action="store_true", help="10 and 100 jobs, one refresh (CI's check)")
    args = parser.parse_args()
    sizes = [10, 100] if args.quick else [int(s) for s in args.sizes.split(",")]
    runs = 1 if args.quick else args.runs
    already_up = all(tb.status().values())
    tb.up()
    try:
        os.environ.update(tb.client_env(), MESHRUN_TESTBED_VENV=sys.prefix)
        with tempfile.TemporaryDirectory() as tmp:
            table(sizes, runs, Path(tmp))
    finally:
        if not (already_up or args.keep):
            tb.down()


if __name__ == "__main__":
    main()
