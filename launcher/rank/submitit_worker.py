"""submitit's worker on a Slurm node, whose requeue survives the SIGTERM that the requeue itself sends.

meshrun's submitit executor (submit/executor.py) runs `python -u -m meshrun.launcher.rank.submitit_worker
FOLDER` where submitit runs `python -u -m submitit.core._submit FOLDER`; the two differ in one place. A
checkpointable job that is preempted runs `scontrol requeue JOB` from inside the job, and Slurm answers a
requeue by sending SIGTERM to every process of the job: `scontrol` too, which on a loaded node now and then
dies of it before it exits, so submitit records a failed job although the requeue went through. Here
`scontrol` starts with SIGTERM ignored (it ends long before the SIGKILL that follows KillWait seconds later).
Torch-free.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Sequence

from submitit.core.submission import submitit_main
from submitit.slurm.slurm import SlurmJobEnvironment

REQUEUE_COMMAND = ("scontrol", "requeue")
REQUEUE_TIMEOUT_S = 60  # submitit's own


def run_ignoring_term(argv: Sequence[str], timeout_s: float = REQUEUE_TIMEOUT_S) -> None:
    """Run `argv` with SIGTERM ignored (a disposition the child inherits through exec); raise
    CalledProcessError when it fails. Called from a signal handler, so in the main thread."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        subprocess.run(list(argv), check=True, timeout=timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _requeue(self: SlurmJobEnvironment, countdown: int) -> None:
    run_ignoring_term([*REQUEUE_COMMAND, self.job_id])
    print(f"meshrun: requeued job {self.job_id} ({countdown} remaining timeouts)", flush=True)


def main() -> None:
    SlurmJobEnvironment._requeue = _requeue  # type: ignore[method-assign]
    submitit_main()


if __name__ == "__main__":
    main()
