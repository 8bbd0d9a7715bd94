"""The health gate's cost per start on the real Slurm testbed, against a bare srun step measured in the same run.

    .venv/bin/python bench/health.py [--runs N] [--keep] [--quick]

Per run, on both testbed nodes: `srun -N2 true` (the baseline: what any step costs), then the health check as
the batch script runs it (`srun -N2 python -m meshrun.launcher.probes.health RUN_DIR NOW`) and the verdict
(`python -m meshrun.launcher.batch.gate RUN_DIR`), for a `command:` job and a trainer job (the testbed's nodes have no
usable GPUs: a GPU job's check also asks NVML and imports torch, a few seconds more). Prints the medians, the
ratio to the bare step, and the slowest node's own time for its checks (from its answer). Goal: under 10 s per node. Starts the testbed when it is not
running and stops it again unless --keep. --quick: 1 run (CI's check that the bench runs).
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

from meshrun.launcher.contract.records.rundir import RunDir  # noqa: E402
from meshrun.launcher.contract.spec.job import JobSpec, Model, Resources, RunInfo, RunSpec, Train, write_run_spec  # noqa: E402
from tests.testbed import testbed as tb  # noqa: E402

NODES = ("n1", "n2")


def run_dir(root: Path, trainer: bool) -> str:
    folder = root / ("trainer" if trainer else "command")
    folder.mkdir()
    job = JobSpec(
        name="bench",
        resources=Resources(nodes=len(NODES)),
        train=Train(model=Model(n_layers=2, d_model=64, seq_len=64)) if trainer else None,
        command=None if trainer else ("true",),
    )
    write_run_spec(RunSpec(job, RunInfo(cluster="testbed", scheduler="slurm", run_dir=str(folder))), folder)
    return str(folder)


def seconds(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    return time.perf_counter() - start


def srun(*words: str) -> list[str]:
    return ["srun", "-p", "debug", "-N", str(len(NODES)), "--ntasks-per-node=1", "--quiet", *words]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="leave the testbed running")
    parser.add_argument("--quick", action="store_true", help="1 run (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    already_up = all(tb.status().values())
    tb.up()
    env = {**os.environ, **tb.client_env(), "PYTHONPATH": str(REPO), "SLURM_JOB_NODELIST": "n[1-2]"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dirs = {"command job": run_dir(Path(tmp), False), "trainer job": run_dir(Path(tmp), True)}
            bare = statistics.median(seconds(srun("true"), env) for _ in range(args.runs))
            print(f"{'case':<26} {'median s':>9} {'x bare srun':>12}  per node (its own checks)")
            print(f"{'srun -N2 true':<26} {bare:>9.2f} {1.0:>12.2f}")
            for name, folder in dirs.items():
                check = srun(sys.executable, "-m", "meshrun.launcher.probes.health", folder)
                times = [seconds([*check, f"{time.time():.3f}"], env) for _ in range(args.runs)]
                gate = statistics.median(
                    seconds([sys.executable, "-m", "meshrun.launcher.batch.gate", folder], env)
                    for _ in range(args.runs)
                )
                own = [json.loads(Path(RunDir(folder).health_result(n)).read_text())["seconds"] for n in NODES]
                verdict = json.loads(Path(RunDir(folder).health_verdict).read_text())
                assert verdict["action"] == "start", verdict
                med = statistics.median(times)
                print(f"{'health check, ' + name:<26} {med:>9.2f} {med / bare:>12.2f}  {max(own):.2f} s")
                print(f"{'gate verdict, ' + name:<26} {gate:>9.2f} {gate / bare:>12.2f}")
    finally:
        if not (already_up or args.keep):
            tb.down()


if __name__ == "__main__":
    main()
