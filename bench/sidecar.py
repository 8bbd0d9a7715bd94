"""The sidecar's cost to training: step time with `python -m meshrun.launcher.sidecar` sampling against without it.

    .venv/bin/python bench/sidecar.py [--steps N] [--rounds R] [--interval S] [--quick]

One in-process rank runs the trainer's own loop (bench/trainer_setup.py) beside a real sidecar process
on the same run dir (sampling, reading the rank's heartbeat for the hang watch), started once (its start is not measured): rounds alternate (ABBA) between the
sidecar paused (SIGSTOP: no sidecar) and running (SIGCONT). The sidecar samples every --interval seconds: 1 s by default,
five times the spec's default rate, so the figure is an upper bound. On a GPU machine it reads NVML
for every visible GPU; here it reads /proc only. The ratio is of the medians. Goal: overhead < 1%.
--quick times 2 steps x 1 round at 0.2 s: the same code, CI's check that the bench runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_setup import REPO, corpus, single_rank_trainer, timed_steps  # noqa: E402

from meshrun.launcher.contract.records.rundir import RunDir  # noqa: E402
from meshrun.launcher.contract.spec.job import (  # noqa: E402
    Data,
    JobSpec,
    Model,
    Resources,
    RunInfo,
    RunSpec,
    Sidecar,
    Train,
    write_run_spec,
)
from meshrun.launcher.train.metrics import MetricsLog  # noqa: E402
from meshrun.launcher.train.trainer import Trainer  # noqa: E402

MODEL = Model(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128)


def job_for(data: Path, steps: int, interval_s: float) -> JobSpec:
    train = Train(model=MODEL, steps=steps, global_batch=8, micro_batch=8, warmup_steps=5, log_every=10, seed=0)
    return JobSpec(
        name="sidecar-bench",
        resources=Resources(tasks_per_node=1),
        train=train,
        data=Data(path=str(data)),
        sidecar=Sidecar(interval_s=interval_s),
    )


def timed_round(t: Trainer, first: int, steps: int, run_dir: Path) -> float:
    """Seconds for `steps` steps of the trainer's own loop."""
    # rank 0 stamps its heartbeat (in both arms): the sidecar's hang watch reads it every second.
    metrics = MetricsLog(str(run_dir), enabled=True, steps=t.cfg.steps, rank=0)
    real_stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    try:
        elapsed = timed_steps(t, metrics, first, steps)
    finally:
        sys.stdout.close()
        sys.stdout = real_stdout
        metrics.close()
    return elapsed


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lines(path: str) -> int:
    try:
        with open(path, "rb") as handle:
            return sum(1 for _ in handle)
    except FileNotFoundError:
        return 0


def start_sidecar(run_dir: RunDir) -> subprocess.Popen[bytes]:
    """A real sidecar, returned once its first sample is written (its start is not what is measured)."""
    before = lines(run_dir.gpu_metrics)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "meshrun.launcher.sidecar", run_dir.root], env=env)
    deadline = time.monotonic() + 60
    while lines(run_dir.gpu_metrics) <= before:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench/sidecar.py: the sidecar wrote no sample; see {run_dir.logs}")
        time.sleep(0.05)
    return proc


def stop_sidecar(proc: subprocess.Popen[bytes]) -> None:
    # USR2, as the batch script sends once the ranks have ended (a TERM would make it wait for this
    # process, the rank, to end first).
    proc.send_signal(signal.SIGUSR2)
    if proc.wait(timeout=30) != 0:
        raise SystemExit(f"bench/sidecar.py: the sidecar exited {proc.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each kind (plus one warm-up each)")
    parser.add_argument("--interval", type=float, default=1.0, help="the sidecar's sampling interval, seconds")
    parser.add_argument("--quick", action="store_true", help="2 steps x 1 round at 0.2 s (CI's check)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.interval = 2, 1, 0.2
    total = args.steps * 2 * (args.rounds + 1)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir(str(Path(tmp) / "run"))
        Path(run_dir.root).mkdir()
        job = job_for(corpus(Path(tmp), 50_000 if args.quick else 400_000), total, args.interval)
        run = RunInfo(cluster="bench", scheduler="local", run_dir=run_dir.root)
        write_run_spec(RunSpec(job=job, run=run), Path(run_dir.root))
        times: dict[bool, list[float]] = {False: [], True: []}
        samples, step, sidecar_cpu, running_s = 0, 1, 0.0, 0.0
        with single_rank_trainer(job) as t:
            proc = start_sidecar(run_dir)
            proc.send_signal(signal.SIGSTOP)  # paused: "without" rounds; SIGCONT for the "with" ones
            try:
                for round_ in range(args.rounds + 1):  # round 0 warms both up and is not counted
                    # ABBA order: a drift in the machine's load hits both kinds alike.
                    for running in (False, True) if round_ % 2 == 0 else (True, False):
                        before = lines(run_dir.gpu_metrics)
                        if running:
                            proc.send_signal(signal.SIGCONT)
                            time.sleep(0.05)  # let it take the sample it owes from the pause
                            before, cpu_before = lines(run_dir.gpu_metrics), cpu_seconds(proc.pid)
                        elapsed = timed_round(t, step, args.steps, Path(run_dir.root))
                        if running:
                            proc.send_signal(signal.SIGSTOP)
                            if round_:
                                sidecar_cpu += cpu_seconds(proc.pid) - cpu_before
                                running_s += elapsed
                        step += args.steps
                        if round_:
                            times[running].append(elapsed)
                            samples += lines(run_dir.gpu_metrics) - before if running else 0
            finally:
                proc.send_signal(signal.SIGCONT)
                stop_sidecar(proc)
        log = "".join(p.read_text() for p in Path(run_dir.logs).glob("sidecar-*.log"))
    base, mine = statistics.median(times[False]), statistics.median(times[True])
    nvml = "NVML" if "GPU metrics for" in log else "no NVML: /proc only"
    print(f"{args.steps} steps x {args.rounds} rounds each; sidecar every {args.interval:g} s ({nvml})")
    print(f"without sidecar : {base / args.steps * 1000:8.2f} ms/step")
    print(f"with sidecar    : {mine / args.steps * 1000:8.2f} ms/step  ({samples} sample lines in the timed rounds)")
    share = 100 * sidecar_cpu / running_s if running_s else 0.0
    print(f"sidecar CPU     : {share:8.2f}% of one core while running (clock ticks: a coarse figure)")
    print(f"ratio with/without {mine / base:.4f}  overhead {(mine / base - 1) * 100:.2f}% (goal < 1%)")


if __name__ == "__main__":
    main()
