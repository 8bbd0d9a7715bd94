"""Fault injection for tests and drills: make one rank hang, or straggle, or a sidecar miss its stop, on purpose.
Torch-free.

Set through the job's environment (`env:` in the spec, or `--set env.MESHRUN_TEST_HANG=1:5`):

    MESHRUN_TEST_HANG=RANK:STEP      rank RANK stops making progress at step STEP (it sleeps in
                                     `inject_hang`; its peers then wait in their next collective)
    MESHRUN_TEST_SLOW=RANK:SECONDS   rank RANK burns SECONDS of CPU in every step (a straggler)
    MESHRUN_TEST_DATA_DELAY=SECONDS  every rank waits SECONDS for its data in every step (a starved
                                     input pipeline: the wait counts as data wait)
    MESHRUN_TEST_SIDECAR_DEAF_S=S    each node's sidecar (its keeper and itself) takes no notice of a SIGUSR2
                                     (the ranks have ended) in its first S seconds: as if srun had dropped it
                                     (read by launcher/sidecar/keeper.py, which is stdlib only)

The rank faults act on the job's first attempt only (Slurm's restart count 0, and not a restart inside the allocation), so a requeued job resumes and
finishes: what the watchdog's end-to-end tests need. Nothing here runs unless one is set.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from meshrun.launcher.contract.records.rundir import in_job_restart
from meshrun.launcher.contract.spec.schema import SchemaError

HANG_ENV = "MESHRUN_TEST_HANG"
SLOW_ENV = "MESHRUN_TEST_SLOW"
DATA_DELAY_ENV = "MESHRUN_TEST_DATA_DELAY"


@dataclass(frozen=True)
class Faults:
    hang_step: Optional[int] = None
    """This rank hangs when it reaches this step."""
    slow_s: float = 0.0
    """CPU seconds this rank burns in every step."""
    data_delay_s: float = 0.0
    """Seconds this rank waits for its data in every step."""

    @property
    def any(self) -> bool:
        return self.hang_step is not None or self.slow_s > 0 or self.data_delay_s > 0

    def delay_data(self) -> float:
        """Called where the rank takes its step's data: sleeps the data delay, returns it (a data wait)."""
        if self.data_delay_s <= 0:
            return 0.0
        time.sleep(self.data_delay_s)
        return self.data_delay_s

    def at_step(self, step: int) -> None:
        """Called by the rank at the start of every step."""
        if self.slow_s > 0:
            burn_cpu(self.slow_s)
        if self.hang_step is not None and step == self.hang_step:
            inject_hang(step)


def _pair(environ: Mapping[str, str], key: str) -> Optional[tuple[int, str]]:
    value = environ.get(key, "").strip()
    if not value:
        return None
    rank, sep, rest = value.partition(":")
    if not sep or not rank.strip().isdigit() or not rest.strip():
        raise SchemaError(f"env.{key}", value, "give RANK:VALUE, e.g. 1:5 (see launcher/testing/faults.py)")
    return int(rank), rest.strip()


def faults_for(rank: int, restart_count: int, environ: Mapping[str, str] = os.environ) -> Faults:
    """The faults this rank injects (none after a requeue or a restart on a spare node: the rerun must finish)."""
    if restart_count > 0 or in_job_restart(environ) > 0:
        return Faults()
    hang, slow = _pair(environ, HANG_ENV), _pair(environ, SLOW_ENV)
    hang_step = int(hang[1]) if hang and hang[0] == rank else None
    slow_s = float(slow[1]) if slow and slow[0] == rank else 0.0
    return Faults(hang_step, slow_s, data_delay(environ))


def data_delay(environ: Mapping[str, str]) -> float:
    value = environ.get(DATA_DELAY_ENV, "").strip()
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise SchemaError(
            f"env.{DATA_DELAY_ENV}", value, "give seconds per step, e.g. 0.2 (see launcher/testing/faults.py)"
        )
    return seconds


def inject_hang(step: int) -> None:
    """Never returns: what a rank stuck in a dead lock or a lost collective looks like from outside."""
    print(f"[meshrun] {HANG_ENV}: this rank hangs at step {step} (fault injection)", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def burn_cpu(seconds: float) -> None:
    """Busy work, not sleep: a straggler's extra time is work the rank does."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        sum(range(1000))
