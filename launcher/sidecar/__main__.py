"""`python -m meshrun.launcher.sidecar RUN_DIR`: this node's sidecar, kept alive by its keeper (keeper.py).

Run by the batch script or the local supervisor, it is the keeper, which runs the sidecar itself as its
child (the same command, with MESHRUN_SIDECAR_KEPT set) and starts it again if it dies. The sidecar runs
until SIGUSR2 (the ranks ended), or a SIGTERM and then its node's ranks ending. When its parent (the
keeper) is gone it carries on while this node's ranks run and stops after them: it never pulls the
node's scratch folder from under live ranks.

It never fails the job: whatever goes wrong is one line in RUN_DIR/logs/sidecar-NODE.log and exit 0 (a
kept sidecar stopped by an error exits 1, so that its keeper starts it again).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from meshrun.launcher.contract.exitcodes import EXIT_INPUT
from meshrun.launcher.contract.records.rundir import RunDir

if TYPE_CHECKING:
    from meshrun.launcher.sidecar.loop import Stop

USAGE = "usage: python -m meshrun.launcher.sidecar RUN_DIR"
NICE = 10
"""The sidecar yields the CPU to the ranks."""


END_WAIT_S = 120.0
"""After a TERM, the longest the sidecar waits for its node's ranks to end before it stops anyway."""


class EndWait:
    """Stops the sidecar once the job is ending (a TERM) and this node's ranks are gone (or END_WAIT_S has
    passed), or once its parent is gone and so are this node's ranks."""

    def __init__(self, sidecar: Any, ending: Stop, stop: Stop, log: Any) -> None:
        self.sidecar, self.ending, self.stop, self.log = sidecar, ending, stop, log
        self.parent = os.getppid()
        self.since: Optional[float] = None
        self.orphaned = False
        self.seen_alive = False
        """Whether a rank of this attempt was ever seen running: before that, 'no rank alive' means the ranks
        have not started (or an earlier attempt's heartbeats are all there is), not that they have ended."""
        from meshrun.launcher.contract.procs import current_job

        self.job = current_job(os.environ)
        """Inside a job its parent (batch shell, local supervisor) sends USR2 once the ranks have ended; a
        sidecar run by hand has no ranks to wait for."""

    def check(self) -> None:
        alive = self.sidecar.ranks_alive()
        self.seen_alive = self.seen_alive or alive
        if not self.orphaned and os.getppid() != self.parent:
            # Its keeper (and maybe the local supervisor) was killed. Its ranks may run on: the copies, the
            # hang watch and the samples go on while they do (docs/guides/checkpoints.md: on `local`, orphaned ranks).
            self.orphaned = True
            self.log(f"its parent (pid {self.parent}) is gone: carrying on while this node's ranks run")
        if self.orphaned and not alive:
            self.log("its parent is gone and this node's ranks have ended")
            self.stop.set()
            return
        if not self.ending.is_set():
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.log("the job is ending: waiting for this node's ranks to end (and save) first")
        # A cancel in the ranks' first seconds: they will still start, save and stop, and their parent (the
        # batch shell, the local supervisor) sends USR2 when they have ended. Stopping before them lost the
        # checkpoint they then staged.
        ended = not alive and (self.seen_alive or self.job is None or not self._job_processes_left())
        if ended or now - self.since > END_WAIT_S:
            self.stop.set()

    def _job_processes_left(self) -> bool:
        """Ranks that never wrote a heartbeat (a command job that does not call report(), or ranks cancelled
        while starting) are still the job's processes: gone once none is left but this sidecar's own kin
        (its parent gone too, nobody would send the USR2: it waited END_WAIT_S for nothing)."""
        from meshrun.launcher.contract.procs import others_in_job

        assert self.job is not None
        return bool(others_in_job(self.job))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return EXIT_INPUT
    from meshrun.launcher.contract.private import private_umask
    from meshrun.launcher.contract.records.rundir import node_name
    from meshrun.launcher.sidecar.keeper import KEPT_ENV, TOLD_ENV, deaf_end, keep, unblock_stop_signals
    from meshrun.launcher.sidecar.sidelog import Log

    private_umask()  # its logs, TensorBoard files and the copier's copies (and its kept child): nobody else's
    run_dir = RunDir(os.path.abspath(argv[0]))
    node = node_name(os.environ)
    log = Log(run_dir.sidecar_log(node), node)
    kept = bool(os.environ.get(KEPT_ENV))
    if not kept:
        return keep(run_dir.root, log)  # the keeper: none of the sidecar's own modules (sidelog.py says why)
    from meshrun.launcher.sidecar.loop import Flag, Periodic, Sidecar, run_tasks

    failed = False
    stop, ending = Flag(), Flag()  # set by signal handlers: never a lock (loop.Flag)

    deaf_until = deaf_end(os.environ)

    def on_ranks_ended(signum: int, _frame: Any) -> None:
        if time.time() >= deaf_until:
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
    unblock_stop_signals()  # its keeper started it with them blocked: any that came meanwhile arrive now
    told = os.environ.get(TOLD_ENV, "").split(",")  # a restarted sidecar: what its predecessor was told
    if "SIGUSR2" in told:
        stop.set()
    if "SIGTERM" in told:
        ending.set()
    try:
        os.nice(NICE)
    except OSError:
        pass
    log(f"started (pid {os.getpid()}) for {run_dir.root}")
    sidecar = None
    try:
        sidecar = Sidecar(run_dir, node, os.environ, log)
        waiting = EndWait(sidecar, ending, stop, log)
        why = run_tasks([*sidecar.tasks(), Periodic("end wait", 0.5, waiting.check)], stop, lambda: True, log)
        log(f"stopping: {why} ({sidecar.samples} samples)")
        sidecar.record_last_beats()
        sidecar.finish_copies()
        log("stopped")
    except BaseException as exc:  # never into the job: one line (its keeper starts it again)
        log(f"stopped by an error: {type(exc).__name__}: {exc}")
        failed = True
    finally:
        try:
            if sidecar is not None:
                sidecar.close()
        except Exception as exc:
            log(f"closing: {type(exc).__name__}: {exc}")
    return 1 if failed and kept else 0


if __name__ == "__main__":
    code = main()
    from meshrun.launcher.sidecar.keeper import block_stop_signals

    block_stop_signals()  # the keeper's or the sidecar's work is done: a repeated USR2 as Python shuts down must not end it
    sys.exit(code)
