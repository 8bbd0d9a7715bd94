"""A job's energy as its nodes measure it, never guessed. Torch-free, stdlib only.

Each node's sidecar keeps RUN_DIR/.meshrun/energy/JOB.NODE.json (rundir.RunDir.energy), rewritten at each sample:

    {"job", "node", "gpus", "gpu_j", "cpu_j", "since", "time"}

`gpu_j`: the energy NVML's counter (nvmlDeviceGetTotalEnergyConsumption) says the node's GPUs of the job used
since the sidecar started; `cpu_j`: the same from the CPU packages' RAPL counters
(/sys/class/powercap/intel-rapl:N/energy_uj) where this user can read them. null: not measured there (no such
counter, or not readable): `meshrun status` then says "unmeasured" rather than a figure it cannot know.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping, Optional

KWH = 3.6e6
"""Joules in a kilowatt-hour."""


def parse(text: Optional[str], job: Optional[str]) -> Optional[dict[str, Any]]:
    """A node's record when it is whole and this job's, else None."""
    try:
        record = json.loads(text or "")
    except ValueError:
        return None
    if not isinstance(record, dict) or (job is not None and record.get("job") != job):
        return None
    for key in ("gpu_j", "cpu_j"):
        value = record.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
        ):
            return None
    return record


def _kwh(records: list[Mapping[str, Any]], key: str) -> Optional[float]:
    """The nodes' sum in kWh; None unless every node measured it (a part would read as the whole)."""
    values = [r.get(key) for r in records]
    if not values or any(v is None for v in values):
        return None
    return sum(float(v) for v in values if v is not None) / KWH


def total(records: Iterable[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """The job's energy over its nodes: {"nodes", "gpu_kwh", "cpu_kwh"} (None: unmeasured); None without a record."""
    found = list(records)
    if not found:
        return None
    return {"nodes": len(found), "gpu_kwh": _kwh(found, "gpu_j"), "cpu_kwh": _kwh(found, "cpu_j")}
