"""What the training loop does with its logged records beyond logging them: rank 0's loss rules
(launcher/train/lossrules.py) into alerts.jsonl and the log, the validation loss a checkpoint's marker
records for `checkpoint.keep_best`, and the report of a divergence (launcher/train/divergence.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.checkpoint.commit import Checkpointer
from launcher.contract import alerts, ckptdir
from launcher.contract.rundir import RunDir, node_name
from launcher.contract.spec import JobSpec, RunSpec
from launcher.env import RankEnv
from launcher.train import divergence
from launcher.train.lossrules import LossRules


@dataclass
class Watch:
    rules: Optional[LossRules]
    """Rank 0's rules (None on other ranks, and without a run dir to write alerts to)."""
    run_dir: Optional[str]
    keep_best: bool
    last: dict[str, Any] = field(default_factory=dict)
    """The newest logged record (every rank builds the same global numbers)."""

    @classmethod
    def for_job(cls, job: JobSpec, env: RankEnv, run_spec: Optional[RunSpec]) -> Watch:
        run_dir = run_spec.run.run_dir if run_spec else None
        rules = LossRules(job.alerts, rank=0, node=node_name(os.environ)) if env.rank == 0 and run_dir else None
        return cls(rules, run_dir, job.checkpoint.keep_best)

    def logged(self, record: dict[str, Any]) -> None:
        self.last = record
        if self.rules is None or self.run_dir is None:
            return
        found = self.rules.observe(record)
        alerts.append(RunDir(self.run_dir).alerts, found)
        for alert in found:
            print(alert.line(), flush=True)

    def val_loss(self, step: int) -> Optional[float]:
        """What the marker of a checkpoint saved at `step` records for keep_best: the step's own
        validation loss (None when keep_best is off, or the step had no validation)."""
        value = self.last.get("val_loss") if self.keep_best and self.last.get("step") == step else None
        return float(value) if isinstance(value, float) and math.isfinite(value) else None

    def diverged(self, step: int, saver: Optional[Checkpointer]) -> None:
        """Rank 0 reports the divergence; the save in flight (of an earlier, finite step) finishes."""
        if saver is not None:
            saver.wait()
        if self.rules is None or self.run_dir is None:
            return
        seen = self.last if self.last.get("step") == step else {}
        saved = saver.last_committed if saver is not None else None
        if saver is not None and (done := ckptdir.complete_steps(saver.root)):
            saved = max(done[-1], saved or 0)  # one of an earlier attempt, or committed by the copier
        divergence.report(self.run_dir, step, saved, seen.get("loss"), seen.get("grad_norm"), node_name(os.environ))
