"""`python -m launcher.sidecar RUN_DIR`: this node's sidecar until SIGTERM (or SIGUSR2) or until its parent is gone.

It never fails the job: whatever goes wrong is one line in RUN_DIR/logs/sidecar-NODE.log and exit 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Optional

from launcher.exitcodes import EXIT_INPUT
from launcher.rundir import RunDir

USAGE = "usage: python -m launcher.sidecar RUN_DIR"
NICE = 10
"""The sidecar yields the CPU to the ranks."""


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return EXIT_INPUT
    from launcher.rundir import node_name
    from launcher.sidecar.loop import Log, Sidecar, run_tasks

    run_dir = RunDir(os.path.abspath(argv[0]))
    node = node_name(os.environ)
    log = Log(run_dir.sidecar_log(node), node)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    # SIGUSR2 is how the batch script stops it: srun passes USR2 on to the tasks, where a TERM would
    # make srun kill the step outright.
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # meant for the ranks; never this process's death
    parent = os.getppid()
    try:
        os.nice(NICE)
    except OSError:
        pass
    log(f"started (pid {os.getpid()}) for {run_dir.root}")
    sidecar = None
    try:
        sidecar = Sidecar(run_dir, node, os.environ, log)
        why = run_tasks(sidecar.tasks(), stop, lambda: os.getppid() == parent, log)
        log(f"stopping: {why} ({sidecar.samples} samples)")
        sidecar.finish_copies()
        log("stopped")
    except BaseException as exc:  # never into the job: one line, exit 0
        log(f"stopped by an error: {type(exc).__name__}: {exc}")
    finally:
        try:
            if sidecar is not None:
                sidecar.close()
        except Exception as exc:
            log(f"closing: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
