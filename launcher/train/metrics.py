"""Rank 0's metrics.jsonl (`meshrun status` and the logs read it), its TensorBoard event files and
its human log line; every rank's progress heartbeat (meshrun.launcher.report.Heartbeat)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, TextIO

from meshrun.launcher.contract.gpus import mfu
from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.records import goodput
from meshrun.launcher.contract.records.rundir import RunDir, job_field
from meshrun.launcher.report import Heartbeat
from meshrun.launcher.train.tbwriter import ScalarWriter, scalars_of

METRICS_FILE = RunDir.METRICS


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (a diverged run), never an exception."""
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLog:
    """Appends one JSON line per logged step (restarts add to the same file), writes the same numbers
    (plus data-wait fraction, MFU and GPU memory) to TensorBoard and prints a human line."""

    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        steps: int,
        peak_tflops: Optional[float] = None,
        rank: Optional[int] = None,
    ) -> None:
        self.steps = steps
        self.job = job_field(os.environ)
        """Every line names the job that wrote it: a resume appends to the same file under a new id."""
        self.peak_tflops = peak_tflops
        """The GPU's dense bf16 peak: `mfu` joins each record when known."""
        self.file: Optional[TextIO] = None
        self.board: Optional[ScalarWriter] = None
        self.beat = Heartbeat(run_dir, rank) if rank is not None else None
        if enabled:
            make_private_dir(run_dir)
            # 0600 whatever the umask: as private as the run dir it lives in.
            fd = os.open(Path(run_dir) / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self.file = os.fdopen(fd, "a", encoding="utf-8")
            self.board = ScalarWriter(RunDir(run_dir).tensorboard)

    def stamp(self, step: int, phase: str, busy_s: Optional[float] = None) -> None:
        """This rank's heartbeat (every rank, every step): what it does now, for hang detection;
        `busy_s`, its own work in the step before, for straggler detection."""
        if self.beat is not None:
            self.beat.stamp(step, phase, busy_s)

    def resume_at(self, step: int, restart_count: int = 0) -> None:
        """This attempt's first step is about to begin: TensorBoard drops what an earlier attempt logged from
        there on, and metrics.jsonl says when training began and from which step (goodput's setup ends here,
        and the steps an earlier attempt computed past it were lost: launcher/contract/records/goodput.py)."""
        if self.board is not None:
            self.board.starts_at(step)
        self.event(
            {"event": goodput.TRAIN_START, "from_step": step - 1, "restart_count": restart_count, "time": time.time()}
        )

    def write(self, record: dict[str, Any], extra: Optional[Mapping[str, float]] = None) -> None:
        """One step's record; `extra` goes to TensorBoard only (metrics.jsonl keeps its keys)."""
        if self.file is None:
            return
        if self.peak_tflops and "tflops_per_rank" in record:
            record["mfu"] = mfu(record["tflops_per_rank"], self.peak_tflops)
        # Non-finite floats become null: strict JSON readers reject NaN/Infinity.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps({**clean, **self.job}) + "\n")
        self.file.flush()
        print(self.line(record), flush=True)
        self._board(record, extra or {})

    def _board(self, record: dict[str, Any], extra: Mapping[str, float]) -> None:
        scalars = scalars_of(record, skip=("step", "time", "restart_count"))
        if record.get("step_time_s"):
            # A starved input pipeline is said by the data_wait alert (launcher/train/lossrules.py).
            scalars["data_wait_fraction"] = record["data_wait_s"] / record["step_time_s"]
        if self.board is not None:
            self.board.add(int(record["step"]), {**scalars, **extra}, record.get("time"))

    def event(self, record: dict[str, Any]) -> None:
        """A non-step line (a committed checkpoint): readers take `step`/`loss` from step lines only."""
        if self.file is not None:
            self.file.write(json.dumps({**record, **self.job}) + "\n")
            self.file.flush()

    def line(self, r: dict[str, Any]) -> str:
        text = (
            f"step {r['step']}/{self.steps} loss {r['loss']:.4f} lr {r['lr']:.2e} "
            f"grad_norm {r['grad_norm']:.3f} tok/s {r['tokens_per_s']:,.0f} step_time {r['step_time_s']:.3f}s "
            f"data_wait {r['data_wait_s']:.3f}s"
        )
        if "mfu" in r:
            text += f" mfu {r['mfu']:.1%}"
        if "val_loss" in r:
            text += f" val_loss {r['val_loss']:.4f} val_ppl {r['val_ppl']:.2f}"
        return text

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()
