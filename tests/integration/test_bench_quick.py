"""Benches cannot rot: every bench's quick mode runs here as a user runs it, and prints its numbers.

A quick mode takes the bench's own code path with tiny sizes (seconds, not minutes), so a change
that breaks a bench fails CI; the full runs stay manual (docs/benchmarks.md). bench/gpu.sh needs a
GPU: here only its fail-fast answer on a machine without one is checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
NUMBER = r"[0-9][0-9,]*\.?[0-9]*"

QUICK: dict[str, tuple[list[str], list[str]]] = {
    # bench: (its arguments, patterns its output must hold: the table or the ratios it exists for)
    "plan_scale.py": (
        ["--quick"],
        [
            rf"plan\+validate\+render 1024 nodes x 8 GPUs: {NUMBER} ms .*ratio {NUMBER}",
            rf"expand_hostlist 10,000 hosts: {NUMBER} ms .*ratio {NUMBER}",
        ],
    ),
    "plan_mesh.py": (
        ["--quick"],
        [rf"^ +8,192 +128 +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}$", rf"8,192 ranks: {NUMBER} s"],
    ),
    "cli_startup.py": (
        ["--quick"],
        [
            rf"meshrun --help +{NUMBER} +{NUMBER} +no$",
            rf"meshrun render +{NUMBER} +{NUMBER} +no$",
            rf"creating [1-9][0-9]* dataclasses {NUMBER} = {NUMBER} ms",  # the probe ran render and counted them
        ],
    ),
    "checkpoint.py": (
        ["--quick"],
        [
            r"state: [0-9] MB",  # the small state: single-digit megabytes
            rf"ratio save/cp {NUMBER}",
            rf"stall / synchronous save = {NUMBER}",
            rf"ratio load/read {NUMBER}",
        ],
    ),
    "copier.py": (
        ["--quick"],
        [
            rf"async save stall +{NUMBER} s +{NUMBER} s +{NUMBER}",
            rf"copy vs cp -r +{NUMBER} MB/s +{NUMBER} MB/s +{NUMBER}",
            rf"copy vs cp -r \+ sync +{NUMBER} MB/s +{NUMBER} MB/s +{NUMBER}",
        ],
    ),
    "plan_accuracy.py": (
        ["--quick"],
        [
            r"^calibration: the CPU figures of partition local recorded in ",
            rf"L2-d128-s128 +dp2-ddp +{NUMBER} +{NUMBER} +[+-]{NUMBER}%",
            rf"^error over 1 jobs \(fitted on\): median \|error\| {NUMBER}%, worst {NUMBER}%",
        ],
    ),
    "throughput.py": (
        ["--quick"],
        [rf"meshrun loop : +{NUMBER} tokens/s", rf"minimal loop : +{NUMBER} tokens/s", rf"ratio +: {NUMBER}"],
    ),
    "sidecar.py": (
        ["--quick"],
        [rf"ratio with/without {NUMBER} +overhead -?{NUMBER}%", rf"sidecar CPU +: +{NUMBER}% of one core"],
    ),
    "export_memory.py": (
        ["--quick"],
        [  # streamed: the peak stays below the model's size; whole: the measurement sees the model
            r"export streamed, meshrun: peak \+[0-9]+ MB, ratio peak/model 0\.[0-9]+$",
            r"export streamed, hf +: peak \+[0-9]+ MB, ratio peak/model 0\.[0-9]+$",
            r"export whole model +: peak \+[0-9]+ MB, ratio peak/model [1-9][0-9]*\.[0-9]+$",
        ],
    ),
    "data_encode.py": (
        ["--quick"],
        [rf"ratio meshrun/tokenizers: {NUMBER}", rf"meshrun data \(bytes\) +: +{NUMBER} tokens/s"],
    ),
    "hang.py": (["--quick"], [rf"detection latency / timeout = {NUMBER} \(goal <= {NUMBER}"]),
    "deepspeed.py": (
        ["--quick"],
        [rf"^ZeRO-{z} +{NUMBER} +{NUMBER}(  +{NUMBER} \( *{NUMBER}\)){{4}}$" for z in range(4)],
    ),
    "gpu_train.py": (
        ["--quick"],
        # on CPU the energy is unmeasured (no NVML, no readable RAPL here), never a guess
        [
            rf"steps [0-9]+-[0-9]+: {NUMBER} ms/step, {NUMBER} tokens/s, .*MFU.*; energy GPU unmeasured, CPU .*; 0 GPU-hours"
        ],
    ),
    "gpu_plan.py": (
        ["--quick"],
        [  # the journey through the CLI: datasheet plan (no CPU time without doctor), doctor, calibrated plan, run
            r"^ROW\tplan, datasheet\tno step time",
            r"^ROW\tplan, calibrated\t[0-9.e-]+ s/step, .*; calibrated on ",
            rf"^ROW\trun 8 steps\tmeasured {NUMBER} s/step .*plan error: calibrated [+-]{NUMBER}%$",
            r"^ROW\tstatus used\t.*no GPUs; energy not measured",
        ],
    ),
    "gpu_ops.py": (
        ["all", "--quick"],
        [
            r"^ROW\tnvml",
            rf"^ROW\tbf16 gemm 256\^3\t{NUMBER} TFLOP/s",
            rf"^ROW\tall-reduce\t{NUMBER} GB/s bus bandwidth \(gloo, 2 ranks",
        ],
    ),
}
ON_TESTBED = {
    "restart.py": (
        ["--quick"],
        [rf"restart inside the allocation \(1 spare\) +{NUMBER} ", rf"ratio restart/requeue = {NUMBER}"],
    ),
    "health.py": (
        ["--quick"],
        [rf"health check, {kind} job +{NUMBER} +{NUMBER} +{NUMBER} s$" for kind in ("command", "trainer")],
    ),
    "ssh_submit.py": (
        ["--quick"],
        [
            rf"first submit \(new code\) +{NUMBER} +{NUMBER} +{NUMBER}",
            rf"meshrun submit \(command\) +{NUMBER} +{NUMBER}",
            r"status of 4 jobs: 1 round trip",
        ],
    ),
    "status_scale.py": (
        ["--quick"],
        [
            rf"status of 100 jobs {where} *: 1 round trip, {NUMBER} ms, .*ratio {NUMBER}$"
            for where in ("login node", "over SSH")
        ],
    ),
}
HELPERS = {"trainer_setup.py", "meshrun_cli.py"}  # imported by the benches; not benches themselves


def run_bench(name: str, args: list[str], tmp_path: Path) -> str:
    env = dict(
        os.environ,
        XDG_STATE_HOME=str(tmp_path / "state"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        TMPDIR=str(tmp_path),
        PYTHONPATH=repo_pythonpath(),
        OMP_NUM_THREADS="1",
    )  # on 2 shared cores, OpenMP threads spinning in barriers cost many-fold
    done = subprocess.run(
        [sys.executable, str(BENCH / name), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=180
    )
    assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def check_output(name: str, out: str, patterns: list[str]) -> None:
    for pattern in patterns:
        assert re.search(pattern, out, re.MULTILINE), f"{name}: no line matches {pattern!r} in:\n{out}"


def test_every_bench_has_a_quick_run_here() -> None:
    benches = {p.name for p in BENCH.glob("*.py")} - HELPERS
    assert benches == set(QUICK) | set(ON_TESTBED), "a bench without a quick run in this file (or one gone)"
    assert (BENCH / "gpu.sh").is_file()


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode_runs_and_prints_its_numbers(name: str, tmp_path: Path) -> None:
    args, patterns = QUICK[name]
    check_output(name, run_bench(name, args, tmp_path), patterns)


@pytest.mark.parametrize("name", sorted(ON_TESTBED))
def test_quick_mode_on_the_testbed(name: str, tmp_path: Path, testbed: dict[str, object]) -> None:
    args, patterns = ON_TESTBED[name]
    check_output(name, run_bench(name, args, tmp_path), patterns)


def test_gpu_sh_without_a_gpu_stops_at_once_with_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run bench/gpu.sh itself")
    done = subprocess.run(
        ["bash", str(BENCH / "gpu.sh")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHON=sys.executable),
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == "", done
    assert re.fullmatch(r"bench/gpu\.sh: no usable GPU: .+; run it on a GPU machine\n", done.stderr), done.stderr
