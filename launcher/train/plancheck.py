"""Rank 0's check of the plan against the run: after alerts.plan_check_steps steps past the attempt's warm-up,
the measured step time (and on GPUs the peak memory) over what the plan predicted (spec.json's run.prediction,
submit/planning/steptime.py). Torch-free, stdlib only.

The ratio goes into every later metrics record (`plan_step_ratio`, `plan_term`: TensorBoard and `meshrun status`
show it) and a `plan_check` event line says the whole comparison. Beyond alerts.plan_drift either way it raises
a `plan_drift` alert naming the term that is off, by what the rank measures of each:

- data wait: the time a step waited for its batch (the plan predicts none);
- compute: the rank's own work (on CPU ranks its CPU time: gloo's waits sleep) against the plan's matmuls and
  optimizer step;
- communication: the rest of the step, what it waited on besides its own work (collectives, the pipeline's
  bubble, and a slower peer: a straggler alert names that one);
- on GPUs compute and communication are measured together (the compute stream's time includes what it waits
  on), and memory is the peak allocated against the plan's fullest stage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from meshrun.launcher.contract.records.alerts import Alert
from meshrun.launcher.contract.spec.job import Prediction

WARMUP_STEPS = 5
"""An attempt's first steps, not measured: the allocator, the first collectives and the data loader warm up."""

COMPUTE, COMMUNICATION, DATA_WAIT, MEMORY = "compute", "communication", "data wait", "memory"
GPU_WORK = "compute and communication"
"""On GPUs the two are measured together: the compute stream's time includes the collectives it waits on."""

FIXES = {
    COMPUTE: "the plan's rates are {figures}; `meshrun doctor -c {cluster}` measures the hardware again",
    COMMUNICATION: "a slower peer (a straggler alert names it) or the interconnect: `meshrun doctor -c {cluster}` "
    "measures its bandwidth and latency",
    GPU_WORK: "the plan's rates are {figures}; `meshrun doctor -c {cluster}` measures them again",
    DATA_WAIT: "the input pipeline cannot keep up (see the data_wait alert): faster storage or more workers",
    MEMORY: "the plan's memory model missed something of this layout: `meshrun plan` lists what it counted",
}


@dataclass
class PlanCheck:
    prediction: Prediction
    drift: float
    """alerts.plan_drift: the bound either way (0: measure and show, never alert)."""
    steps: int
    """alerts.plan_check_steps."""
    first: int
    """The attempt's first step."""
    gpu: bool
    cluster: str = "CLUSTER"
    """The profile the job ran on, for the fix's `meshrun doctor -c`."""
    measured: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """(steps covered, record) of the measured records."""
    last_step: Optional[int] = None
    result: Optional[dict[str, Any]] = None
    """The plan_check event once judged."""

    def __post_init__(self) -> None:
        self.last_step = self.first - 1

    def annotations(self) -> dict[str, Any]:
        """What every record after the check carries."""
        if self.result is None:
            return {}
        return {"plan_step_ratio": self.result["step_time_ratio"], "plan_term": self.result["term"]}

    def observe(self, record: dict[str, Any], peak_memory: Optional[int] = None) -> list[Alert]:
        """One logged record (rank 0's); once enough steps are measured, judges them: the plan_check event is then
        in `result`, and the alerts it raised are returned."""
        if self.result is not None or not isinstance(record.get("step"), int):
            return []
        step, before = record["step"], self.last_step or 0
        self.last_step = step
        if before < self.first - 1 + WARMUP_STEPS or step <= before:
            return []  # a record covering warm-up steps (or none)
        self.measured.append((step - before, record))
        if sum(n for n, _ in self.measured) < self.steps:
            return []
        self.result = judge(self.prediction, self.measured, self.gpu, peak_memory)
        self.result["step"] = step
        return self._alerts(step)

    def _alerts(self, step: int) -> list[Alert]:
        found: list[Alert] = []
        result = self.result
        assert result is not None
        if not self.drift:
            return found
        ratio = result["step_time_ratio"]
        if abs(ratio - 1) > self.drift:
            found.append(self._alert(step, ratio, result["term"], step_message(result)))
        memory = result.get("memory_ratio")
        if memory is not None and abs(memory - 1) > self.drift:
            found.append(self._alert(step, memory, MEMORY, memory_message(result)))
        return found

    def _alert(self, step: int, ratio: float, term: str, what: str) -> Alert:
        fix = FIXES[term].format(figures=self.prediction.figures or "its figures", cluster=self.cluster)
        if term == COMPUTE and not self.gpu:
            fix = f"{cpu_sharing()}; or {fix}"
        bound = 1 + self.drift if ratio > 1 else 1 - self.drift
        return Alert("plan_drift", ratio, bound, f"{what}; {fix}", step=step, rank=0)


