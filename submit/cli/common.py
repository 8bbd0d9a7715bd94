"""What several verbs do alike: find the profile's file, and wait for a job (--wait)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional, TextIO

from meshrun.submit.views.tables import alert_line, progress_line


def profile_path_of(cluster: str) -> str:
    """The profile file's absolute path (the registry keeps it, so later verbs reach this very cluster)."""
    from meshrun.submit.config.cluster import profile_path

    return str(profile_path(cluster))


def finish_wait(record: Any, clusters: Any, registry: Any, total_steps: Optional[int]) -> int:
    """--wait: follow the job to its end; the exit code says how it ended (2: the ranks found bad input).
    Ctrl-C stops the waiting, never the job, and says so."""
    from meshrun.launcher.contract.exitcodes import EXIT_INPUT
    from meshrun.submit.core.status import Status

    try:
        status: Status = wait_for(record, clusters, registry, total_steps)
    except KeyboardInterrupt:
        print(
            f"\nmeshrun: stopped waiting; job {record.job_id} keeps running "
            f"(`meshrun status {record.job_id}`, `meshrun logs {record.job_id} -f`, "
            f"`meshrun cancel {record.job_id}`)",
            file=sys.stderr,
        )
        return 130
    print(f"job {record.job_id} {status.state}" + (f" ({status.reason})" if status.reason else ""))
    print(f"logs: {record.run_dir}/logs   metrics: {record.run_dir}/metrics.jsonl")
    if status.succeeded:
        return 0
    return EXIT_INPUT if status.exit_code == EXIT_INPUT else 1


def wait_for(
    record: Any, clusters: Any, registry: Any, total_steps: Optional[int], out: Optional[TextIO] = None
) -> Any:
    """Poll until the job ends, showing progress (one rewritten line on a terminal, plain lines piped)."""
    from meshrun.submit import api
    from meshrun.submit.errors import ConnectionLost

    out = out if out is not None else sys.stderr
    tty, last, started = out.isatty(), None, time.monotonic()
    shown: set[str] = set()  # the alerts already printed, by their record
    while True:
        try:
            status = api.statuses([record], clusters, registry)[0]
        except ConnectionLost:
            clusters.close()  # the job runs on regardless: reconnect at the next poll
            time.sleep(api.poll_interval(record.scheduler, time.monotonic() - started))
            continue
        new = [a for a in status.alerts if json.dumps(a, sort_keys=True) not in shown]
        for alert in new:  # each new alert once, on a line of its own above the progress line
            shown.add(json.dumps(alert, sort_keys=True))
            out.write(("\r\x1b[2K" if tty else "") + "ALERT " + alert_line(alert) + "\n")
        line = progress_line(status, total_steps)
        # Piped output gets a line only when the state or the step changes, not every tick.
        changed = (status.state, status.progress.get("step")) != last
        if tty:
            out.write("\r\x1b[2K" + line)
        elif changed:
            out.write(line + "\n")
        out.flush()
        last = (status.state, status.progress.get("step"))
        if status.done:
            if tty:
                out.write("\n")
            return status
        time.sleep(api.poll_interval(record.scheduler, time.monotonic() - started))
