"""The sidecar's keeper: `python -m meshrun.launcher.sidecar RUN_DIR` runs this, and it runs the sidecar as its child.

A sidecar that dies (kill -9, the OOM killer, a bug) while the ranks run would silently stop copying
checkpoints staged on node-local scratch, watching for hangs and sampling: every later checkpoint would stay
on scratch and be lost when the attempt ends. On Slurm the sidecars of all nodes are one srun step, so the
batch script cannot see one node's sidecar die; whatever started the sidecar starts this keeper instead,
which starts the sidecar again (same attempt: it carries on copying what its predecessor left) and passes
on every stop signal. The keeper does nothing else, so there is little in it to die.

When the keeper's own parent is gone (the local supervisor killed), it stops keeping and exits: its sidecar
then carries on by itself while this node's ranks run (launcher/sidecar/__main__.py), and stops after them.
Stdlib only; it never fails the job (exit 0 whatever happens).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Optional

KEPT_ENV = "MESHRUN_SIDECAR_KEPT"
"""Set in the sidecar's environment by its keeper (the keeper's pid): the sidecar runs, not another keeper."""
TOLD_ENV = "MESHRUN_SIDECAR_TOLD"
"""The stop signals its keeper received before this sidecar started (SIGUSR2, SIGTERM: comma-separated)."""
SINCE_ENV = "MESHRUN_SIDECAR_SINCE"
"""When the keeper started (its sidecar's attempt start on this node): a restarted sidecar's ranks beat
before its own start and are this attempt's all the same."""
DEAF_ENV = "MESHRUN_TEST_SIDECAR_DEAF_S"
"""Test fault injection, read here (the keeper is stdlib only): see launcher/testing/faults.py."""
MAX_RESTARTS = 20
"""A sidecar that keeps dying is started again at most this often in one attempt (then the log says so)."""
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
"""The wait before each restart (the last value repeats): a sidecar crashing at start does not spin."""
POLL_S = 0.2
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""USR2: the ranks have ended; TERM, INT, HUP: the job is ending."""
LogFn = Callable[[str], None]


def describe_exit(code: int) -> str:
    """'killed by SIGKILL' for a negative Popen return code, else 'exit N'."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


class Keeper:
    """Runs one sidecar child at a time; restarts it when it ends other than cleanly (exit 0)."""

    def __init__(self, argv: list[str], log: LogFn, env: Optional[dict[str, str]] = None) -> None:
        self.argv, self.log = argv, log
        base = env if env is not None else os.environ
        self.env = {**base, KEPT_ENV: str(os.getpid()), SINCE_ENV: base.get(SINCE_ENV) or str(time.time())}
        self.child: Optional[subprocess.Popen[bytes]] = None
        self.told: list[int] = []
        """Stop signals received so far, in order: each new child is told them at its start (TOLD_ENV)."""
        self.parent = os.getppid()
        self.restarts = 0
        self.deaf_until = deaf_end(self.env)

    def on_signal(self, signum: int, _frame: Any) -> None:
        """USR2 (the ranks ended) and TERM/INT/HUP (the job is ending) go to the sidecar, now and after a restart."""
        sig = signal.SIGUSR2 if signum == signal.SIGUSR2 else signal.SIGTERM
        if sig == signal.SIGUSR2 and time.time() < self.deaf_until:
            return
        if sig not in self.told:
            self.told.append(sig)
        self._send(sig)

    def _send(self, sig: int) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(sig)  # a Popen child: this is that process until it is reaped
            except OSError:
                pass

    def _start(self) -> None:
        # What it was told before goes in its environment, not as signals (it acts on them as it starts).
        known = list(self.told)
        told = ",".join(signal.Signals(sig).name for sig in known)
        # The child starts with the stop signals blocked (a signal mask survives fork and exec) and unblocks them
        # once its handlers are set (unblock_stop_signals): one that comes while it starts, from this keeper or
        # from Slurm (which signals every process of the step), waits for its handler instead of ending it.
        # (The batch script says USR2 again every second until the sidecars stop.)
        self.child = popen_blocking(STOP_SIGNALS, self.argv, env={**self.env, TOLD_ENV: told}, stdin=subprocess.DEVNULL)
        # A signal told while Popen ran is not in the child's environment: pass it on now. (Measured: the ranks
        # of a short job ended while their sidecar started, and it ran on until the time limit.)
        for sig in self.told[len(known) :]:
            self._send(sig)

    def _wait(self) -> int:
        """The child's return code; None never: waits, and stops keeping once the keeper's parent is gone."""
        assert self.child is not None
        while True:
            code = self.child.poll()
            if code is not None:
                return code
            if os.getppid() != self.parent:
                return 0  # orphaned: the sidecar carries on alone (see the module's docstring)
            time.sleep(POLL_S)

    def run(self) -> int:
        while True:
            self._start()
            assert self.child is not None
            pid = self.child.pid
            code = self._wait()
            if code == 0:
                if os.getppid() != self.parent:
                    self.log(f"the sidecar's keeper lost its parent: sidecar pid {pid} carries on by itself")
                return 0
            if self.restarts >= MAX_RESTARTS:
                self.log(
                    f"the sidecar (pid {pid}) ended ({describe_exit(code)}) {self.restarts + 1} times: not restarted again"
                )
                return 0
            wait_s = BACKOFF_S[min(self.restarts, len(BACKOFF_S) - 1)]
            self.restarts += 1
            self.log(
                f"the sidecar (pid {pid}) ended ({describe_exit(code)}) while the job runs: starting it again "
                f"in {wait_s:g} s (restart {self.restarts} of at most {MAX_RESTARTS})"
            )
            time.sleep(wait_s)


def deaf_end(environ: Mapping[str, str]) -> float:
    """Fault injection (launcher/testing/faults.py, MESHRUN_TEST_SIDECAR_DEAF_S): until when, counted from the
    keeper's start, the keeper and its sidecar take no notice of a SIGUSR2, as if srun had dropped it."""
    try:
        deaf_s = max(0.0, float(environ.get(DEAF_ENV, "") or 0))
    except ValueError:
        deaf_s = 0.0
    return float(environ.get(SINCE_ENV) or time.time()) + deaf_s if deaf_s else 0.0


def popen_blocking(signals: tuple[int, ...], argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen(argv, **kwargs) whose process starts with `signals` blocked (a signal mask survives fork
    and exec; the caller's own mask is restored at once): one sent meanwhile stays pending until the process
    unblocks it, or for good, instead of ending it before it could set a handler."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        return subprocess.Popen(argv, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def unblock_stop_signals() -> None:
    """In the sidecar, once its handlers are set: the stop signals its keeper started it with blocked, and any
    that came meanwhile, reach them now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def block_stop_signals() -> None:
    """In a keeper or sidecar process about to exit (never in one that goes on: every process it started later
    would inherit the mask, and not hear a TERM either). From here on a stop signal changes nothing, and as Python
    shuts down it resets its handlers to the default action, which for USR2 is death. The batch script says USR2
    every second until the sidecars have stopped (and Slurm passes it to every process of their step): one that
    landed in that last instant ended a sidecar that had stopped cleanly "killed by SIGUSR2", and its keeper
    started it again (in 9 of 92 testbed sidecar logs of a suite run; under a USR2 every 20 ms, every time).
    Blocked, it is discarded with the process."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def keep(run_dir: str, log: LogFn) -> int:
    """The keeper's main: the sidecar for RUN_DIR as a child, kept alive until it stops cleanly."""
    keeper = Keeper([sys.executable, "-m", "meshrun.launcher.sidecar", run_dir], log)
    for sig in STOP_SIGNALS:
        signal.signal(sig, keeper.on_signal)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # meant for the ranks
    try:
        return keeper.run()
    except BaseException as exc:  # never into the job
        log(f"the sidecar's keeper stopped by an error: {type(exc).__name__}: {exc}")
        if keeper.child is not None and keeper.child.poll() is None:
            keeper._send(signal.SIGTERM)
        return 0
