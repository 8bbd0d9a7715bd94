"""A requeued two-node job starts again on the real testbed and both slurmds live on; the
testbed clears a leftover job and heals a node whose slurmd died, so one casualty does not fail every later
test."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from meshrun.launcher.contract.exitcodes import EXIT_REQUEUE
from tests.helpers.cli import meshrun, submitted, wait_for_state
from tests.testbed import health
from tests.testbed import testbed as tb

# Each rank records its attempt, its pid and its start time, stays a few seconds (the sidecar starts
# beside it), and asks for a requeue on the first attempt only: the batch script requeues the job with
# `scontrol requeue`, and Slurm starts it again on both nodes.
ATTEMPT = (
    'echo "$MESHRUN_RESTART_COUNT $SLURM_PROCID $SLURMD_NODENAME $$" >> "$MESHRUN_RUN_DIR/attempts.txt"; '
    f'sleep 3; [ "$MESHRUN_RESTART_COUNT" -ge 1 ] || exit {EXIT_REQUEUE}'
)


def _spec(tmp_path: Path) -> Path:
    spec = {
        "name": "requeued-twice-started",
        "resources": {"nodes": 2, "tasks_per_node": 1, "time": "00:10:00"},
        "command": ["bash", "-c", ATTEMPT],
        "env": {"OMP_NUM_THREADS": "1"},
    }
    path = tmp_path / "requeue.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _slurmds() -> dict[str, int | None]:
    return {name: pid for name, pid in tb.status().items() if name.startswith("slurmd-")}


def test_a_requeued_two_node_job_starts_again_and_both_slurmds_live_on(testbed: dict, tmp_path: Path) -> None:
    before = _slurmds()
    assert all(before.values()), before
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", str(_spec(tmp_path)), "-c", "testbed", check=True))
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=180)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED", (row, batch)
    assert "requeueing: restart 1" in batch and batch.count("ranks exited with status") == 2, batch
    assert f"job {job_id} restart 1 on n[1-2]" in batch, batch
    # Both attempts ran both ranks, one per node.
    lines = [line.split() for line in (run_dir / "attempts.txt").read_text().splitlines()]
    assert sorted((a, r, n) for a, r, n, _ in lines) == [
        ("0", "0", "n1"),
        ("0", "1", "n2"),
        ("1", "0", "n1"),
        ("1", "1", "n2"),
    ]
    # Neither slurmd died nor was restarted (the same pids), and Slurm sees both nodes take jobs.
    assert _slurmds() == before, (before, _slurmds())
    assert health.healthy(health.node_states()), health.node_states()
    assert not any("CANCELLED by" in line for line in batch.splitlines()), batch


def test_the_testbed_clears_a_leftover_job_and_heals_a_dead_slurmd(testbed: dict, tmp_path: Path) -> None:
    """What the harness does for a session (clear) and before each test (heal), on the real daemons."""
    held = subprocess.run(
        ["sbatch", "--parsable", "--hold", "-N1", "-o", "/dev/null", "--wrap", "sleep 60"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    cleared = health.clear_leftover_jobs()
    assert any(line.split()[0] == held for line in cleared), cleared
    assert held not in subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout.split()
    # slurmd-n2 dies as in the issue (no shutdown line): SIGKILL by its own pid file; heal() restarts it.
    pidfile = tb.RUN / "slurmd-n2.pid"
    dead = int(pidfile.read_text().split()[0])
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while tb._pid_running(dead):
        assert time.monotonic() < deadline, "slurmd-n2 survived SIGKILL"
        time.sleep(0.1)
    healed = health.heal()
    assert any(line.startswith("restarted slurmd-n2") for line in healed), healed
    assert health.heal() == []  # healthy again: nothing more to do
    assert _slurmds()["slurmd-n2"] not in (None, dead)
    # And it takes jobs: a two-node job runs on both nodes.
    out = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "hostname"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
