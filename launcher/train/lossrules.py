"""Rank 0's loss rules: alerts from the numbers each logged step already has. Torch-free, stdlib only.

Fed one metrics record per logged step (launcher/train/loop.py, log_step's record); returns the alerts it
raises, which the trainer appends to RUN_DIR/alerts.jsonl and prints in the rank-0 log. No rule reads
a tensor, so none adds a host sync. The rules (docs/guides/hangs-and-alerts.md; thresholds in the spec's `alerts:`):

- loss_spike: the loss exceeds `loss_spike_factor` x the median of the last `window` logged losses
  (judged once 10 are known); once per streak of spiking logged steps.
- grad_norm_spike: the same on the grad norm, with `grad_norm_spike_factor`.
- val_not_improving: no new best val_loss in `val_patience` evaluations; once per streak.
- data_wait: data_wait_s / step_time_s above `data_wait_fraction` for 3 logged steps in a row; once
  per streak.

A non-finite loss is not judged here: it stops the job (launcher/train/divergence.py builds its alert).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from meshrun.launcher.contract.records.alerts import Alert
from meshrun.launcher.contract.spec.job import Alerts

MIN_HISTORY = 10
"""Logged values a spike rule waits for before judging (a median of 2 says little)."""
DATA_WAIT_LOGS = 3
"""Logged steps in a row above the data-wait fraction before the data_wait rule fires."""


def _finite(value: Any) -> Optional[float]:
    """The value as a finite float, or None (absent, null in JSON, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class SpikeRule:
    """value > factor x median(last `window` values), once the history holds MIN_HISTORY values."""

    rule: str
    what: str
    factor: float
    window: int
    fix: str
    history: deque[float] = field(default_factory=deque)
    spiking: bool = False

    def observe(self, step: int, value: Optional[float]) -> Optional[Alert]:
        if self.factor <= 0 or value is None:
            return None
        alert = None
        if len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            threshold = self.factor * median
            above = median > 0 and value > threshold
            if above and not self.spiking:
                alert = Alert(
                    self.rule,
                    value,
                    threshold,
                    f"{self.what} {value:.4g} is {value / median:.1f}x its median {median:.4g} over the last "
                    f"{len(self.history)} logged steps (alert above {self.factor:g}x); {self.fix}",
                    step=step,
                )
            self.spiking = above
        self.history.append(value)
        while len(self.history) > self.window:
            self.history.popleft()
        return alert


@dataclass
class ValRule:
    """No new best val_loss in `patience` evaluations in a row: said once per such streak."""

    patience: int
    best: Optional[float] = None
    since_best: int = 0
    said: bool = False

    def observe(self, step: int, val_loss: Optional[float]) -> Optional[Alert]:
        if self.patience <= 0 or val_loss is None:
            return None
        if self.best is None or val_loss < self.best:
            self.best, self.since_best, self.said = val_loss, 0, False
            return None
        self.since_best += 1
        if self.since_best < self.patience or self.said:
            return None
        self.said = True
        return Alert(
            "val_not_improving",
            val_loss,
            self.best,
            f"val_loss {val_loss:.4f} has not improved on its best {self.best:.4f} in {self.since_best} "
            "evaluations; the model may be overfitting or the learning rate too high (lower train.lr, "
            "use more data, or stop here)",
            step=step,
        )


@dataclass
class DataWaitRule:
    """data_wait_s / step_time_s above `fraction` for DATA_WAIT_LOGS logged steps in a row; once per streak."""

    fraction: float
    run: int = 0

    def observe(self, step: int, wait: Optional[float], step_time: Optional[float]) -> Optional[Alert]:
        if self.fraction <= 0 or wait is None or not step_time:
            return None
        share = wait / step_time
        self.run = self.run + 1 if share > self.fraction else 0
        if self.run != DATA_WAIT_LOGS:
            return None
        return Alert(
            "data_wait",
            share,
            self.fraction,
            f"data loading starves the GPUs: data wait is {share:.0%} of the step time (above "
            f"{self.fraction:.0%} for {self.run} logged steps); use a faster disk for data.path, or a bigger "
            "global batch per step",
            step=step,
        )


class LossRules:
    """Every loss rule of one job, fed rank 0's logged records in order."""

    def __init__(self, cfg: Alerts, rank: int = 0, node: Optional[str] = None) -> None:
        self.rank, self.node = rank, node
        self.loss = SpikeRule(
            "loss_spike",
            "loss",
            cfg.loss_spike_factor,
            cfg.window,
            "the learning rate may be too high or a batch bad (lower train.lr, look at the data)",
        )
        self.grad = SpikeRule(
            "grad_norm_spike",
            "grad norm",
            cfg.grad_norm_spike_factor,
            cfg.window,
            "training may be unstable (lower train.lr, or set train.grad_clip)",
        )
        self.val = ValRule(cfg.val_patience)
        self.data = DataWaitRule(cfg.data_wait_fraction)

    def observe(self, record: Mapping[str, Any]) -> list[Alert]:
        """The alerts one logged record raises (stamped with its step, this rank and node)."""
        step = int(record["step"])
        found = [
            self.loss.observe(step, _finite(record.get("loss"))),
            self.grad.observe(step, _finite(record.get("grad_norm"))),
            self.val.observe(step, _finite(record.get("val_loss"))),
            self.data.observe(step, _finite(record.get("data_wait_s")), _finite(record.get("step_time_s"))),
        ]
        now = _finite(record.get("time")) or 0.0
        return [_stamp(a, self.rank, self.node, now) for a in found if a is not None]


def _stamp(alert: Alert, rank: int, node: Optional[str], now: float) -> Alert:
    return Alert(alert.rule, alert.value, alert.threshold, alert.message, alert.step, rank, node, now)
