"""Preemption and time limits: a signal sets a flag, the ranks agree at a step boundary.

The handler does nothing but set a flag: no I/O, no collectives, no locks, which is
what makes signal handlers deadlock (a rank stuck in NCCL while its handler waits
on a save). Every step the ranks all-reduce the flag (MAX, in meshrun.launcher.train.divergence.agree, which
carries the non-finite-loss check in the same collective), so every rank stops
after the same step, saves a normal checkpoint, and exits with EXIT_REQUEUE. The
batch script, not the rank, decides whether to requeue.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Iterable, Optional

from meshrun.launcher.contract.exitcodes import (  # noqa: F401  (re-exported)
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_GAVE_UP,
    EXIT_INPUT,
    EXIT_NAMES,
    EXIT_NO_PROGRESS,
    EXIT_REQUEUE,
)

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


@dataclass
class StopFlag:
    """Set by a signal; read at step boundaries. Only ever assigned in the handler."""

    signum: Optional[int] = None
    at: Optional[float] = None
    _previous: dict = field(default_factory=dict)

    @property
    def raised(self) -> bool:
        return self.signum is not None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handler(self, signum: int, _frame: Optional[FrameType]) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.time()

    def install(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> StopFlag:
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def describe(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "none"
