"""The frameworks users bring, installed for real, on the Slurm testbed (issue 44).

A plain PyTorch Lightning script (examples/lightning_train.py, no meshrun imports: two lines of Lightning's own
that the docs give) is preempted for real (a job in the testbed's high partition takes its nodes). Lightning
leaves its loop on Slurm's SIGTERM, its own OnExceptionCheckpoint saves, and it exits 0: meshrun takes that for
a stop, not a finish, and requeues the job once. The next start resumes from Lightning's own checkpoint and ends
with the loss of an uninterrupted run of the same script.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from tests.helpers.cli import meshrun, submitted, wait_for_state
from tests.integration.test_real_preemption import _batch_log, _preempt_with_a_high_job, _rank_log, _sacct_rows, until
from tests.testbed import testbed as tb

EPOCHS = 300
"""One step an epoch (64 samples a rank); 0.2 s a step: a minute of training, long enough for slurmctld to get
round to the preemption on a loaded machine."""
FINAL = re.compile(r"final loss ([0-9.]+) after epoch (\d+) step (\d+)")


def _lightning(*extra: str) -> list[str]:
    command = f"command=python3,examples/lightning_train.py,--epochs,{EPOCHS},--sleep,0.2"
    return ["examples/lightning.yaml", "-c", "testbed", "--set", "resources.nodes=2", "--set", command, *extra]


def _final(run_dir: Path) -> tuple[float, int, int]:
    found = FINAL.findall(_rank_log(run_dir))
    assert found, _rank_log(run_dir)[-3000:]
    loss, epoch, step = found[-1]
    return float(loss), int(epoch), int(step)


def test_a_preempted_lightning_job_is_requeued_once_and_resumes_from_its_own_checkpoint(
    testbed: dict[str, object], tmp_path: Path
) -> None:
    ref_id, ref_dir = submitted(
        meshrun(tmp_path, "submit", *_lightning("--set", f"resources.partition={tb.HIGH_PARTITION}"), check=True)
    )
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *_lightning(), check=True))
    until(lambda: "epoch 10 done" in _rank_log(run_dir), "the Lightning job never trained", timeout=180)
    high_id = _preempt_with_a_high_job(tmp_path)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=420)
    batch, rank0 = _batch_log(run_dir, job_id), _rank_log(run_dir)
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch, rank0[-3000:])
    # Lightning heard Slurm's SIGTERM, stopped, saved with its own callback and exited 0: a stop, requeued once.
    assert "Received SIGTERM" in rank0, rank0[-3000:]
    assert "preempted by Slurm at " in batch and "ranks exited with status 0" in batch, batch
    assert "stopped by preemption (no step reported): the program exited 0 after the stop signal" in batch, batch
    assert "requeueing: restart 1 of at most" in batch and "finished (exit 0): not requeueing" in batch, batch
    assert _sacct_rows(job_id) == ["REQUEUED", "COMPLETED"], _sacct_rows(job_id)
    # The next start loaded Lightning's own checkpoint, not a fresh model.
    assert "Restored all states from the checkpoint at " in rank0 and "on_exception.ckpt" in rank0, rank0[-3000:]
    wait_for_state(tmp_path, ref_id, {"COMPLETED"}, timeout=420)
    until(lambda: _sacct_rows(high_id) == ["COMPLETED"], "the preempting job did not run")
    loss, epoch, step = _final(run_dir)
    ref_loss, ref_epoch, ref_step = _final(ref_dir)
    assert (epoch, step) == (ref_epoch, ref_step) == (EPOCHS, EPOCHS), (epoch, step, ref_epoch, ref_step)
    # Every stop ends an epoch (one batch a rank), so the resume is Lightning-exact up to float summation order.
    assert math.isclose(loss, ref_loss, rel_tol=1e-5), (loss, ref_loss)
