"""When each rank's log lines were written, for `meshrun logs --rank all` (not rank by rank, out of time order).

The ranks' output reaches logs/rank-N.log without passing through meshrun (srun writes it on Slurm; the local
supervisor points the rank's fds at it), and a line carries no time. Each node's sidecar samples its own ranks'
log sizes every second and, when one grew, appends `TIME SIZE` to .meshrun/logtimes/rank-N.txt: a line ending
at byte E was written by the first sample whose SIZE >= E. One small line per second of output at most; the
log itself is unchanged. Times are this node's clock, to the second.
"""

from __future__ import annotations

import bisect
import os
from typing import Optional, Sequence

from meshrun.launcher.contract.private import append_line
from meshrun.launcher.contract.records.rundir import RunDir

SAMPLE_S = 1.0
"""How often the sidecar samples: the merged view orders lines to this."""


def times_path(run_dir: str, rank: int) -> str:
    rd = RunDir(run_dir)
    return rd.path(rd.INTERNAL, "logtimes", f"rank-{rank}.txt")


class LogTimes:
    """The sampler of one node's rank logs (the sidecar's task)."""

    def __init__(self, run_dir: str, ranks: Sequence[int]) -> None:
        self.run_dir, self.ranks = run_dir, list(ranks)
        self.sizes: dict[int, int] = {}

    def tick(self, now: float) -> None:
        for rank in self.ranks:
            try:
                size = os.stat(RunDir(self.run_dir).rank_log(rank)).st_size
            except OSError:
                continue  # not started yet
            if size != self.sizes.get(rank):
                self.sizes[rank] = size
                path = times_path(self.run_dir, rank)
                append_line(path, f"{now:.3f} {size}")


Samples = tuple[list[int], list[float]]
"""Sizes (ascending) and the time each was first seen."""


def parse(text: str) -> Samples:
    """A rank's samples; a garbled line, or a size that went down (an older run's log replaced), is skipped."""
    sizes: list[int] = []
    times: list[float] = []
    for line in text.splitlines():
        parts = line.split()
        try:
            when, size = float(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            continue
        if not sizes or size > sizes[-1]:
            sizes.append(size)
            times.append(when)
    return sizes, times


def written_at(samples: Samples, end: int) -> Optional[float]:
    """When the bytes up to `end` had been written: the first sample that saw them; None after the last one."""
    sizes, times = samples
    at = bisect.bisect_left(sizes, end)
    return times[at] if at < len(sizes) else None
