"""A real Slurm preemption (partition_prio, PreemptMode=REQUEUE, GraceTime) and a real `scancel`, on the testbed.

Slurm itself sends the signals here, not a test's `scancel --signal`: a job in the testbed's high partition
takes the nodes of a training job in the default (low) one. Slurm then sends SIGTERM to the training job's
steps, gives it the partition's GraceTime, and requeues it if it still runs at the end. A user's `scancel`
sends SIGTERM to the batch shell and the steps at once, and the job must end CANCELLED, never requeued.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.export.consolidate import consolidated_state
from meshrun.submit.schedulers import slurm_cli as slurm
from tests.helpers.cli import meshrun, submitted, wait_for_state, wait_for_step
from tests.integration.test_preempt_resume import _step_rows, _two_ranks_on_two_nodes
from tests.testbed import testbed as tb

STEPS = 60
"""Enough for a preemption after step 3 and a periodic checkpoint (every 50) before the end."""


def _training(corpus: Path, *extra: str) -> list[str]:
    """test_preempt_resume's two ranks on two nodes, STEPS long, as a two-stage pipeline (one stage a node):
    the preempted checkpoint holds each stage's own optimizer state, and the resume must still be exact."""
    pipeline = ("--set", "parallel.dp=1", "--set", "parallel.pp=2")
    return [*_two_ranks_on_two_nodes(corpus), *pipeline, "--set", f"train.steps={STEPS}", *extra]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    root = Path(json.loads((run_dir / "spec.json").read_text())["run"]["checkpoint_dir"])
    latest = ckptdir.latest(root)
    assert latest is not None, f"no complete checkpoint in {root}"
    tensors, meta = consolidated_state(latest)
    assert meta["step"] == str(STEPS)
    return tensors


def _batch_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def _rank_log(run_dir: Path, rank: int = 0) -> str:
    path = run_dir / "logs" / f"rank-{rank}.log"
    return path.read_text() if path.exists() else ""


