"""Hang detection latency against the configured timeout, with the real sidecar and real rank processes.

    .venv/bin/python bench/hang.py [--floors 2,5,10] [--trials 3] [--quick]

Per trial: a run dir whose spec sets watchdog.step_floor_s (the step timeout is then about the floor:
the fake ranks' steps take 20 ms), a real `python -m meshrun.launcher.sidecar` on it, and two rank processes
that stamp heartbeats through meshrun.launcher.report.Heartbeat every step, then stop at a known moment (one
in a function of its own, one in a function named all_reduce). Measured from each rank's last
heartbeat: the declaration (verdict.json's found-at time), the verdict (stacks collected) and the
ranks' end (SIGKILL). The goal: declared within the timeout plus the sidecar's 1 s tick, i.e. a
ratio declaration/timeout <= 1 + 1/timeout. --quick: one trial at a 1 s floor (CI's check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshrun.launcher.contract.records.rundir import RunDir, node_name  # noqa: E402
from meshrun.launcher.contract.spec.job import JobSpec, Resources, RunInfo, RunSpec, Sidecar, Watchdog, write_run_spec  # noqa: E402

RANK = """
import sys, time
from meshrun.launcher.report import Heartbeat

def stuck_in_user_code():
    while True:
        time.sleep(1)

def all_reduce():
    while True:
        time.sleep(1)

rank, steps = int(sys.argv[1]), int(sys.argv[2])
beat = Heartbeat(sys.argv[3], rank)
for step in range(1, steps + 1):
    beat.stamp(step, "step")
    time.sleep(0.02)
stuck_in_user_code() if rank else all_reduce()
"""
STEPS = 300
"""Steps before the ranks stop: 6 s at 20 ms, well past the watch's warm-up."""


def trial(tmp: Path, floor_s: float) -> dict[str, float]:
    run_dir = RunDir(str(tmp / "run"))
    Path(run_dir.root).mkdir(parents=True)
    job = JobSpec(
        name="hang-bench",
        resources=Resources(tasks_per_node=2),
        command=("true",),
        sidecar=Sidecar(interval_s=5.0),
        watchdog=Watchdog(step_floor_s=floor_s, diagnosis_wait_s=5.0),
    )
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="bench", scheduler="local", run_dir=run_dir.root)), tmp / "run")
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", MESHRUN_JOB_ID="bench")
    sidecar = subprocess.Popen([sys.executable, "-m", "meshrun.launcher.sidecar", run_dir.root], env=env)
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(STEPS), run_dir.root], env=env)
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not Path(run_dir.verdict_json).exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/hang.py: no verdict in 120 s; see {run_dir.logs}")
            time.sleep(0.05)
        written = Path(run_dir.verdict_json).stat().st_mtime
        for proc in ranks:
            proc.wait(timeout=30)
        ended = time.time()
        verdict = json.loads(Path(run_dir.verdict_json).read_text())
        node = run_dir.node_dir("", node_name({}))
        last = max(json.loads(Path(node.progress(r)).read_text())["time"] for r in range(2))
        return {
            "timeout": verdict["timeout_s"],
            "declared": verdict["time"] - last,
            "verdict": written - last,
            "ended": ended - last,
        }
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
        sidecar.terminate()
        sidecar.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--floors", default="2,5,10", help="watchdog.step_floor_s values, seconds")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one trial at a 1 s floor (CI's check)")
    args = parser.parse_args()
    floors = [1.0] if args.quick else [float(f) for f in args.floors.split(",")]
    trials = 1 if args.quick else args.trials
    print(f"{'floor s':>8} {'timeout s':>10} {'declared s':>11} {'verdict s':>10} {'ended s':>8} {'ratio':>6}")
    for floor in floors:
        rows = []
        for _ in range(trials):
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(trial(Path(tmp), floor))
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        ratio = med["declared"] / med["timeout"]
        print(
            f"{floor:>8g} {med['timeout']:>10.2f} {med['declared']:>11.2f} {med['verdict']:>10.2f} "
            f"{med['ended']:>8.2f} {ratio:>6.2f}"
        )
        print(f"detection latency / timeout = {ratio:.2f} (goal <= {1 + 1 / med['timeout']:.2f}; median of {trials})")


if __name__ == "__main__":
    main()
