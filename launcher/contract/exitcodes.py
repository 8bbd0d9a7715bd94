"""Exit codes: the one place they are defined. Torch-free, stdlib only.

The ranks agree on one of these (rank 0 records it in the run dir), the batch
script decides on it whether to requeue, and `meshrun` reports it. Everything
else (templates, the local supervisor, the CLI) imports them from here.
"""

from __future__ import annotations

from typing import Optional

EXIT_FINISHED = 0
"""Training reached its last step."""
EXIT_FAILED = 1
"""An error: do not requeue blindly."""
EXIT_INPUT = 2
"""Bad spec or environment: requeueing cannot help."""
EXIT_REQUEUE = 75
"""Stopped on a signal after saving a checkpoint: requeue to continue (sysexits' EX_TEMPFAIL)."""
EXIT_NO_PROGRESS = 76
"""The watchdog saw no step finish in time (a hang): requeue from the last checkpoint, or stop."""
EXIT_GAVE_UP = 77
"""The crash-loop guard stopped the job: the same checkpoints kept failing. Never requeued."""
EXIT_DIVERGED = 78
"""The loss went NaN or inf: stopped at once, nothing non-finite saved. Never requeued (it would diverge
again): lower the learning rate or look at the data, then `meshrun resume` from the last finite checkpoint."""
EXIT_UNHEALTHY = 79
"""A node failed its health check before the ranks started (launcher/batch/gate.py): the job is requeued with the
node excluded (it counts as a restart), or ends when excluding it would leave too few nodes."""

EXIT_NAMES = {
    EXIT_FINISHED: "finished",
    EXIT_FAILED: "failed",
    EXIT_INPUT: "bad input",
    EXIT_REQUEUE: "saved for requeue",
    EXIT_NO_PROGRESS: "no progress",
    EXIT_GAVE_UP: "gave up (crash loop)",
    EXIT_DIVERGED: "diverged (non-finite loss)",
    EXIT_UNHEALTHY: "a node failed its health check",
}

NOT_REQUEUED = (EXIT_FINISHED, EXIT_INPUT, EXIT_GAVE_UP, EXIT_DIVERGED)
"""Codes the batch script never requeues: done, bad input, crash loop, divergence."""


def diverged_fix(newest: Optional[int]) -> str:
    """What to do after EXIT_DIVERGED, naming where `meshrun resume` starts: the newest checkpoint (finite: every
    save comes after its step's check), or step 0 when none was saved."""
    if newest is None:
        return (
            "lower train.lr or check the data, then `meshrun resume JOB --set train.lr=...` starts it again from "
            "step 0 (no checkpoint was saved)"
        )
    return (
        f"lower train.lr or check the data, then `meshrun resume JOB --set train.lr=...` continues from the newest "
        f"checkpoint, step {newest} (--set checkpoint.resume_step=N for an earlier one, from before the loss climbed)"
    )
