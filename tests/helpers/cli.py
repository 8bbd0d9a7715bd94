"""Running the real `meshrun` command in a private home, as a user would."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

REPO = Path(__file__).resolve().parents[2]


# What only the testbed's login node has: a "laptop" that reaches it over SSH must not see them.
CLUSTER_ONLY = ("SLURM_CONF", "MESHRUN_TESTBED_VENV", "MESHRUN_CLUSTERS")
SOAK = os.environ.get("MESHRUN_SOAK") == "1"
"""Soak tests run a few trials in CI and their full count (20+) with MESHRUN_SOAK=1."""


def trials(ci: int, soak: int = 20) -> int:
    """How many trials a soak test runs: `ci` in CI, `soak` under MESHRUN_SOAK=1."""
    return soak if SOAK else ci


def repo_pythonpath() -> str:
    """PYTHONPATH for a process that must import this checkout: the checkout first, then what the suite's runner
    put there (scripts/suite_cpu.py's hooks, which count each process's CPU: a replaced PYTHONPATH hid the
    executed examples' ~90 s)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def env_for(home: Path, laptop: bool = False) -> dict[str, str]:
    """The environment of a user whose HOME (and so ~/.ssh/config, the registry...) is `home`;
    a laptop's has no Slurm configuration, so nothing can reach the cluster but SSH."""
    env = dict(
        os.environ,
        HOME=str(home),
        XDG_STATE_HOME=str(home / "state"),
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_CACHE_HOME=str(home / ".cache"),  # HOME's default, whatever the caller's environment says
        PYTHONUNBUFFERED="1",
    )
    return {k: v for k, v in env.items() if not (laptop and k in CLUSTER_ONLY)}


def meshrun(
    home: Path,
    *args: str,
    timeout: float = 300,
    check: bool = False,
    input: str = "",
    laptop: bool = False,
    env: Optional[dict[str, str]] = None,
) -> subprocess.CompletedProcess:
    """`meshrun ARGS` with HOME and the XDG dirs inside `home` (its own registry and run dirs); `env` adds to it."""
    done = subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", *args],
        capture_output=True,
        text=True,
        env={**env_for(home, laptop), **(env or {})},
        cwd=REPO,
        timeout=timeout,
        input=input,
    )
    if check:
        assert done.returncode == 0, f"meshrun {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def submitted(out: subprocess.CompletedProcess) -> tuple[str, Path]:
    """(job id, run dir) from `meshrun submit` output."""
    lines = out.stdout.splitlines()
    job_id = next(l.split()[2] for l in lines if l.startswith("submitted job "))
    run_dir = Path(next(l.split(": ", 1)[1] for l in lines if l.startswith("run dir: ")))
    return job_id, run_dir