def _sacct_rows(job_id: str) -> list[str]:
    """Every record of the job, requeued runs included (-D): `STATE` per run, oldest first."""
    out = subprocess.run(
        ["sacct", "-X", "-D", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, check=True
    )
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _preempt_with_a_high_job(tmp_path: Path, cpus: int = tb.CPUS_PER_NODE - 1) -> str:
    """A high-partition job that fits only once the low jobs' CPUs are free: on each node it asks `cpus`, by default
    all CPUs but one (the reference, in the high partition too, holds that one and is never preempted)."""
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--partition={tb.HIGH_PARTITION}",
            "--nodes=2",
            "--ntasks-per-node=1",
            f"--cpus-per-task={cpus}",
            f"--output={tmp_path}/preemptor-%j.out",
            "--wrap=sleep 5",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def until(predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def command_spec(folder: Path, name: str, script: str, **extra: Any) -> Path:
    """A `command:` job (bash SCRIPT, one rank on each of `nodes` nodes) written to FOLDER/NAME.yaml."""
    spec = {
        "name": name,
        "resources": {"nodes": extra.pop("nodes", 1), "tasks_per_node": 1, "time": "00:05:00"},
        "command": ["bash", "-c", script],
        **extra,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# A save slower than the grace time: the first SIGTERM (the grace time's start) is ignored, the second
# (its end, when Slurm itself requeues the job) ends the program with "saved for requeue". The requeued
# run needs its secret: a batch shell that took Slurm's requeue for the job's end would have removed it.
SLOW_SAVER = "; ".join(
    [
        '[ -n "${GRACE_TOKEN:-}" ] || { echo "no secret"; exit 3; }',
        'if [ "$MESHRUN_RESTART_COUNT" != 0 ]; then echo "restart $MESHRUN_RESTART_COUNT: done"; exit 0; fi',
        "terms=0",
        """trap 'terms=$((terms + 1)); echo "SIGTERM $terms"; [ "$terms" -lt 2 ] || exit 75' TERM""",
        "trap 'echo SIGUSR1' USR1",  # the batch shell's own stop signal, at the grace time's end
        "echo ready",
        "while :; do sleep 0.2; done",
    ]
)


# A preemption whose SIGTERM reaches the batch shell too (as some Slurm versions and sites do; the test sends
# it): the shell must tell it from a scancel's and requeue. The program saves once the test says the batch
# shell has its TERM ("go"), well inside the grace time.
BATCH_TOLD = "; ".join(
    [
        'if [ "$MESHRUN_RESTART_COUNT" != 0 ]; then echo "restart $MESHRUN_RESTART_COUNT: done"; exit 0; fi',
        "told=",
        "trap 'echo SIGTERM; told=1' TERM",
        "trap 'echo SIGUSR1; told=1' USR1",
        "echo ready",
        'while [ -z "$told" ]; do sleep 0.2; done',
        'for i in $(seq 120); do [ -e "$MESHRUN_RUN_DIR/go" ] && break; sleep 0.1; done',
        "echo saved",
        "exit 75",
    ]
)


def test_a_real_preemption_saves_in_the_grace_time_requeues_once_and_matches_an_uninterrupted_run(
    testbed: dict[str, object], tmp_path: Path, corpus: Path
) -> None:
    # The reference trains in the high partition: the same job, never preempted (PreemptMode=OFF there).
    ref_args = _training(corpus, "--set", f"resources.partition={tb.HIGH_PARTITION}")
    ref_id, ref_dir = submitted(meshrun(tmp_path, "submit", *ref_args, check=True))
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *_training(corpus), check=True))
    # Preempted in the same stroke: a job whose save outlasts the grace time (Slurm requeues it itself).
    slow = command_spec(tmp_path, "slow-saver", SLOW_SAVER, nodes=2, secrets={"GRACE_TOKEN": {"env": "SRC"}})
    slow_id, slow_dir = submitted(
        meshrun(tmp_path, "submit", str(slow), "-c", "testbed", env={"SRC": "t0ken"}, check=True)
    )
    told = command_spec(tmp_path, "batch-told", BATCH_TOLD, nodes=2)
    told_id, told_dir = submitted(meshrun(tmp_path, "submit", str(told), "-c", "testbed", check=True))
    wait_for_step(run_dir, 3)
    until(lambda: "ready" in _rank_log(slow_dir) and "ready" in _rank_log(told_dir), "a command job did not start")
    high_id = _preempt_with_a_high_job(tmp_path)
    # The high job preempts at slurmctld's next scheduling pass: on a loaded 2-core machine that took over 60 s once.
    until(lambda: "SIGTERM" in _rank_log(told_dir), "Slurm never signalled the ranks", timeout=150)
    subprocess.run(["scancel", "--batch", "--signal=TERM", told_id], check=True)
    until(
        lambda: "SIGTERM: Slurm signals the ranks itself" in _batch_log(told_dir, told_id), "no TERM in the batch shell"
    )
    (told_dir / "go").touch()
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, row
    assert row["progress"]["checkpoint_step"] == STEPS
    wait_for_state(tmp_path, ref_id, {"COMPLETED"})
    # One requeue (meshrun's, inside the grace time), not a second one by Slurm at its end.
    assert _sacct_rows(job_id) == ["REQUEUED", "COMPLETED"], _sacct_rows(job_id)
    assert _sacct_rows(ref_id) == ["COMPLETED"]  # the reference was never preempted
    until(lambda: _sacct_rows(high_id) == ["COMPLETED"], "the preempting job did not run")
    # `meshrun status` came from accounting itself (one batched sacct), not only from a fallback.
    acct = subprocess.run(slurm.sacct_argv([ref_id, job_id]), capture_output=True, text=True, check=True)
    assert {s.state for s in slurm.parse_sacct(acct.stdout).values()} == {"COMPLETED"}
    batch = _batch_log(run_dir, job_id)
    assert "preempted by Slurm at " in batch and "ranks exited with status 75" in batch, batch
    assert "requeueing: restart 1" in batch and f"[meshrun] job {job_id} restart 1" in batch, batch
    assert "SIGTERM (scancel" not in batch, batch
    rank0 = _rank_log(run_dir)
    # Slurm's SIGTERM reached the ranks, which saved the step they stopped after within the grace time:
    # the second run resumes from exactly that step, not from an earlier periodic checkpoint.
    stopped = int(rank0.split("stopping after step ")[1].split()[0])
    assert f"stopping after step {stopped} on SIGTERM" in rank0 and stopped < STEPS, rank0
    assert f"resuming from step {stopped}" in rank0 and "restart 0" in rank0 and "restart 1" in rank0, rank0
    pre, ref = _step_rows(run_dir), _step_rows(ref_dir)
    assert [r["step"] for r in pre] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in pre] == [r["loss"] for r in ref]  # bit-identical
    a, b = _weights(ref_dir), _weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The slow saver: requeued by Slurm alone (once), its secret still there for the second run.
    row = wait_for_state(tmp_path, slow_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    slow_batch = _batch_log(slow_dir, slow_id)
    assert row["state"] == "COMPLETED", (row, slow_batch, _rank_log(slow_dir))
    # The batch shell says Slurm requeued the job, unless Slurm killed it first while it was still asking
    # (then it decided nothing: the secret stays, and the requeued run below shows it).
    said = "Slurm has requeued the job itself (a preemption past its grace time): not requeueing it again"
    assert said in slow_batch or "ranks exited with status" not in slow_batch.split(" restart 1 ")[0], slow_batch
    assert "requeueing: restart" not in slow_batch and "SIGTERM (scancel" not in slow_batch, slow_batch
    # Its second SIGTERM came at the grace time's end; the second run is Slurm's restart 1, not 2.
    assert "SIGTERM 2" in _rank_log(slow_dir) and "restart 1: done" in _rank_log(slow_dir), _rank_log(slow_dir)
    assert _sacct_rows(slow_id) == ["PREEMPTED", "COMPLETED"], _sacct_rows(slow_id)
    # The one whose batch shell got a TERM in the grace time: a preemption, not a scancel; requeued once, by meshrun.
    row = wait_for_state(tmp_path, told_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    told_batch = _batch_log(told_dir, told_id)
    assert row["state"] == "COMPLETED", (row, told_batch, _rank_log(told_dir))
    assert "preempted by Slurm at " in told_batch and "requeueing: restart 1" in told_batch, told_batch
    assert "SIGTERM (scancel" not in told_batch, told_batch
    assert "saved" in _rank_log(told_dir) and "restart 1: done" in _rank_log(told_dir), _rank_log(told_dir)
    assert _sacct_rows(told_id) == ["REQUEUED", "COMPLETED"], _sacct_rows(told_id)


def test_scancel_ends_the_job_cancelled_and_never_requeues_it(
    testbed: dict[str, object], tmp_path: Path, corpus: Path
) -> None:
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *_training(corpus), check=True))
    wait_for_step(run_dir, 3)
    subprocess.run(["scancel", job_id], check=True)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert row["state"] == "CANCELLED" and row["restarts"] == 0, row
    # The batch shell's decision is its last line; once it is written nothing can requeue the job.
    until(lambda: "not requeueing" in _batch_log(run_dir, job_id), "the batch shell never decided")
    batch = _batch_log(run_dir, job_id)
    assert "SIGTERM (scancel, or Slurm ended the job): not requeueing" in batch, batch
    assert "preempted" not in batch and "restart 1" not in batch, batch
    # The ranks had their KillWait to save: the batch shell told them to stop without srun killing them.
    assert "ranks exited with status 75" in batch, batch
    assert "'s signal: checkpoint saved, exit 75" in _rank_log(run_dir), _rank_log(run_dir)
    acct = subprocess.run(slurm.sacct_argv([job_id]), capture_output=True, text=True, check=True)
    assert {s.state for s in slurm.parse_sacct(acct.stdout).values()} == {"CANCELLED"}
    assert _sacct_rows(job_id) == ["CANCELLED"]  # one run, never requeued
