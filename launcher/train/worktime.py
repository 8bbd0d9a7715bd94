"""A rank's own work time per step, for straggler detection.

Synchronous training makes every rank's wall time per step the same (the slowest sets the pace),
so the heartbeat carries what differs: the rank's own work. On CPU ranks that is the process's CPU
time over the step (gloo waits sleep, they do not burn CPU). On GPU ranks it is the time between two
CUDA events around the step on the compute stream, read one step late so that no step ever waits
for it; it includes communication the compute stream waits on (documented in docs/guides/hangs-and-alerts.md).
"""

from __future__ import annotations

import time
from typing import Any, Optional


class BusyClock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._cpu_start = 0.0
        self._events: Optional[tuple[Any, Any]] = None
        self._pending: Optional[tuple[Any, Any]] = None
        self.last: Optional[float] = None
        """The newest measured step's busy seconds (None until one is known)."""

    def start(self) -> None:
        if self.cuda:
            import torch

            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events = (begin, torch.cuda.Event(enable_timing=True))
        else:
            self._cpu_start = time.process_time()

    def stop(self) -> Optional[float]:
        """End the step; returns the newest known busy time (on GPUs: the previous step's, when done)."""
        if not self.cuda:
            self.last = time.process_time() - self._cpu_start
            return self.last
        if self._events is not None:
            self._events[1].record()
            if self._pending is not None and self._pending[1].query():
                self.last = self._pending[0].elapsed_time(self._pending[1]) / 1000.0
            self._pending, self._events = self._events, None
        return self.last
