"""Alerts: one record type and one writer for every rule, wherever it runs. Torch-free, stdlib only.

    {"time", "step", "rule", "value", "threshold", "rank", "node", "message"}

one JSON line each in RUN_DIR/alerts.jsonl. Rank 0 (the loss rules: launcher/train/loop.py) and node 0's
sidecar (the GPU, straggler and hang rules; it forwards the other nodes' lines) write it, so every
append comes from one machine and stays a whole line even on NFS. `meshrun status`, `top` and
`watch --notify` read it. The rules' names (RULES) are what `alerts:` settings and the records use.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.records.rundir import job_of

RULES = (
    "nonfinite_loss",
    "loss_spike",
    "grad_norm_spike",
    "val_not_improving",
    "data_wait",
    "gpu_util_low",
    "gpu_memory_high",
    "straggler",
    "hang",
    "checkpoint_lost",
    "node_unhealthy",
    "plan_drift",
)


@dataclass(frozen=True)
class Alert:
    rule: str
    """One of RULES."""
    value: Optional[float]
    """What was measured (None for a non-finite loss: JSON has no NaN)."""
    threshold: Optional[float]
    """What it was compared with."""
    message: str
    """One line for a person, with the usual fix."""
    step: Optional[int] = None
    rank: Optional[int] = None
    node: Optional[str] = None
    time: float = 0.0
    job: Optional[str] = None
    """The job that raised it (default: this process's, rundir.job_of): status shows each id its own."""

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"alert rule {self.rule!r}: use one of {', '.join(RULES)}")

    def record(self) -> dict[str, Any]:
        data = asdict(self)
        data["time"] = self.time or time.time()
        data["job"] = self.job or job_of(os.environ)
        for key in ("value", "threshold"):
            number = data[key]
            data[key] = number if number is None or math.isfinite(number) else None  # strict JSON
        return data

    def line(self) -> str:
        """The log's line for it."""
        where = "".join(
            [
                f" step {self.step}" if self.step is not None else "",
                f" rank {self.rank}" if self.rank is not None else "",
            ]
        )
        return f"[meshrun] ALERT {self.rule}{where}: {self.message}"


def append(path: str, alerts: list[Alert]) -> None:
    """Append the alerts' lines in one write (O_APPEND: whole lines beside other writers of this machine); 0600."""
    if not alerts:
        return
    text = "".join(json.dumps(a.record(), sort_keys=True) + "\n" for a in alerts)
    make_private_dir(os.path.dirname(path) or ".", keep_existing=True)  # the run dir, already 0700
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read(path: str, limit: int = 1000) -> list[dict[str, Any]]:
    """The newest `limit` alert records of a file (a line being written, or garbled, is skipped)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.readlines()[-limit:]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("rule") in RULES:
            out.append(record)
    return out
