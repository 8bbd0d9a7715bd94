"""A rank's own work time per step, for straggler detection.

Synchronous training makes every rank's wall time per step the same (the slowest sets the pace),
so the heartbeat carries what differs: the rank's own work. On CPU ranks that is the time its main thread was
runnable over the step: on a CPU, or waiting for one (Linux's /proc/thread-self/schedstat; gloo waits sleep, so
they count in neither). The wait for a CPU is the rank's too: on a crowded node (another job, more ranks than
CPUs) CPU time alone made the time spent waiting for a core look like communication, and the plan check named
communication for a rank slowed on purpose (the process's CPU time where schedstat is missing). On GPU ranks it is
the time between two
CUDA events around the step on the compute stream, read one step late so that no step ever waits
for it; it includes communication the compute stream waits on (documented in docs/guides/hangs-and-alerts.md).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

SCHEDSTAT = Path("/proc/thread-self/schedstat")
"""This thread's nanoseconds on a CPU, nanoseconds waiting on a run queue, and time slices (Linux)."""


def runnable_s() -> float:
    """Seconds this thread has been runnable (on a CPU or waiting for one), else the process's CPU time."""
    try:
        on_cpu, waiting = SCHEDSTAT.read_text().split()[:2]
        return (int(on_cpu) + int(waiting)) / 1e9
    except (OSError, ValueError):
        return time.process_time()


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
            self._cpu_start = runnable_s()

    def stop(self) -> Optional[float]:
        """End the step; returns the newest known busy time (on GPUs: the previous step's, when done)."""
        if not self.cuda:
            self.last = runnable_s() - self._cpu_start
            return self.last
        if self._events is not None:
            self._events[1].record()
            if self._pending is not None and self._pending[1].query():
                self.last = self._pending[0].elapsed_time(self._pending[1]) / 1000.0
            self._pending, self._events = self._events, None
        return self.last
