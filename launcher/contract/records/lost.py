"""Checkpoints a job saved that never became complete on shared storage. Torch-free, stdlib only.

With `paths.scratch` a save is staged on node-local scratch and the nodes' sidecars copy it to shared
storage; a step whose copy never finished (a sidecar dead for good, a copy past `sidecar.final_copy_s`)
is lost when the attempt ends. The trainer's checkpoint events in metrics.jsonl say which steps were
saved; shared storage says which are complete. At the end of every run (the batch script's requeue
decision, the local supervisor) `check` compares them: lost steps raise a `checkpoint_lost` alert, and a
run whose ranks finished (exit 0) with lost steps is not a success (exit 1, with the reason: on Slurm a
failure is requeued and resumes from the newest complete checkpoint, redoing the lost steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract.records import alerts, ckptdir
from meshrun.launcher.contract.records.rundir import RunDir


def saved_steps(metrics_text: str, job: Optional[str] = None) -> list[int]:
    """The checkpoint steps a job's metrics.jsonl reports that are still its own (ascending): a save at or
    below an earlier one means the job went back (a resume from an older checkpoint) and retrains the
    steps above it, so those are dropped. With `job`, only that job id's saves (a line naming none counts)."""
    steps: list[int] = []
    for line in metrics_text.splitlines():
        if '"checkpoint_step"' not in line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("checkpoint_step") if isinstance(row, dict) else None
        if not isinstance(step, int) or row.get("event") != "checkpoint" or row.get("copied"):
            continue  # "copied": the sidecar's commit on shared storage, not a save
        if job is not None and row.get("job") not in (None, job):
            continue
        steps = [s for s in steps if s < step] + [step]
    return steps


def lost_steps(run_dir: str, checkpoint_dir: str) -> tuple[list[int], Optional[int]]:
    """(steps the job saved beyond its newest complete checkpoint on shared storage, that checkpoint's step)."""
    try:
        text = Path(RunDir(run_dir).metrics).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return [], None
    complete = ckptdir.complete_steps(Path(checkpoint_dir))
    newest = complete[-1] if complete else None
    return [s for s in saved_steps(text) if newest is None or s > newest], newest


def sentence(lost: list[int], newest: Optional[int]) -> str:
    """One line: which steps are lost and what resume and export use instead."""
    shown = ", ".join(map(str, lost[:5])) + (f", ... {lost[-1]}" if len(lost) > 5 else "")
    instead = (
        f"the newest complete checkpoint is step {newest}, which `meshrun resume` and `export` use"
        if newest is not None
        else "no checkpoint is complete: `meshrun resume` starts from step 0"
    )
    return (
        f"checkpoint step{'s' if len(lost) > 1 else ''} {shown} never reached shared storage (only on "
        f"node-local scratch: see logs/sidecar-*.log); {instead}"
    )


def checkpoint_dir_of(run_dir: str) -> str:
    from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

    run = read_run_spec(Path(run_dir)).run
    return run.checkpoint_dir or RunDir(run_dir).default_checkpoints


def check(run_dir: str) -> Optional[str]:
    """At a run's end: the lost-steps sentence (and its alert in alerts.jsonl), or None when none is lost."""
    try:
        lost, newest = lost_steps(run_dir, checkpoint_dir_of(run_dir))
    except Exception:
        return None  # an unreadable spec is the ranks' error to report, not this check's
    if not lost:
        return None
    line = sentence(lost, newest)
    alert = alerts.Alert("checkpoint_lost", float(len(lost)), None, line, step=lost[-1])
    alerts.append(RunDir(run_dir).alerts, [alert])
    return line
