"""Stragglers: ranks persistently slower than the median of all ranks. Torch-free, stdlib only.

Every node's watchdog shares its ranks' recent medians (RunDir.step_times(node)); node rank 0's
compares all of them. A rank is named only after STREAK consecutive checks over the factor, so one
slow step (a checkpoint, a page fault) names nobody.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.sidecar.beats import read_json

STREAK = 3
"""Consecutive checks over the factor before a rank is named ("persistently")."""
FRESH_S = 60.0
"""A node's step-time file older than this is left out (that node's sidecar is gone or stuck)."""


def read_step_times(run_dir: RunDir, node: str) -> list[dict[str, Any]]:
    """Every node's shared step times (RunDir.step_times), of whichever attempt."""
    folder = os.path.dirname(run_dir.step_times(node))
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(".json"))
    except OSError:
        return []
    files = [read_json(os.path.join(folder, name)) for name in names]
    return [data for data in files if data is not None]


@dataclass(frozen=True)
class RankTime:
    rank: int
    node: str
    value_s: float


def rank_times(files: list[dict[str, Any]], attempt: str, now: float) -> list[RankTime]:
    """Every rank's recent time per step from the nodes' files of this attempt that are fresh.

    busy_s (the rank's own work) when every rank reports it, else step_s for all: one measure for all
    ranks, never a mix."""
    rows: list[tuple[int, str, Optional[float], Optional[float]]] = []
    for data in files:
        if data.get("attempt") != attempt or not isinstance(data.get("time"), (int, float)):
            continue
        if now - float(data["time"]) > FRESH_S:
            continue
        for rank, times in (data.get("ranks") or {}).items():
            if isinstance(times, dict):
                rows.append((int(rank), str(data.get("node", "?")), times.get("busy_s"), times.get("step_s")))
    use_busy = bool(rows) and all(isinstance(busy, (int, float)) for _, _, busy, _ in rows)
    out = []
    for rank, node, busy, step in rows:
        value = busy if use_busy else step
        if isinstance(value, (int, float)) and value > 0:
            out.append(RankTime(rank, node, float(value)))
    return sorted(out, key=lambda r: r.rank)


@dataclass
class StragglerTracker:
    """Node rank 0's memory across checks: how many checks in a row each rank was over the factor."""

    factor: float
    log: Callable[[str], None]
    streaks: dict[int, int] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)
    on_named: Optional[Callable[[RankTime, float, float, float, float], None]] = None
    """Called (rank time, ratio, median, factor, now) when a rank is named, once per streak (alerts)."""

    def check(self, times: list[RankTime], now: float) -> tuple[dict[str, Any], dict[str, float]]:
        """One check: stragglers.json's content and the ratio scalars (one per rank)."""
        if not times:
            return {"time": now, "factor": self.factor, "median_s": None, "stragglers": []}, {}
        median = statistics.median(t.value_s for t in times)
        scalars: dict[str, float] = {}
        stragglers = []
        for t in times:
            ratio = t.value_s / median if median > 0 else 1.0
            scalars[f"straggler/rank{t.rank}_ratio"] = round(ratio, 4)
            self.streaks[t.rank] = self.streaks.get(t.rank, 0) + 1 if ratio > self.factor else 0
            if self.streaks[t.rank] >= STREAK:
                stragglers.append(
                    {"rank": t.rank, "node": t.node, "busy_s": round(t.value_s, 6), "ratio": round(ratio, 3)}
                )
                if t.rank not in self.named:
                    self.named.add(t.rank)
                    self.log(
                        f"straggler: rank {t.rank} ({t.node}) takes {t.value_s:.3g} s per step, "
                        f"{ratio:.2f}x the median {median:.3g} s (factor {self.factor:g})"
                    )
                    if self.on_named is not None:
                        self.on_named(t, ratio, median, self.factor, now)
            elif t.rank in self.named:
                self.named.discard(t.rank)
                self.log(f"rank {t.rank} ({t.node}) is no longer a straggler ({ratio:.2f}x the median)")
        report = {"time": now, "factor": self.factor, "median_s": round(median, 6), "stragglers": stragglers}
        return report, scalars
