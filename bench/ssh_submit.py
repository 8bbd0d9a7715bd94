"""Submission over SSH against the real testbed (Slurm + sshd on 127.0.0.1), measured in one run.

    .venv/bin/python bench/ssh_submit.py [--runs N] [--jobs 200] [--keep] [--quick]

Prints, per `meshrun submit`: SSH connections opened (goal 1), remote round trips and bytes
uploaded, for a first submit and an unchanged resubmit (goal 0 bytes); `status` of N jobs (goal
one round trip); and the wall time of `meshrun submit` against a bare `ssh host sbatch` of the
same script (OpenSSH client, same host), as a ratio. Counts come from meshrun.submit.transport.ssh.STATS in this
process; connections are also counted by sshd itself (its "Accepted publickey" log lines).
Starts the testbed when it is not running and stops it again unless --keep. --quick
(CI's check that the bench runs): one latency run and a 4-job status query.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshrun.submit.cli import main as cli  # noqa: E402
from meshrun.submit.transport.ssh import STATS, Counters  # noqa: E402
from tests.helpers import sshbed  # noqa: E402
from tests.testbed import testbed as tb  # noqa: E402


def _delta(before: Counters) -> Counters:
    now = STATS.snapshot()
    return Counters(
        now.connections - before.connections, now.round_trips - before.round_trips, now.bytes_sent - before.bytes_sent
    )


def _cli(*args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    assert code == 0, (args, out.getvalue(), err.getvalue())
    return out.getvalue() + err.getvalue()


def _code_tar_bytes(spec: Path) -> int:
    """What uploading the spec's project costs: the gzipped tar meshrun sends."""
    from meshrun.launcher.contract.spec.job import Code
    from meshrun.submit.transport.base import Upload, tar_bytes
    from meshrun.submit.transport.snapshot import collect

    snap = collect(spec.parent, Code())
    assert snap is not None
    return len(tar_bytes({rel: Upload(snap.root / rel, mode) for rel, mode in snap.files}))


def _median_s(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _project(home: Path) -> Path:
    # ~60 source files, ~300 kB: a small research repo.
    files = {f"pkg/mod_{i:02d}.py": f"# {uuid.uuid4().hex}\n" + "x = 1  # padding\n" * 300 for i in range(60)}
    files["job.yaml"] = sshbed.command_spec("bench", ["true"])
    return sshbed.project(home, files)


def submits(home: Path, profile: Path, spec: Path) -> str:
    """conns: opened by this process; sshd: logins sshd recorded; code bytes: the snapshot upload
    (0 when it was already there); run dir: the rest (spec, script), sent with sbatch."""
    print(
        f"{'per submit':<26} {'conns':>5} {'sshd':>4} {'round trips':>11} {'code bytes':>10} "
        f"{'run dir bytes':>13} {'wall ms':>7}"
    )
    code_size, last = _code_tar_bytes(spec), ""
    for name in ("first submit (new code)", "unchanged resubmit"):
        before, logins, start = STATS.snapshot(), sshbed.logins(), time.perf_counter()
        last = _cli("submit", str(spec), "-c", str(profile))
        seconds, c = time.perf_counter() - start, _delta(before)
        code = code_size if "uploading code" in last else 0
        print(
            f"{name:<26} {c.connections:>5} {sshbed.logins() - logins:>4} {c.round_trips:>11} {code:>10,} "
            f"{c.bytes_sent - code:>13,} {seconds * 1000:>7.0f}"
        )
    return last


def latency(home: Path, profile: Path, spec: Path, run_dir: str, runs: int) -> None:
    info = tb.ssh_info()
    bare = [
        "ssh",
        "-q",
        "-o",
        "BatchMode=yes",
        "-o",
        f"UserKnownHostsFile={info['known_hosts']}",
        "-i",
        str(info["identity_file"]),
        "-p",
        str(info["port"]),
        f"{info['user']}@{info['host']}",
        "sbatch",
        "--parsable",
        "--job-name=bench",
        f"--chdir={run_dir}",
        f"{run_dir}/job.sbatch",
    ]
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    meshrun = [sys.executable, "-m", "meshrun.submit.cli.main", "submit", str(spec), "-c", str(profile)]
    ssh_s = _median_s(lambda: subprocess.run(bare, check=True, capture_output=True, env=env), runs)
    cli_s = _median_s(lambda: subprocess.run(meshrun, check=True, capture_output=True, env=env, cwd=REPO), runs)
    inproc_s = _median_s(lambda: _cli("submit", str(spec), "-c", str(profile)), runs)
    print(f"\nsubmit latency, median of {runs}        ms   x bare ssh")
    print(f"{'bare `ssh host sbatch`':<32} {ssh_s * 1000:>6.0f} {1.0:>9.2f}")
    print(f"{'meshrun submit (command)':<32} {cli_s * 1000:>6.0f} {cli_s / ssh_s:>9.2f}")
    print(f"{'meshrun submit (in-process)':<32} {inproc_s * 1000:>6.0f} {inproc_s / ssh_s:>9.2f}")


def status_of_many(home: Path, profile: Path, spec: Path, jobs: int) -> None:
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry

    out = _cli("submit", str(spec), "-c", str(profile), "--sweep", "env.I=" + ",".join(map(str, range(jobs))))
    array = out.split()[3]
    records = Registry().find_all(array)
    clusters = api.Clusters()
    try:
        clusters.transport_for(records[0]).home()  # connect first: count the query alone
        before, start = STATS.snapshot(), time.perf_counter()
        found = api.statuses(records, clusters)
        seconds, c = time.perf_counter() - start, _delta(before)
        clusters.transport_for(records[0]).run(["scancel", array])
    finally:
        clusters.close()
    print(
        f"\nstatus of {len(found)} jobs: {c.round_trips} round trip(s), {seconds * 1000:.0f} ms "
        f"({sum(s.state != 'UNKNOWN' for s in found)} states known)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--keep", action="store_true", help="leave the testbed running")
    parser.add_argument("--quick", action="store_true", help="1 latency run, 4 jobs (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.jobs = 1, 4
    already_up = all(tb.status().values())
    tb.up()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            os.environ.update(HOME=str(home), XDG_STATE_HOME=str(home / "state"), XDG_CONFIG_HOME=str(home / "c"))
            os.environ.pop("SLURM_CONF", None)  # a laptop: the cluster is reached over SSH only
            profile, spec = sshbed.profile(home), _project(home) / "job.yaml"
            out = submits(home, profile, spec)
            run_dir = next(l.split(": ", 1)[1] for l in out.splitlines() if l.startswith("run dir: "))
            latency(home, profile, spec, run_dir, args.runs)
            status_of_many(home, profile, spec, args.jobs)
    finally:
        if not (already_up or args.keep):
            tb.down()


if __name__ == "__main__":
    main()
