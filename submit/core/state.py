"""A job's state as meshrun shows and records it, whatever its scheduler.

Each backend maps its scheduler's own words onto this type, in one table (submit/schedulers/slurm_cli.py:
every name squeue and sacct print; local.py: the words of a local job's state file); everything outside
submit/schedulers/ compares against the type and its sets below, never against a scheduler's words.
The values are the words `meshrun status` prints and the registry keeps (`last_state`): Slurm's own names
where Slurm has one, so that a person reading `squeue` beside `meshrun status` sees the same word, and an
older registry's rows still read.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """One job's state. A `str`, so that it prints, sorts, serializes (--json) and compares as its word."""

    # meshrun's own
    SUBMITTED = "SUBMITTED"  # recorded at submit; no status seen yet (the registry's default)
    UNKNOWN = "UNKNOWN"  # the scheduler does not know the job (or printed a state no table knows)
    UNREACHABLE = "UNREACHABLE"  # its cluster could not be reached this time
    # waiting, running, or between the two (Slurm shows a flag instead of the base state): not ended
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    CONFIGURING = "CONFIGURING"
    COMPLETING = "COMPLETING"
    EXPEDITING = "EXPEDITING"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    POWER_UP_NODE = "POWER_UP_NODE"
    RECONFIG_FAIL = "RECONFIG_FAIL"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SIGNALING = "SIGNALING"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    SUSPENDED = "SUSPENDED"
    UPDATE_DB = "UPDATE_DB"
    # ended
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    REVOKED = "REVOKED"

    def __str__(self) -> str:
        # The word, not `JobState.X`: str() and f-strings (whose format() follows __str__ since Python 3.12)
        # print what a person has always read.
        return self.value


SUCCESS = frozenset({JobState.COMPLETED})
"""The job ended and did what it was asked."""
FAILURE = frozenset(
    {
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.OUT_OF_MEMORY,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.REVOKED,
    }
)
"""The job ended otherwise (`meshrun resume` may continue it)."""
FINAL = SUCCESS | FAILURE
"""The job ended: it will not change by itself. Every other state may (a requeue, a start, a step)."""
