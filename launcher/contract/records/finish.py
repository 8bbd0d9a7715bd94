"""A finish or a stop: what an exit 0 means once meshrun passed on a stop signal. Torch-free, stdlib only.

Frameworks with Slurm habits of their own (Lightning, Hugging Face Trainer and Accelerate, torchtitan, most
hand-written loops) end cleanly on SIGTERM: they leave their loop and exit 0. After a preemption or the time
limit's warning that exit is not a finished job: taken for one, the job would end COMPLETED with its work
lost. So once meshrun has passed on a stop, an exit 0 counts as a finish only when the program said so:

- the built-in trainer: its agreed exit code is 0 only when it trained its last step (`train.steps`);
- a `command:` job: it called `meshrun.launcher.job.finished()` in this start (rank 0 writes RUN_DIR/.meshrun/
  finished.json naming the start), or it reported (meshrun.launcher.report) the step the spec declares as its last
  (`command_steps`).

Anything else is a stop: requeued as a saved stop (exit 75) under the usual policy, and said as "stopped by
preemption at step N". The batch script (meshrun.launcher.batch.requeue) and the local supervisor both ask here.
"""

from __future__ import annotations

import os
import time
from typing import Mapping, Optional

from meshrun.launcher.contract.records.rundir import RunDir, attempt_id, read_state, write_json

PREEMPTION = "preemption"
TIME_LIMIT = "time-limit"
CANCEL = "cancel"
STOP_KINDS = (PREEMPTION, TIME_LIMIT, CANCEL)
"""What the stop meshrun passed on was: the words the batch script hands meshrun.launcher.batch.requeue (--stop-requested=KIND)."""

_SAID = {PREEMPTION: "by preemption", TIME_LIMIT: "at the time limit", CANCEL: "by a cancel"}


def declare(run_dir: str, step: Optional[int], environ: Mapping[str, str] = os.environ) -> None:
    """The program finished its work in this start (meshrun.launcher.job.finished: rank 0 calls it)."""
    write_json(RunDir(run_dir).finished, {"attempt": attempt_id(environ), "step": step, "time": time.time()})


def declared(run_dir: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the program said in this start that it finished (a mark an earlier start left counts for nothing)."""
    return read_state(RunDir(run_dir).finished).get("attempt") == attempt_id(environ)


def reached(reported: Optional[int], last_step: Optional[int]) -> bool:
    """Whether the reported steps reached the step the spec declares as the last (none declared: never)."""
    return last_step is not None and reported is not None and reported >= last_step


def stopped(kind: str, step: Optional[int]) -> str:
    """'stopped by preemption at step 42' (or '..., no step reported'): what status and the logs say of a stop."""
    said = _SAID.get(kind, "by a stop signal")
    return f"stopped {said} at step {step}" if step is not None else f"stopped {said} (no step reported)"


def said_finished(
    run_dir: str, reported: Optional[int], last_step: Optional[int], environ: Mapping[str, str] = os.environ
) -> bool:
    """Whether a `command:` job's program said it finished: meshrun.launcher.job.finished in this start, or its declared
    last step reported. The one test the batch host's policy and the local supervisor apply."""
    return declared(run_dir, environ) or reached(reported, last_step)


WHY_A_STOP = (
    "the program exited 0 after the stop signal without saying it finished (meshrun.launcher.job.finished(), or "
    "command_steps reported), so it is a stop, not a finish"
)
"""What the batch log adds to `stopped(...)` when a `command:` job's exit 0 is taken for a stop."""