def cpu_sharing() -> str:
    """On CPU ranks a step also waits for a CPU: what else runs on the node (another job, more ranks than CPUs)
    shows as compute (a rank's runnable time, launcher/train/worktime.py), so the alert says how busy the node is
    (two jobs on 2 cores were told of stragglers)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return "other work on the node's CPUs (another job, or more ranks than CPUs)"
    return f"other work on the node's CPUs: {load:.1f} processes runnable on its {os.cpu_count()} over the last minute"


def _mean(measured: list[tuple[int, dict[str, Any]]], key: str) -> Optional[float]:
    pairs = [(n, r[key]) for n, r in measured if isinstance(r.get(key), (int, float))]
    total = sum(n for n, _ in pairs)
    return sum(n * float(v) for n, v in pairs) / total if total else None


def judge(
    prediction: Prediction, measured: list[tuple[int, dict[str, Any]]], gpu: bool, peak_memory: Optional[int]
) -> dict[str, Any]:
    """The plan_check event: the measured step time over the predicted, each term's measured and predicted seconds
    a step, the term furthest off in the direction of the drift, and (on GPUs) the peak memory's ratio."""
    step = _mean(measured, "step_time_s") or 0.0
    wait = min(_mean(measured, "data_wait_s") or 0.0, step)
    busy = _mean(measured, "busy_s")
    work = step - wait
    if gpu or busy is None:
        terms = {GPU_WORK: (work, prediction.step_s)}
    else:
        own = min(busy, work)
        terms = {COMPUTE: (own, prediction.compute_s), COMMUNICATION: (work - own, prediction.communication_s)}
    terms[DATA_WAIT] = (wait, 0.0)
    ratio = step / prediction.step_s if prediction.step_s > 0 else float("inf")
    off = {name: m - p for name, (m, p) in terms.items()}
    term = max(off, key=off.__getitem__) if ratio >= 1 else min(off, key=off.__getitem__)
    memory = peak_memory / prediction.memory_bytes if peak_memory and prediction.memory_bytes else None
    return {
        "event": "plan_check",
        "steps": sum(n for n, _ in measured),
        "predicted_step_s": prediction.step_s,
        "measured_step_s": step,
        "step_time_ratio": ratio,
        "term": term,
        "terms": {name: {"measured_s": m, "predicted_s": p} for name, (m, p) in terms.items()},
        "memory_ratio": memory,
        "peak_memory_bytes": peak_memory,
        "predicted_memory_bytes": prediction.memory_bytes,
        "figures": prediction.figures,
    }


def step_message(result: dict[str, Any]) -> str:
    term = result["term"]
    seconds = result["terms"][term]
    return (
        f"step time {result['measured_step_s']:.3g} s is {result['step_time_ratio']:.2f}x the plan's "
        f"{result['predicted_step_s']:.3g} s over {result['steps']} steps; {term} is off: "
        f"{seconds['measured_s']:.3g} s a step against {seconds['predicted_s']:.3g} s predicted"
    )


def memory_message(result: dict[str, Any]) -> str:
    gib = 2**30
    return (
        f"peak memory {result['peak_memory_bytes'] / gib:.2f} GiB is {result['memory_ratio']:.2f}x the plan's "
        f"{result['predicted_memory_bytes'] / gib:.2f} GiB"
    )
