"""meshrun against the real Slurm testbed (slurmctld, two slurmd, slurmdbd): submit, status, logs, cancel."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from submit.cluster import load_profile
from submit.errors import InputError
from submit.plan import plan_file
from submit.render import render
from tests.integration.cli import REPO, meshrun, metrics, status, submitted

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
HOSTILE = "$(touch /tmp/meshrun-pwned) `touch /tmp/meshrun-pwned` 'single' \"double\" spaces;x"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_sbatch_test_only_accepts_every_example(testbed: dict, tmp_path: Path, example: Path) -> None:
    try:
        plan = plan_file(example, load_profile("testbed"), home=str(tmp_path), run_dir=str(tmp_path / "run"))
    except InputError as exc:
        assert example.stem == "h100-8node", exc  # the one example sized for a real H100 cluster
        return
    script = tmp_path / "job.sbatch"
    script.write_text(render(plan))
    (tmp_path / "run" / "logs").mkdir(parents=True)
    done = subprocess.run(["sbatch", "--test-only", f"--job-name={plan.spec.name}", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr


def test_two_nodes_four_ranks_train_together(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    out = meshrun(tmp_path, "submit", "examples/two-node.yaml", "-c", "testbed", "--set", f"data.path={corpus}",
                  "--set", "train.steps=10", "--set", "train.log_every=1", "--wait", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert job_id.isdigit() and f"job {job_id} COMPLETED" in out.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[-1]["loss"] < rows[0]["loss"]
    logs = {r: (run_dir / "logs" / f"rank-{r}.log").read_text() for r in range(4)}
    for rank, text in logs.items():
        assert f"rank {rank}/4" in text, text  # every rank joined the same 4-rank group
    row = status(tmp_path, job_id)
    assert row["state"] == "COMPLETED" and row["cluster"] == "testbed" and row["progress"]["step"] == 10
    batch = meshrun(tmp_path, "logs", job_id, "--batch", check=True).stdout
    assert f"[meshrun] job {job_id} restart 0 on n[1-2]" in batch and "ranks exited with status 0" in batch


def test_hostile_name_and_env_reach_the_job_literally(testbed: dict, tmp_path: Path) -> None:
    Path("/tmp/meshrun-pwned").unlink(missing_ok=True)
    probe = 'import os; print("NAME=" + os.environ["MESHRUN_JOB_NAME"]); print("VALUE=" + os.environ["HOSTILE"])'
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "testbed", "--set", f"name={HOSTILE}",
                  "--set", f"env.HOSTILE={HOSTILE}", "--set", f"command=python,-c,{probe}",
                  "--set", "resources.tasks_per_node=1", "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    text = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"NAME={HOSTILE}" in text and f"VALUE={HOSTILE}" in text
    # slurmctld keeps the literal name (slurmdbd itself rewrites '"' as '`' in sacct's JobName).
    queued = subprocess.run(["squeue", "--states=all", "-h", "-j", job_id, "-o", "%j"], capture_output=True,
                            text=True, check=True).stdout.rstrip("\n")
    assert queued == HOSTILE
    assert not Path("/tmp/meshrun-pwned").exists()


@pytest.mark.parametrize("override", ["name=two\nlines", "env.X=a\nb", "resources.partition=debug\n"])
def test_newlines_are_refused_before_sbatch(testbed: dict, tmp_path: Path, override: str) -> None:
    out = meshrun(tmp_path, "submit", "examples/two-node.yaml", "-c", "testbed", "--set", override)
    assert out.returncode == 2 and "newlines and control characters" in out.stderr
    assert not (tmp_path / "state").exists() or "submitted" not in out.stdout
    queue = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, check=True).stdout
    assert "two\nlines" not in queue


def test_status_and_cancel_of_a_running_job(testbed: dict, tmp_path: Path) -> None:
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "testbed", "--set",
                  "command=sleep,300", "--set", "resources.tasks_per_node=1", check=True)
    job_id, run_dir = submitted(out)
    deadline = time.monotonic() + 60
    while status(tmp_path, job_id)["state"] != "RUNNING":
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.5)
    meshrun(tmp_path, "cancel", job_id, check=True)
    deadline = time.monotonic() + 60
    while (row := status(tmp_path, job_id))["state"] != "CANCELLED":
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    assert row["done"] is True and row["succeeded"] is False


def test_status_without_accounting_falls_back_to_squeue(testbed: dict, tmp_path: Path) -> None:
    """sacct failing as it does without slurmdbd: squeue --states=all still tells the state, in one round trip."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (fake / "sacct").chmod(0o755)
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "testbed", "--set", "command=sleep,300",
                  "--set", "resources.tasks_per_node=1", check=True)
    job_id, _ = submitted(out)
    no_accounting = {"PATH": f"{fake}:{os.environ['PATH']}"}
    deadline = time.monotonic() + 60
    while (row := status(tmp_path, job_id, env=no_accounting))["state"] != "RUNNING":
        assert time.monotonic() < deadline and row["state"] in ("PENDING", "UNKNOWN"), row
        time.sleep(0.5)
    meshrun(tmp_path, "cancel", job_id, check=True)
    while (row := status(tmp_path, job_id, env=no_accounting))["state"] != "CANCELLED":
        assert time.monotonic() < deadline + 60, row
        time.sleep(0.5)
    assert row["done"] and not row["succeeded"]
