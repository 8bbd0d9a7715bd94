"""The frameworks users bring, installed for real, on the Slurm testbed.

Three plain scripts with no meshrun imports (examples/lightning_train.py, hf_trainer_train.py,
accelerate_train.py), each written as the docs tell that framework's user, train on two nodes of the testbed. One
job in the high partition that needs every CPU preempts all three for real, each within Slurm's grace time:

- Lightning leaves its loop on Slurm's SIGTERM, its own OnExceptionCheckpoint saves, and it exits 0;
- the Hugging Face Trainer has no SIGTERM handler: its ranks die of the signal;
- the Accelerate loop catches SIGTERM, saves with accelerator.save_state() and exits 0.

meshrun takes each ending for the stop it is (an exit 0 after a stop is no finish unless the program said so),
requeues each job once, and the next start resumes from the framework's own checkpoint and ends with the final
loss and step of an uninterrupted run of the same script (on `local`, two ranks). Where Slurm's TERM reaches one
node's ranks late (a loaded testbed), a framework may outlast the grace time; Slurm then requeues the job itself,
once, and the test asks of that job only the one requeue and the reference loss (at least one job must show the
save and the resume).

Lightning's other habit, its own requeue on the time limit's SIGUSR1, is the second test: meshrun passes the
signal on once, Lightning saves hpc_ckpt_N.ckpt and runs `scontrol requeue` itself, meshrun stands back (one
requeue, not two), and the next start resumes from that checkpoint.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.helpers.cli import meshrun, submitted, wait_for_state
from tests.integration.test_real_preemption import _batch_log, _preempt_with_a_high_job, _rank_log, _sacct_rows, until
from tests.testbed import testbed as tb


class Framework(NamedTuple):
    spec: str
    script: str
    length: tuple[str, str]
    """The script's flag and value for a run of about 300 steps of 0.2 s: a minute, long enough for slurmctld
    to get round to the preemption on a loaded machine."""
    training: str
    """What rank 0's log says once the run is under way."""
    resumed: str
    """What rank 0's log says when the next start loaded the framework's own checkpoint."""


LIGHTNING = Framework(
    "lightning", "lightning_train", ("--epochs", "300"), "epoch 10 done", "Restored all states from the checkpoint"
)
FRAMEWORKS = {
    "lightning": LIGHTNING,
    "hf-trainer": Framework("hf-trainer", "hf_trainer_train", ("--epochs", "75"), "step 10 done", "resuming from "),
    "accelerate": Framework("accelerate", "accelerate_train", ("--epochs", "75"), "step 10 saved", "resumed at step"),
}
FINAL = re.compile(r"final loss ([0-9.]+) after (?:epoch \d+ )?step (\d+)")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def _args(framework: Framework, cluster: str, *extra: str, sleep: float = 0.2) -> list[str]:
    flag, value = framework.length
    command = f"command=python3,examples/{framework.script}.py,{flag},{value},--sleep,{sleep}"
    return [f"examples/{framework.spec}.yaml", "-c", cluster, "--set", command, *extra]


def _final(run_dir: Path) -> tuple[float, int]:
    found = FINAL.findall(_rank_log(run_dir))
    assert found, _rank_log(run_dir)[-3000:]
    loss, step = found[-1]
    return float(loss), int(step)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[float, int]]:
    """Each script's uninterrupted run: two ranks on `local` (the same world size as two nodes of one rank)."""
    home = tmp_path_factory.mktemp("references")
    jobs = {
        # No pause between steps: the numbers do not depend on it (nothing preempts these).
        name: submitted(
            meshrun(home, "submit", *_args(f, "local", "--set", "resources.tasks_per_node=2", sleep=0), check=True)
        )
        for name, f in FRAMEWORKS.items()
    }
    for name, (job_id, run_dir) in jobs.items():
        row = wait_for_state(home, job_id, ENDED, timeout=600)
        assert row["state"] == "COMPLETED", (name, row, _rank_log(run_dir)[-3000:])
    return {name: _final(run_dir) for name, (_job, run_dir) in jobs.items()}


