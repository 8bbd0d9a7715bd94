"""What the training loop does with its logged records beyond logging them: rank 0's loss rules
(launcher/train/lossrules.py) into alerts.jsonl and the log, the validation loss a checkpoint's marker
records for `checkpoint.keep_best`, and the report of a divergence (launcher/train/divergence.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from meshrun.launcher.checkpoint.commit import Checkpointer
from meshrun.launcher.contract.records import alerts, ckptdir
from meshrun.launcher.contract.records.rundir import RunDir, node_name
from meshrun.launcher.contract.spec.job import JobSpec, RunSpec
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train import divergence
from meshrun.launcher.train.lossrules import LossRules
from meshrun.launcher.train.plancheck import PlanCheck, step_message


@dataclass
class Watch:
    rules: Optional[LossRules]
    """Rank 0's rules (None on other ranks, and without a run dir to write alerts to)."""
    run_dir: Optional[str]
    keep_best: bool
    last: dict[str, Any] = field(default_factory=dict)
    """The newest logged record (every rank builds the same global numbers)."""
    plan: Optional[PlanCheck] = None
    """Rank 0's check of the run against the plan's prediction (None: no prediction, or another rank)."""
    event: Optional[Callable[[dict[str, Any]], None]] = None
    """Writes a non-step line to metrics.jsonl (the plan check's)."""

    @classmethod
    def for_job(
        cls,
        job: JobSpec,
        env: RankEnv,
        run_spec: Optional[RunSpec],
        first: int = 1,
        gpu: bool = False,
        event: Optional[Callable[[dict[str, Any]], None]] = None,
    ) -> Watch:
        run_dir = run_spec.run.run_dir if run_spec else None
        rank0 = env.rank == 0 and bool(run_dir)
        rules = LossRules(job.alerts, rank=0, node=node_name(os.environ)) if rank0 else None
        predicted = run_spec.run.prediction if run_spec else None
        plan = None
        if rank0 and run_spec is not None and predicted is not None:
            a = job.alerts
            plan = PlanCheck(predicted, a.plan_drift, a.plan_check_steps, first, gpu, run_spec.run.cluster)
        return cls(rules, run_dir, job.checkpoint.keep_best, plan=plan, event=event)

    def annotations(self) -> dict[str, Any]:
        """What the next records carry beyond the step's numbers: the plan check's ratio once it is known."""
        return self.plan.annotations() if self.plan is not None else {}

    def logged(self, record: dict[str, Any], peak_memory: Optional[int] = None) -> None:
        """`peak_memory`: a GPU's peak allocated bytes so far (None on CPU ranks), for the plan check."""
        self.last = record
        if self.rules is None or self.run_dir is None:
            return
        found = self.rules.observe(record)
        if self.plan is not None and self.plan.result is None:
            found += self.plan.observe(record, peak_memory)
            if self.plan.result is not None:
                if self.event is not None:
                    self.event(self.plan.result)
                print(f"[meshrun] plan check: {step_message(self.plan.result)}", flush=True)
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
