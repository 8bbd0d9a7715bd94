"""Each start and end of a Slurm job's allocation, as the batch script records them (torch-free):

    python -m meshrun.launcher.batch.attempt RUN_DIR start [SUBMITTED]   # SUBMITTED: squeue's SubmitTime (ISO), or ""
    python -m meshrun.launcher.batch.attempt RUN_DIR end STATUS [WHY]   # WHY: a stop status shows while the job waits

The job id, restart count and nodes come from Slurm's environment (a restart inside the allocation, on spare
nodes, from the batch script's MESHRUN_RESTART_IN_JOB and MESHRUN_RUN_NODES). Both append to RUN_DIR/.meshrun/
attempts.jsonl and then account the job's goodput so far (RUN_DIR/.meshrun/goodput/JOB.json, which
`meshrun status JOB` shows): launcher/contract/records/goodput.py. Never fails the job: a problem is one line on
stderr and exit 0.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from typing import Mapping, Optional

from meshrun.launcher.contract.records import goodput
from meshrun.launcher.contract.records.rundir import RUN_NODES_ENV, in_job_restart, job_of

USAGE = "usage: python -m meshrun.launcher.batch.attempt RUN_DIR start [SUBMITTED] | RUN_DIR end STATUS [WHY]"


def submitted_time(text: str) -> Optional[float]:
    """Slurm's SubmitTime (`2026-12-03T09:02:52`, this machine's local time) as epoch seconds; None if unset."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def main(argv: Optional[list[str]] = None, environ: Mapping[str, str] = os.environ) -> int:
    args = sys.argv[1:] if argv is None else argv
    job = job_of(environ)
    if len(args) < 2 or args[1] not in ("start", "end") or job is None:
        print(USAGE, file=sys.stderr)
        return 0
    run_dir, event = args[0], args[1]
    restart, in_job = int(environ.get("SLURM_RESTART_COUNT") or 0), in_job_restart(environ)
    nodes = environ.get(RUN_NODES_ENV) or environ.get("SLURM_JOB_NODELIST", "")
    try:
        if event == "start":
            submitted = submitted_time(args[2]) if len(args) > 2 else None
            goodput.record_start(run_dir, job, restart, submitted, nodes, in_job)
        else:
            status = int(args[2]) if len(args) > 2 and args[2].isdigit() else None
            goodput.record_end(run_dir, job, restart, status, in_job, environ.get(RUN_NODES_ENV, ""))
            if len(args) > 3 and args[3]:
                from meshrun.launcher.batch.requeue import record_stop  # the batch host's one writer of a stop's reason

                record_stop(run_dir, args[3], environ)
        goodput.write(run_dir, job)
    except OSError as exc:  # the accounting never fails the job it accounts
        print(f"[meshrun] goodput: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
