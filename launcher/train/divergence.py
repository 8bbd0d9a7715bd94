"""A non-finite loss stops the job before anything non-finite is saved (exit 78, EXIT_DIVERGED).

When it is checked (docs/guides/hangs-and-alerts.md):
- every step, on the device, without a host sync: `Sentinel.observe` remembers the first step whose
  loss (this rank's) or grad norm (global) was NaN/inf. With fp16 the grad norm is left out: an
  inf there is an overflow the loss scaler answers by skipping the step, weights untouched.
- every step, on the host, when the trainer has its stop flag (every real job): the flag's per-step
  all-reduce carries the sentinel too (`agree`), so the check costs no extra collective or sync;
- otherwise (benches, tests driving run_loop) at log steps, checkpoint steps and a signal's save.
Every rank gets the same answer from the all-reduce, so all stop at the same step.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from meshrun.launcher.contract.exitcodes import EXIT_DIVERGED, diverged_fix
from meshrun.launcher.contract.records import alerts
from meshrun.launcher.contract.records.rundir import RunDir

_NEVER = 1 << 62
"""A key larger than any step: packed as _NEVER - first_bad_step so MAX over ranks finds the earliest."""


class Sentinel:
    """The first step (on this rank's device) whose loss or grad norm was not finite; 0 while none."""

    def __init__(self, device: torch.device, check_norm: bool) -> None:
        self.first = torch.zeros((), dtype=torch.int64, device=device)
        self.check_norm = check_norm

    def observe(self, step: int, loss_total: torch.Tensor, grad_norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss_total.detach().float())
        if self.check_norm:
            bad = bad | ~torch.isfinite(grad_norm.detach().float())
        self.first = torch.where((self.first == 0) & bad, torch.full_like(self.first, step), self.first)


def agree(stop_local: bool, sentinel: Sentinel) -> tuple[bool, Optional[int]]:
    """One all-reduce: (whether any rank was signalled, the earliest non-finite step on any rank)."""
    key = torch.where(sentinel.first > 0, _NEVER - sentinel.first, torch.zeros_like(sentinel.first))
    packed = torch.stack([torch.tensor(int(stop_local), dtype=torch.int64, device=key.device), key])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    stop, worst = (int(v) for v in packed.tolist())
    return bool(stop), (_NEVER - worst if worst else None)


def non_finite(values: dict[str, Optional[float]]) -> str:
    """Which of the values was NaN/inf ("loss", "grad norm", or both joined by "and"). "loss" when none is
    known to be: this rank's values may be finite when another rank's loss was not."""
    bad = [name for name, value in values.items() if value is not None and not math.isfinite(value)]
    return " and ".join(bad) or "loss"


def report(
    run_dir: str, step: int, saved: Optional[int], loss: Optional[float], grad_norm: Optional[float], node: str
) -> None:
    """Rank 0: the nonfinite_loss alert in alerts.jsonl and the log, with the usual fixes; `saved`: the
    newest step saved (finite: every save comes after its step's check)."""
    values = {"loss": loss, "grad norm": grad_norm}
    seen = ", ".join(f"{name} {value}" for name, value in values.items() if value is not None)
    message = (
        f"the {non_finite(values)} went non-finite at step {step}{f' ({seen})' if seen else ''}: stopped at once with exit "
        f"{EXIT_DIVERGED}, nothing non-finite saved; {diverged_fix(saved or None)}"
    )
    alert = alerts.Alert("nonfinite_loss", None, None, message, step=step, rank=0, node=node, time=time.time())
    alerts.append(RunDir(run_dir).alerts, [alert])
    print(alert.line(), flush=True)
