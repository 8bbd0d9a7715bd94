"""Time limits, requeue and resume through the real CLI: on the real Slurm testbed and on `local`.

A real preemption (Slurm's own SIGTERM, grace time and requeue), with a run bit-identical to an
uninterrupted one, is tests/integration/test_real_preemption.py.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from safetensors.torch import load_file

from tests.helpers.cli import SMALL_MODEL, TWO_NODES, meshrun, metrics, status, submitted, wait_for_state, wait_for_step

STEPS = 150
RESUMED_STEPS = 40
"""test_resume_a_stopped_slurm_job_in_its_run_dir's job: its steps wait for their data (asleep) instead."""


def _train_args(corpus: Path, steps: int = STEPS) -> list[str]:
    return [
        "--set",
        f"data.path={corpus}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_every=0",
        "--set",
        "checkpoint.every=50",
    ]


def _two_ranks_on_two_nodes(corpus: Path, *extra: str) -> list[str]:
    return [
        *TWO_NODES,
        *_train_args(corpus),
        *extra,
    ]


def _step_rows(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if "event" not in r]


def test_time_limit_ends_in_a_checkpoint_and_a_requeue(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    # Two minutes, signalled 60 s ahead (testbed profile): training never ends by itself here. The first
    # attempt's steps wait 0.5 s for their data (asleep, not burning two cores for the minute before the signal).
    args = _two_ranks_on_two_nodes(
        corpus,
        "--set",
        "resources.time=2",
        "--set",
        "train.steps=1000000",
        "--set",
        "checkpoint.every=0",
        "--set",
        "env.MESHRUN_TEST_DATA_DELAY=0.5",
    )
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    deadline = time.monotonic() + 200
    log = run_dir / "logs" / "rank-0.log"
    while not (log.exists() and "restart 1" in log.read_text() and "resuming from step" in log.read_text()):
        assert time.monotonic() < deadline, (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
        time.sleep(1)
    meshrun(tmp_path, "cancel", job_id, check=True)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "SIGUSR1: passing it to the ranks" in batch and "ranks exited with status 75" in batch
    text = log.read_text()
    stopped = int(text.split("stopping after step ")[1].split()[0])
    assert f"resuming from step {stopped}" in text


def test_local_cancel_saves_then_resume_finishes_and_export_writes_safetensors(tmp_path: Path, corpus: Path) -> None:
    args = [
        "examples/tiny.yaml",
        "-c",
        "local",
        *SMALL_MODEL,
        *_train_args(corpus, steps=80),  # enough to cancel mid-run: the resume's rest was most of the time
    ]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_for_step(run_dir, 5)
    meshrun(tmp_path, "cancel", job_id, check=True)
    row = wait_for_state(tmp_path, job_id, {"CANCELLED", "FAILED"})
    assert row["state"] == "CANCELLED" and row["progress"].get("checkpoint_step", 0) >= 5, row
    out = meshrun(tmp_path, "resume", job_id, "--wait", check=True)
    assert f"resumed job {job_id} as job local-" in out.stdout and "COMPLETED" in out.stdout
    rows = _step_rows(run_dir)
    assert rows[-1]["step"] == 80 and status(tmp_path, out.stdout.split()[5])["state"] == "COMPLETED"
    # The cancelled job's row is still its own after the resume finished in the same run dir (it
    # showed the resume's step 80 and checkpoint).
    parent = status(tmp_path, job_id)
    assert parent["state"] == "CANCELLED" and parent["progress"]["step"] < 80, parent
    assert parent["progress"]["checkpoint_step"] == row["progress"]["checkpoint_step"], (parent, row)
    # Each job's `logs` is its own, though both append to the run dir's rank logs (a new user's trial: the
    # resumed job's logs opened with its parent's lines).
    child = out.stdout.split()[5]
    own = meshrun(tmp_path, "logs", child, check=True)
    assert own.stdout.startswith(f"[meshrun] local job {child} rank 0"), own.stdout[:300]
    assert job_id not in own.stdout and "own start" in own.stderr, own.stderr
    first = meshrun(tmp_path, "logs", job_id, check=True)
    assert first.stdout.startswith(f"[meshrun] local job {job_id} rank 0") and first.stderr == "", first.stderr
    target = tmp_path / "model.safetensors"
    exported = meshrun(tmp_path, "export", job_id, "-o", str(target), check=True)
    # The run dir's newest checkpoint is the resume's (step 80): the parent's export says whose it is and
    # how to get the parent's own (a new user's trial exported step 200 for a job that showed CKPT 41).
    own = row["progress"]["checkpoint_step"]
    assert "step-00000080" in exported.stdout and f"`--step {own}` exports it" in exported.stdout, exported.stdout
    weights = load_file(str(target))
    assert weights["tok_embeddings.weight"].shape == (256, 64) and len(weights) > 10


def test_resume_a_stopped_slurm_job_in_its_run_dir(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    # No requeue allowed: the signalled job saves, stops, and waits for a person. 40 steps whose data waits 0.3 s
    # (asleep: the signal has 11 s to land after step 3, without two ranks burning the cores meanwhile).
    delayed = ("--set", f"train.steps={RESUMED_STEPS}", "--set", "env.MESHRUN_TEST_DATA_DELAY=0.3")
    args = _two_ranks_on_two_nodes(corpus, "--set", "checkpoint.max_requeues=0", *delayed)
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_for_step(run_dir, 3)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert row["state"] == "FAILED" and row["restarts"] == 0, row
    assert "requeue limit (checkpoint.max_requeues=0) reached" in (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    out = meshrun(tmp_path, "resume", job_id, "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    new_id = out.stdout.split()[5]
    assert new_id != job_id and new_id.isdigit() and f"job {new_id} COMPLETED" in out.stdout
    rows = _step_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, RESUMED_STEPS + 1))
    assert "resuming from step" in (run_dir / "logs" / "rank-0.log").read_text()
    # Goodput per job and for the run: the resume is a job of its own in the same run dir.
    shown = " ".join(meshrun(tmp_path, "status", new_id, check=True).stdout.split())
    assert "the run dir's 2 jobs: " in shown and "% effective (productive " in shown, shown