def test_lightning_hf_trainer_and_accelerate_preempted_for_real_requeue_once_and_resume_from_their_own_checkpoints(
    testbed: dict[str, object], tmp_path: Path, references: dict[str, tuple[float, int]]
) -> None:
    two_nodes = ("--set", "resources.nodes=2")
    jobs = {
        name: submitted(meshrun(tmp_path, "submit", *_args(f, "testbed", *two_nodes), check=True))
        for name, f in FRAMEWORKS.items()
    }
    for name, (_job, run_dir) in jobs.items():
        wanted = FRAMEWORKS[name].training
        until(lambda: wanted in _rank_log(run_dir), f"{name}: never trained", timeout=240)  # noqa: B023
    high_id = _preempt_with_a_high_job(tmp_path, cpus=tb.CPUS_PER_NODE)  # every job in the default partition goes
    by_meshrun = []
    for name, (job_id, run_dir) in jobs.items():
        row = wait_for_state(tmp_path, job_id, ENDED, timeout=480)
        batch, rank0 = _batch_log(run_dir, job_id), _rank_log(run_dir)
        assert row["state"] == "COMPLETED" and row["restarts"] == 1, (name, row, batch, rank0[-3000:])
        loss, step = _final(run_dir)
        ref_loss, ref_step = references[name]
        assert step == ref_step and math.isclose(loss, ref_loss, rel_tol=1e-5), (name, loss, step, references[name])
        if "Slurm has requeued the job itself (a preemption past its grace time)" in batch:
            # On a loaded testbed Slurm's preemption TERM reached one node's ranks late: Lightning's rank that had it
            # left its loop, its peer waited in the gradients' all-reduce, and Slurm requeued the job at the grace
            # time's end (once, as a new user's trial saw in two of three preemptions). No checkpoint of the stop.
            # Slurm's accounting names that first run PREEMPTED or REQUEUED (both seen here), then one COMPLETED.
            rows = _sacct_rows(job_id)
            assert rows in (["REQUEUED", "COMPLETED"], ["PREEMPTED", "COMPLETED"]), (name, rows, batch)
            continue
        assert _sacct_rows(job_id) == ["REQUEUED", "COMPLETED"], (name, _sacct_rows(job_id), batch)
        assert "preempted by Slurm at " in batch and "requeueing: restart 1 of at most" in batch, (name, batch)
        assert FRAMEWORKS[name].resumed in rank0, (name, rank0[-3000:])  # from its own checkpoint, not afresh
        by_meshrun.append(name)
    assert by_meshrun, "every framework outlasted the grace time: nothing showed a save and a resume"
    until(lambda: _sacct_rows(high_id) == ["COMPLETED"], "the preempting job did not run")
    # Lightning and the Accelerate loop exited 0 on the stop: meshrun's rule made it a stop. The Trainer's ranks
    # died of Slurm's SIGTERM: a program that died of the stop signal is requeued too.
    for name in {"lightning", "accelerate"} & set(by_meshrun):
        batch = _batch_log(jobs[name][1], jobs[name][0])
        assert "ranks exited with status 0" in batch and "finished (exit 0): not requeueing" in batch, batch
        assert "stopped by preemption (no step reported): the program exited 0 after the stop signal" in batch, batch
    if "lightning" in by_meshrun:
        assert "Received SIGTERM" in _rank_log(jobs["lightning"][1])
    if "accelerate" in by_meshrun:
        assert "stopped on SIGTERM after step" in _rank_log(jobs["accelerate"][1])


def test_lightning_requeues_itself_on_the_time_limits_warning_and_meshrun_stands_back(
    testbed: dict[str, object], tmp_path: Path, references: dict[str, tuple[float, int]]
) -> None:
    # Steps of 0.2 s, mostly asleep: Lightning's SIGUSR1 handler saves with a barrier, a collective inside a signal
    # handler, which deadlocks when it lands on one rank inside the gradients' all-reduce (a CI run with 0.05 s
    # steps hung so for 9 minutes on a loaded machine). Lightning's own race: a user's steps are mostly compute.
    two_nodes = _args(LIGHTNING, "testbed", "--set", "resources.nodes=2", sleep=0.2)
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *two_nodes, check=True))
    until(lambda: LIGHTNING.training in _rank_log(run_dir), "the Lightning job never trained", timeout=240)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)  # the time limit's warning
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=480)
    batch, rank0 = _batch_log(run_dir, job_id), _rank_log(run_dir)
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch, rank0[-3000:])
    # Lightning saved and asked Slurm for the requeue itself; meshrun passed the signal on once and stood back.
    assert "Handling auto-requeue signal" in rank0 and (run_dir / "hpc_ckpt_1.ckpt").is_file(), rank0[-3000:]
    # The next start restored the newest of Lightning's own checkpoints (the recipe's ckpt_path): the hpc one, or
    # the on_exception.ckpt its callback saved on the requeue's TERM just after it.
    assert "Restored all states from the checkpoint" in rank0.split("restart 1 master")[-1], rank0[-3000:]
    assert "SIGUSR1: passing it to the ranks" in batch, batch
    assert "requeueing: restart" not in batch.split(" restart 1 ")[0], batch  # not a second requeue of meshrun's
    assert _sacct_rows(job_id) == ["REQUEUED", "COMPLETED"], _sacct_rows(job_id)
    assert not list(run_dir.glob("hpc_ckpt_2.ckpt")), "Lightning saved twice: it heard the stop twice"
    loss, step = _final(run_dir)
    ref_loss, ref_step = references["lightning"]
    assert step == ref_step and math.isclose(loss, ref_loss, rel_tol=1e-5), (loss, step, references["lightning"])


def test_a_cancelled_lightning_job_ends_cancelled_not_requeued_by_lightning(
    testbed: dict[str, object], tmp_path: Path
) -> None:
    """A new user's trial: `meshrun cancel` of a Lightning job on Slurm ended in a requeue and, later, COMPLETED: the
    batch shell passed scancel's TERM on as USR1, which Lightning answers with its own `scontrol requeue`. The program
    now hears Slurm's TERM alone: it stops, and the job ends CANCELLED with one accounting record."""
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *_args(LIGHTNING, "testbed"), check=True))
    until(lambda: LIGHTNING.training in _rank_log(run_dir), "the Lightning job never trained", timeout=240)
    meshrun(tmp_path, "cancel", job_id, check=True)
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=240)
    batch, rank0 = _batch_log(run_dir, job_id), _rank_log(run_dir)
    assert row["state"] == "CANCELLED" and row["restarts"] == 0, (row, batch, rank0[-3000:])
    assert "SIGTERM: Slurm signals the ranks itself" in batch, batch
    assert "Handling auto-requeue signal" not in rank0 and "Requeued SLURM job" not in rank0, rank0[-3000:]
    assert _sacct_rows(job_id) == ["CANCELLED"], _sacct_rows(job_id)
