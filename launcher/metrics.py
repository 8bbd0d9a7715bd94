"""Rank 0's metrics.jsonl (the sidecar and `meshrun status` read it) and its human log line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, TextIO

from launcher.rundir import RunDir

METRICS_FILE = RunDir.METRICS


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (a diverged run), never an exception."""
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLog:
    """Appends one JSON line per logged step (restarts add to the same file) and prints a human line."""

    def __init__(self, run_dir: str, enabled: bool, steps: int) -> None:
        self.steps = steps
        self.file: Optional[TextIO] = None
        if enabled:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            # 0600 whatever the umask: as private as the run dir it lives in.
            fd = os.open(Path(run_dir) / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.file = os.fdopen(fd, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        # Non-finite floats become null: strict JSON readers reject NaN/Infinity.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        print(self.line(record), flush=True)

    def event(self, record: dict[str, Any]) -> None:
        """A non-step line (a committed checkpoint): readers take `step`/`loss` from step lines only."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def line(self, r: dict[str, Any]) -> str:
        text = (
            f"step {r['step']}/{self.steps} loss {r['loss']:.4f} lr {r['lr']:.2e} "
            f"grad_norm {r['grad_norm']:.3f} tok/s {r['tokens_per_s']:,.0f} step_time {r['step_time_s']:.3f}s "
            f"data_wait {r['data_wait_s']:.3f}s"
        )
        if "val_loss" in r:
            text += f" val_loss {r['val_loss']:.4f} val_ppl {r['val_ppl']:.2f}"
        return text

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
