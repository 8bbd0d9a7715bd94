"""`python -m launcher.sidecar RUN_DIR`: this node's sidecar until SIGTERM (or SIGUSR2) or until its parent is gone.

It never fails the job: whatever goes wrong is one line in RUN_DIR/logs/sidecar-NODE.log and exit 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Optional

from launcher.exitcodes import EXIT_INPUT
from launcher.rundir import RunDir

USAGE = "usage: python -m launcher.sidecar RUN_DIR"
NICE = 10
"""The sidecar yields the CPU to the ranks."""


END_WAIT_S = 120.0
"""After a TERM, the longest the sidecar waits for its node's ranks to end before it stops anyway."""


class EndWait:
    """Stops the sidecar once the job is ending (a TERM) and this node's ranks are gone, or its parent is."""

    def __init__(self, sidecar: Any, ending: threading.Event, stop: threading.Event, log: Any) -> None:
        self.sidecar, self.ending, self.stop, self.log = sidecar, ending, stop, log
        self.parent = os.getppid()
        self.since: Optional[float] = None

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def check(self) -> None:
        if not self.ending.is_set():
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.log("the job is ending: waiting for this node's ranks to end (and save) first")
        if not self.sidecar.ranks_alive() or now - self.since > END_WAIT_S:
            self.stop.set()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return EXIT_INPUT
    from launcher.rundir import node_name
    from launcher.sidecar.loop import Log, Periodic, Sidecar, run_tasks

    run_dir = RunDir(os.path.abspath(argv[0]))
    node = node_name(os.environ)
    log = Log(run_dir.sidecar_log(node), node)
    stop = threading.Event()
    ending = threading.Event()

    def on_ranks_ended(signum: int, _frame: Any) -> None:
        stop.set()

    def on_job_ending(signum: int, _frame: Any) -> None:
        ending.set()

    # SIGUSR2 is how the batch script stops it once the ranks have ended: srun passes USR2 on to the
    # tasks, where a TERM would make srun kill the step outright. A TERM (scancel, a local cancel: the
    # whole job is told) means the ranks are saving a last checkpoint now: the sidecar waits for them
    # to end, then copies what they staged.
    signal.signal(signal.SIGUSR2, on_ranks_ended)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_job_ending)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # meant for the ranks; never this process's death
    try:
        os.nice(NICE)
    except OSError:
        pass
    log(f"started (pid {os.getpid()}) for {run_dir.root}")
    sidecar = None
    try:
        sidecar = Sidecar(run_dir, node, os.environ, log)
        waiting = EndWait(sidecar, ending, stop, log)
        why = run_tasks([*sidecar.tasks(), Periodic("end wait", 0.5, waiting.check)], stop, waiting.parent_alive, log)
        log(f"stopping: {why} ({sidecar.samples} samples)")
        sidecar.record_last_beats()
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