def status(home: Path, job_id: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    out = meshrun(home, "status", job_id, "--json", check=True, env=env)
    (row,) = json.loads(out.stdout)
    return row


FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"})
"""States a job does not leave: a wait for them may poll slowly without missing one."""


def poll_pauses(want: Iterable[str] = (), first: float = 0.5, slowest: float = 2.0) -> Iterator[float]:
    """The pauses between two `meshrun status` polls: `first`, then (when every state waited for is final, so
    none can be missed) 1.5 times longer each time up to `slowest`. A poll through a `meshrun` process is ~0.1 s
    of CPU, and the suite is CPU-bound on CI's 2 cores: 911 fixed 0.5 s polls took 75 CPU-s of one run."""
    pause = first
    grow = bool(set(want)) and set(want) <= FINAL_STATES
    while True:
        yield pause
        if grow:
            pause = min(slowest, pause * 1.5)


def status_here(home: Path, job_id: str) -> dict[str, Any]:
    """`meshrun status JOB --json` as `status` runs it (the CLI's own main(), the same arguments and environment),
    but in this process: a poll that only waits costs no new interpreter. Each `meshrun` process is ~0.1 s of CPU,
    nearly all of it imports, and the suite's waits polled ~600 times a run on CI's 2 cores (CPU-bound).
    The environment and umask main() sets are this process's own again afterwards."""
    from meshrun.submit.cli.main import main

    environ, out, err = env_for(home), io.StringIO(), io.StringIO()
    saved, mask = dict(os.environ), os.umask(0o077)
    try:
        os.environ.clear()
        os.environ.update(environ)
        with redirect_stdout(out), redirect_stderr(err):
            code = main(["status", job_id, "--json"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.umask(mask)
    assert code == 0, f"meshrun status {job_id} --json -> {code}\n{out.getvalue()}\n{err.getvalue()}"
    (row,) = json.loads(out.getvalue())
    return dict(row)


def wait_for_state(home: Path, job_id: str, want: set[str], timeout: float = 240) -> dict[str, Any]:
    """`meshrun status JOB --json` (in this process: status_here) until the job's state is one of `want`; its row."""
    deadline = time.monotonic() + timeout
    pauses = poll_pauses(want)
    while (row := status_here(home, job_id))["state"] not in want:
        assert time.monotonic() < deadline, row
        time.sleep(next(pauses))
    return row


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until rank 0 has logged `step` to metrics.jsonl."""
    deadline = time.monotonic() + timeout
    while max((r.get("step", 0) for r in metrics(run_dir)), default=0) < step:
        assert time.monotonic() < deadline, f"step {step} not reached in {run_dir}"
        time.sleep(0.1)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Complete step lines of metrics.jsonl ([] before the first; a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip() and line.endswith("}")]
    return [r for r in rows if "event" not in r]  # step lines only (checkpoint events are lines of their own)


# The model the tests train: small enough for CPU ranks on a 2-core machine; its batch is one micro-batch
# of 4 per data-parallel rank at dp 2 (no accumulation: each micro-batch of FSDP gathers the weights and
# reduces the gradients again, and at 16 the ranks spent 40% more CPU on the same proofs).
SMALL_MODEL = [
    "--set",
    "train.model.n_layers=2",
    "--set",
    "train.model.d_model=64",
    "--set",
    "train.model.seq_len=64",
    "--set",
    "train.global_batch=8",
]
# A tiny GPT on the local cluster (two ranks): the spec the local integration tests train.
TINY = [
    "examples/tiny.yaml",
    "-c",
    "local",
    *SMALL_MODEL,
    "--set",
    "train.eval_every=0",
    "--set",
    "train.log_every=1",
]


# Settings that make the sidecar's hang watch quick in tests: a tiny step takes ~50 ms, so the step
# timeout is ~3 s once a few steps are timed (before that the setup timeout applies: hang late).
FAST_WATCH = [
    "--set",
    "watchdog.step_floor_s=3",
    "--set",
    "watchdog.diagnosis_wait_s=10",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=0",
    "--set",
    "checkpoint.every=20",
]


# Rank 1 as a straggler the sidecar names within seconds, on any machine. Rank 1 burns 0.8 s more per
# step; with two ranks the median is their mean, so the ratio is 2(a + 0.8)/(2a + 0.8) for a rank's own
# work a: 1.83 at a = 0.1 s, 1.4 at a = 0.6 s (a loaded 2-core CI machine). The factor 1.25 names it
# for any a under 1.2 s (1.5, the default, missed it in CI: at a = 0.4 s the ratio is exactly 1.5).
STRAGGLER_FACTOR = 1.25
SLOW_RANK_1 = [
    "--set",
    "env.MESHRUN_TEST_SLOW=1:0.8",
    "--set",
    "watchdog.straggler_check_s=1",
    "--set",
    f"watchdog.straggler_factor={STRAGGLER_FACTOR}",
]

# Two ranks, one on each of the testbed's two nodes.
TWO_NODES = [
    "examples/two-node.yaml",
    "-c",
    "testbed",
    "--set",
    "resources.tasks_per_node=1",
    "--set",
    "parallel.dp=2",
]


def slurm_job_fields(slurm_conf: str, job_id: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as {field: value} (NodeList, ExcNodeList, NumNodes, ...), from the testbed's Slurm."""
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        env={"SLURM_CONF": slurm_conf, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)
