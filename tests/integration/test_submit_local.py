"""The embedded `local` cluster, end to end through the real CLI: real processes, real gloo, real files."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from meshrun.launcher.contract.records.rundir import node_name
from tests.helpers.cli import TINY, meshrun, metrics, status, submitted


def _tiny(corpus: Path, *extra: str) -> list[str]:
    return [*TINY, "--set", f"data.path={corpus}", *extra]


def test_submit_wait_trains_and_records(tmp_path: Path, corpus: Path) -> None:
    out = meshrun(tmp_path, "submit", *_tiny(corpus, "--set", "train.steps=12"), "--wait", check=True)
    job_id, run_dir = submitted(out)
    assert job_id.startswith("local-") and f"job {job_id} COMPLETED" in out.stdout
    assert f"metrics: {run_dir}/metrics.jsonl" in out.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"]
    # The run dir holds the spec as submitted, the resolved spec, the script and per-rank logs.
    assert {"job.yaml", "spec.json", "run.sh", "logs", ".meshrun"} <= {p.name for p in run_dir.iterdir()}
    # logs/ holds what a person reads; submitit's pickles and logs live in the hidden .meshrun/.
    sidecar = f"sidecar-{node_name({})}.log"  # the job's sidecar (launcher/sidecar)
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "rank-0.log",
        "rank-1.log",
        sidecar,
        "supervisor.log",
    ]
    assert (run_dir / ".meshrun" / "jobs" / f"{job_id}.json").is_file()
    assert json.loads((run_dir / "spec.json").read_text())["job"]["train"]["steps"] == 12
    row = status(tmp_path, job_id)
    assert row["state"] == "COMPLETED" and row["cluster"] == "local" and row["run_dir"] == str(run_dir)
    assert row["progress"]["step"] == 12
    log = meshrun(tmp_path, "logs", job_id, "--rank", "0", check=True).stdout
    assert "step 12" in log
    # The ranks are forked from a process that loaded torch before OMP_NUM_THREADS was set: still
    # resources.cpus_per_task (1) math threads each, not one per core of the machine.
    assert "gloo on cpu (1 math thread a rank)" in log, log
    assert meshrun(tmp_path, "logs", job_id, "--batch", check=True).stdout.count("COMPLETED") == 1


def test_wait_shows_progress_as_plain_lines_when_piped(tmp_path: Path, corpus: Path) -> None:
    out = meshrun(tmp_path, "submit", *_tiny(corpus, "--set", "train.steps=30"), "--wait", check=True)
    progress = [l for l in out.stderr.splitlines() if l.startswith("[")]
    assert progress and progress[-1].startswith("[COMPLETED]")
    assert any("step " in l and "loss " in l and "left " in l for l in progress), progress
    assert "\r" not in out.stderr


def test_bad_data_shows_the_ranks_one_line_error_and_exits_2(tmp_path: Path) -> None:
    """The real error, not a garbled submitit reason, in --wait, status and the exit code."""
    out = meshrun(tmp_path, "submit", *TINY, "--set", "data.path=/nonexistent/tokens.u16", "--wait", "--no-check")
    assert out.returncode == 2, out.stdout + out.stderr
    job_id, _ = submitted(out)
    # Whichever rank finds it first writes the one line.
    assert re.search(
        rf"job {job_id} FAILED \(rank [01]: data.path: '/nonexistent/tokens.u16': no token file there", out.stdout
    ), out.stdout
    assert "_log.out" not in out.stdout and "Traceback" not in out.stdout + out.stderr
    row = status(tmp_path, job_id)
    assert row["state"] == "FAILED" and row["exit_code"] == 2 and "no token file there" in row["reason"]
    assert "meshrun data" in meshrun(tmp_path, "logs", job_id, check=True).stdout


def test_cancel_a_running_job(tmp_path: Path, corpus: Path) -> None:
    # Steps logged every 7: the step the cancel's save lands on is logged too (STEP never trails CKPT).
    tiny = _tiny(corpus, "--set", "train.steps=100000", "--set", "train.log_every=7")
    out = meshrun(tmp_path, "submit", *tiny, check=True)
    job_id, run_dir = submitted(out)
    deadline = time.monotonic() + 120
    while status(tmp_path, job_id)["state"] != "RUNNING" or not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.5)
    assert meshrun(tmp_path, "cancel", job_id, check=True).stdout.startswith(f"cancelled job {job_id}")
    deadline = time.monotonic() + 60
    while (row := status(tmp_path, job_id))["state"] not in ("CANCELLED", "FAILED"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert row["state"] == "CANCELLED" and row["progress"]["step"] == row["progress"]["checkpoint_step"], row
    second = meshrun(tmp_path, "cancel", job_id)
    assert second.returncode == 1 and "already ended (CANCELLED)" in second.stderr  # not "cancelled" + exit 0


def test_a_cancel_before_the_ranks_exist_stops_them_when_they_start(tmp_path: Path, corpus: Path) -> None:
    """A cancel in the job's first second reaches the controller while it imports torch, before it forks the
    ranks: the ranks it forks later must get the stop too (they trained all their steps, and a long job ran
    the 60 s grace before it was killed without a checkpoint)."""
    tiny = _tiny(corpus, "--set", "train.steps=100000", "--set", "checkpoint.every=1000")
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *tiny, check=True))
    deadline = time.monotonic() + 60
    while status(tmp_path, job_id)["state"] != "RUNNING":  # the controller is starting: no rank yet
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.1)
    meshrun(tmp_path, "cancel", job_id, check=True)
    cancelled = time.monotonic()
    while (row := status(tmp_path, job_id))["state"] not in ("CANCELLED", "FAILED", "COMPLETED"):
        assert time.monotonic() - cancelled < 45, f"still {row['state']} 45 s after the cancel: the ranks missed it"
        time.sleep(0.5)
    assert row["state"] == "CANCELLED", row
    progress = row["progress"]
    # Whatever the ranks trained before they saw the stop, they saved: nothing was killed mid-run.
    assert progress.get("step", 0) == progress.get("checkpoint_step", 0), row


def test_command_job_gets_torchrun_variables(tmp_path: Path) -> None:
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "local", "--wait", check=True)
    job_id, _ = submitted(out)
    logs = [meshrun(tmp_path, "logs", job_id, "--rank", str(r), check=True).stdout for r in (0, 1)]
    assert "rank 0 of 2" in logs[0] and "rank 1 of 2" in logs[1]
