"""Heartbeats as the watchdog sees them, the phase timeouts, and atomic file writes. Torch-free, stdlib only."""

from __future__ import annotations

import json
import os
import statistics
from collections import deque
from typing import Any, Optional, Sequence

from meshrun.launcher.contract.spec.job import Watchdog as WatchdogSettings

RECENT = 20
"""Step durations (per rank) the step timeout looks at."""
WARMUP_DURATIONS = 3
"""With fewer step durations known, a step gets the setup timeout (warm-up, compilation)."""


def read_json(path: str) -> Optional[dict[str, Any]]:
    """A JSON object, or None when missing, half written or not an object."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def step_timeout(settings: WatchdogSettings, durations: Sequence[float]) -> float:
    """max(step_factor x median, 2 x slowest) + step_floor_s over the recent durations; warm-up gets setup's."""
    if len(durations) < WARMUP_DURATIONS:
        return settings.setup_timeout_s
    median = statistics.median(durations)
    return max(settings.step_factor * median, 2 * max(durations)) + settings.step_floor_s


def phase_timeout(settings: WatchdogSettings, phase: str, durations: Sequence[float]) -> float:
    if phase == "step":
        return step_timeout(settings, durations)
    if phase == "eval":
        return settings.eval_timeout_s
    if phase == "checkpoint":
        return settings.checkpoint_timeout_s
    return settings.setup_timeout_s


def write_text(path: str, text: str) -> None:
    """Atomic and private (0600), as meshrun.launcher.contract.records.rundir.record_exit writes the exit code."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


class RankTrack:
    """One rank as seen from its heartbeats: the last beat, recent step durations and busy times."""

    def __init__(self) -> None:
        self.beat: dict[str, Any] = {}
        self.durations: deque[float] = deque(maxlen=RECENT)
        self.busy: deque[float] = deque(maxlen=RECENT)

    def observe(self, beat: dict[str, Any]) -> bool:
        """Take a new beat; True when the rank progressed (its step or phase changed)."""
        prev, self.beat = self.beat, beat
        if prev and (prev.get("step"), prev.get("phase")) == (beat.get("step"), beat.get("phase")):
            return False
        if prev.get("phase") == beat.get("phase") == "step" and beat["step"] > prev["step"]:
            # per step: a tick may see step N, then N+3 when steps are shorter than a tick
            # one entry per step it covers: 20 fast steps between two ticks are 20 known steps (the warm-up
            # guard counts steps, not sightings), each at the average
            steps = beat["step"] - prev["step"]
            per_step = max(0.0, (beat["time"] - prev["time"]) / steps)
            self.durations.extend([per_step] * min(steps, RECENT))
        if isinstance(beat.get("busy_s"), (int, float)):
            self.busy.append(float(beat["busy_s"]))
        return True

    def medians(self) -> dict[str, Optional[float]]:
        """What the node shares for straggler detection: recent median busy and step time."""
        return {
            "busy_s": statistics.median(self.busy) if self.busy else None,
            "step_s": statistics.median(self.durations) if self.durations else None,
        }
