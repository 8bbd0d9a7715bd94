"""From a rank's death to the next first step: a restart inside the allocation on a spare node against a requeue
of the same job, on the real Slurm testbed, measured in one run (the goal: under a quarter).

    .venv/bin/python bench/restart.py [--trials N] [--keep] [--quick]

Per trial and per way, the same 1-node training job (the tests' small model, a checkpoint every 5 steps) is
submitted with `meshrun submit`: once with `resilience.spare_nodes: 1` (the testbed has two nodes), once
without. At step 12 its rank is killed with -9; the time from the kill to the next `train_start` line in
metrics.jsonl (the restarted ranks begin their first step, after the resume) is the cost of the failure
(the steps trained again after the checkpoint are not in it). Prints the medians and their ratio. Starts
the testbed when it is not running and stops it again unless --keep. --quick: one trial (CI's check).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.cli import SMALL_MODEL, TWO_NODES, meshrun, submitted, wait_for_step  # noqa: E402
from tests.testbed import testbed as tb  # noqa: E402

KILL_AT = 12


def _rank_pid(run_dir: Path, timeout: float = 30) -> int:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if cmd[-3:] == ["-m", "meshrun.launcher", str(run_dir)] and os.path.basename(cmd[0]).startswith("python"):
                return int(proc.pid)
        time.sleep(0.05)
    raise RuntimeError(f"no rank process of {run_dir}")


def _train_starts(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [float(r["time"]) for r in rows if r.get("event") == "train_start"]


def one(home: Path, corpus: str, spare: bool) -> float:
    """Seconds from the kill to the restarted ranks' first step."""
    args = [*TWO_NODES, *SMALL_MODEL, "--set", "resources.nodes=1", "--set", "parallel.dp=1"]
    args += ["--set", f"data.path={corpus}", "--set", "train.steps=1000", "--set", "checkpoint.every=5"]
    args += ["--set", "train.log_every=1", "--set", "resilience.avoid_suspects=false"]
    args += ["--set", f"resilience.spare_nodes={1 if spare else 0}"]
    job_id, run_dir = submitted(meshrun(home, "submit", *args, check=True))
    try:
        wait_for_step(run_dir, KILL_AT, timeout=240)
        os.kill(_rank_pid(run_dir), signal.SIGKILL)
        killed = time.time()
        deadline = time.monotonic() + 300
        while not [t for t in _train_starts(run_dir) if t > killed]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not start again in 300 s")
            time.sleep(0.1)
        return min(t for t in _train_starts(run_dir) if t > killed) - killed
    finally:
        meshrun(home, "cancel", job_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="leave the testbed running")
    parser.add_argument("--quick", action="store_true", help="1 trial (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.trials = 1
    already_up = all(tb.status().values())
    tb.up()
    os.environ.update(tb.client_env(), MESHRUN_TESTBED_VENV=sys.prefix)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            corpus = home / "corpus.u16"
            import logging  # a small corpus, as the tests' (the logging package's sources)

            source = os.path.dirname(logging.__file__)
            data = [sys.executable, "-m", "meshrun.submit.cli.main", "data", source, "--out", str(corpus)]
            subprocess.run(data, check=True, capture_output=True, env={**os.environ, "HOME": tmp}, cwd=REPO)
            spare, requeue = [], []
            for _ in range(args.trials):  # alternating: the machine's load falls on both alike
                spare.append(one(home, str(corpus), spare=True))
                requeue.append(one(home, str(corpus), spare=False))
    finally:
        if not (already_up or args.keep):
            tb.down()
    a, b = statistics.median(spare), statistics.median(requeue)
    print(f"{'kill -9 of the rank to its next first step':<44} {'median s':>9}  trials")
    print(f"{'restart inside the allocation (1 spare)':<44} {a:>9.2f}  {', '.join(f'{x:.2f}' for x in spare)}")
    print(f"{'requeue (no spare)':<44} {b:>9.2f}  {', '.join(f'{x:.2f}' for x in requeue)}")
    print(f"ratio restart/requeue = {a / b:.3f} (goal < 0.25)")


if __name__ == "__main__":
    main()
