"""Goodput: where every second of a job's allocations went. Torch-free, stdlib only.

Its inputs are the run dir's own records, so the same accounting runs wherever they are read:
- RUN_DIR/.meshrun/attempts.jsonl: each start and end of an allocation ({"event": "start"|"end", "job",
  "restart", "in_job", "time", "submitted", "nodes", "status"}; in_job: a restart inside the allocation on spare
  nodes, absent for the allocation's first start), written by the batch shell (Slurm) or the
  supervisor (local) through `record_start` / `record_end`;
- metrics.jsonl: rank 0's step lines ({"step", "time", "eval_s", ...}: each covers the steps since the line
  before), its "train_start" event per attempt ({"event": "train_start", "from_step", "time"}: the first
  step begins) and its "checkpoint" events ({"event": "checkpoint", "save_stall_s", "time"}).

Each attempt's allocated time (end - start) splits, by its own timestamps, into parts that add up to it:
  setup       allocation to the first step (imports, process group, model build, the resume's load);
  productive  training whose steps were kept;
  lost        training of steps a later attempt or a later job of the run dir computed again (they came
              after the newest checkpoint the next start resumed from);
  ckpt_stall  the training loop waiting on checkpoint saves;
  eval        validation passes;
  end         the last logged step to the allocation's end (the last save, the sidecar's final copies,
              teardown and the requeue decision).
Outside any allocation (no GPU held, so not in the percentage): `queue`, submit to the first start, and
`requeue`, an attempt's end to the next one's start. Effective training time = productive / allocated; of the
wall time (what the user waited: the first start to the last end, the requeue gaps included) it is
productive / wall (`wall_effective_pct`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional

from meshrun.launcher.contract.private import append_line
from meshrun.launcher.contract.records.rundir import RunDir, read_state, write_json

PARTS = ("setup", "productive", "lost", "ckpt_stall", "eval", "end")
"""The parts of an allocation, in the order of a job's life; they add up to `allocated`."""
TRAIN_START = "train_start"
"""The metrics event rank 0 writes as an attempt's first step begins (after any resume)."""


@dataclass
class Attempt:
    job: str
    restart: int
    start: float
    end: Optional[float] = None
    """None while it runs (accounted up to `now`)."""
    submitted: Optional[float] = None
    nodes: str = ""
    status: Optional[int] = None
    in_job: int = 0
    """Its restart inside the allocation (spare nodes); 0 for the allocation's first start."""
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    lost_steps: int = 0
    steps: int = 0
    """Steps this attempt computed (kept or lost)."""


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """The complete JSON object lines of a file (a line being written, or garbled, is skipped)."""
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except OSError:
        return
    with handle:
        for line in handle:
            if not line.endswith("\n"):
                break  # being written
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield row


def attempts_of(records: Iterable[Mapping[str, Any]], job: str) -> list[Attempt]:
    """The job's attempts from attempts.jsonl's lines, oldest first (an end without its start is dropped)."""
    found: dict[tuple[int, int], Attempt] = {}
    for r in records:
        if r.get("job") != job or not isinstance(r.get("time"), (int, float)):
            continue
        key = (int(r.get("restart") or 0), int(r.get("in_job") or 0))
        if r.get("event") == "start":
            found[key] = Attempt(
                job,
                key[0],
                float(r["time"]),
                submitted=_number(r.get("submitted")),
                nodes=str(r.get("nodes", "")),
                in_job=key[1],
            )
        elif r.get("event") == "end" and key in found:
            found[key].end = float(r["time"])
            found[key].status = r.get("status") if isinstance(r.get("status"), int) else None
            found[key].nodes = str(r.get("nodes") or found[key].nodes)
    return [found[k] for k in sorted(found)]


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def account(attempts: list[Attempt], metrics: list[Mapping[str, Any]], now: Optional[float] = None) -> dict[str, Any]:
    """Goodput of one job: its attempts' parts (and the run dir's metrics lines, every job's: a later job's
    resume decides which steps were lost). JSON-ready: seconds per part, per attempt and in all."""
    now = time.time() if now is None else now
    redone = _recomputed(metrics)
    for a, later in zip(attempts, attempts[1:]):
        if a.end is None:  # its batch shell was killed before it could say (Slurm's kill after a preemption)
            a.end = later.start  # at the latest: the next start (the requeue's wait is counted in it)
        if later.in_job and later.restart == a.restart:  # a restart inside the allocation: no queue between
            later.start = min(later.start, a.end)  # the batch shell's decision is the restart's own setup
    for a in attempts:
        _split(a, metrics, redone, now)
    totals = dict.fromkeys(PARTS, 0.0)
    for a in attempts:
        for part, seconds in a.parts.items():
            totals[part] += seconds
    allocated = sum(((a.end if a.end is not None else now) - a.start) for a in attempts)
    first = attempts[0] if attempts else None
    queue = max(0.0, first.start - first.submitted) if first and first.submitted is not None else 0.0
    requeue = sum(
        max(0.0, later.start - earlier.end) for earlier, later in zip(attempts, attempts[1:]) if earlier.end is not None
    )
    # What the user waited: the first start to the last end (now while it runs), the requeue gaps included.
    wall = ((attempts[-1].end if attempts[-1].end is not None else now) - first.start) if first else 0.0
    return {
        "allocated_s": round(allocated, 3),
        "wall_s": round(wall, 3),
        "wall_effective_pct": round(100.0 * totals["productive"] / wall, 2) if wall >= 1.0 else None,
        "parts_s": {k: round(v, 3) for k, v in totals.items()},
        "queue_s": round(queue, 3),
        "requeue_s": round(requeue, 3),
        # Under a second allocated (a start just recorded): too soon to give a percentage.
        "effective_pct": round(100.0 * totals["productive"] / allocated, 2) if allocated >= 1.0 else None,
        "lost_steps": sum(a.lost_steps for a in attempts),
        "steps": sum(a.steps for a in attempts),
        "attempts": [
            {
                "restart": a.restart,
                "in_job": a.in_job,
                "nodes": a.nodes,
                "start": a.start,
                "end": a.end,
                "status": a.status,
                "parts_s": {k: round(v, 3) for k, v in a.parts.items()},
                "lost_steps": a.lost_steps,
            }
            for a in attempts
        ],
        "running": bool(attempts) and attempts[-1].end is None,
        "time": now,
    }


def _recomputed(metrics: list[Mapping[str, Any]]) -> list[tuple[float, int]]:
    """(time, step) of each attempt's start in the run dir: a step at or after `step` computed before
    `time` was computed again (the attempt resumed from `step`)."""
    return [
        (float(r["time"]), int(r["from_step"]))
        for r in metrics
        if r.get("event") == TRAIN_START
        and isinstance(r.get("time"), (int, float))
        and isinstance(r.get("from_step"), int)
    ]


def _lost(step_lo: int, step_hi: int, at: float, redone: list[tuple[float, int]]) -> int:
    """How many of the steps step_lo+1..step_hi (computed at time `at`) a later start computed again."""
    later = [from_step for t, from_step in redone if t > at]
    if not later:
        return 0
    resumed = min(later)  # the earliest point any later attempt went back to
    return max(0, step_hi - max(step_lo, resumed))


def _split(a: Attempt, metrics: list[Mapping[str, Any]], redone: list[tuple[float, int]], now: float) -> None:
    """The attempt's parts, walking its own lines in time order from its start to its end.

    Between two step lines (steps lo+1..hi) the loop trained, ran the validation of line lo (it runs after
    that line is stamped) and waited on the saves after steps lo..hi-1 (a save follows its step's line):
    those come out of the interval first, the rest is training, kept or lost step by step."""
    end = a.end if a.end is not None else now
    mine = sorted(
        (
            r
            for r in metrics
            if r.get("job") == a.job
            and isinstance(r.get("time"), (int, float))
            and a.start <= float(r["time"]) <= end
            and r.get("restart_count", a.restart) == a.restart
        ),
        key=lambda r: float(r["time"]),
    )
    stalls: dict[int, float] = {}
    for r in mine:
        if r.get("event") == "checkpoint" and isinstance(r.get("checkpoint_step"), int):
            stalls[r["checkpoint_step"]] = stalls.get(r["checkpoint_step"], 0.0) + float(r.get("save_stall_s") or 0.0)
    parts = a.parts
    cursor: float = a.start
    step: Optional[int] = None
    eval_due = 0.0  # the validation of the line before, run after its stamp
    for r in mine:
        t = float(r["time"])
        if r.get("event") == TRAIN_START and isinstance(r.get("from_step"), int) and step is None:
            parts["setup"] += t - cursor
            cursor, step = t, int(r["from_step"])
        elif "event" not in r and isinstance(r.get("step"), int):
            hi = int(r["step"])
            if step is None:  # no train_start line (an older trainer): the line's own step time bounds setup
                began = max(cursor, t - float(r.get("step_time_s") or 0.0))
                parts["setup"] += began - cursor
                cursor, step = began, hi - 1
            lo = step
            stall = sum(v for k, v in stalls.items() if lo <= k < hi)
            training = _take(parts, t - cursor, eval_due, stall)
            done, lost = max(1, hi - lo), _lost(lo, hi, t, redone)
            a.steps += done
            a.lost_steps += lost
            parts["lost"] += training * lost / done
            parts["productive"] += training * (done - lost) / done
            cursor, step, eval_due = t, hi, float(r.get("eval_s") or 0.0)
    if step is None:
        parts["setup"] += end - cursor  # it never began a step: all of it was setup
        return
    stall = sum(v for k, v in stalls.items() if k >= step)
    parts["end"] += _take(parts, end - cursor, eval_due, stall)


def _take(parts: dict[str, float], interval: float, eval_s: float, stall_s: float) -> float:
    """Book an interval's validation and checkpoint stall (scaled down if the clocks say they do not fit in
    it); the rest of it is returned."""
    interval = max(0.0, interval)
    busy = eval_s + stall_s
    scale = min(1.0, interval / busy) if busy > 0 else 0.0
    parts["eval"] += eval_s * scale
    parts["ckpt_stall"] += stall_s * scale
    return interval - busy * scale


def record_start(run_dir: str, job: str, restart: int, submitted: Optional[float], nodes: str, in_job: int = 0) -> None:
    record = {
        "event": "start",
        "job": job,
        "restart": restart,
        "time": time.time(),
        "submitted": submitted,
        "nodes": nodes,
        **({"in_job": in_job} if in_job else {}),
    }
    append_line(RunDir(run_dir).attempts, json.dumps(record, sort_keys=True))


def record_end(run_dir: str, job: str, restart: int, status: Optional[int], in_job: int = 0, nodes: str = "") -> None:
    """The attempt's end; `nodes`: the nodes its ranks ran on, when the health gate changed them after the start."""
    record: dict[str, Any] = {"event": "end", "job": job, "restart": restart, "time": time.time(), "status": status}
    if in_job:
        record["in_job"] = in_job
    if nodes:
        record["nodes"] = nodes
    append_line(RunDir(run_dir).attempts, json.dumps(record, sort_keys=True))


def write(run_dir: str, job: str, now: Optional[float] = None) -> Optional[dict[str, Any]]:
    """Account the job from its run dir's records and write RUN_DIR/.meshrun/goodput/JOB.json; the figures,
    or None when the job has no attempt on record (nothing is written then)."""
    rd = RunDir(run_dir)
    attempts = attempts_of(read_jsonl(rd.attempts), job)
    if not attempts:
        return None
    metrics: list[Mapping[str, Any]] = list(read_jsonl(rd.metrics))
    figures = account(attempts, metrics, now)
    write_json(rd.goodput(job), {"job": job, **figures, "progress": progress_of(metrics, job, rd)})
    return figures


def progress_of(metrics: Iterable[Mapping[str, Any]], job: str, rd: RunDir) -> dict[str, int]:
    """The job's newest step and highest checkpoint complete on shared storage, from the whole metrics file (and
    RunDir.last_checkpoint while it names the job), as of this record. An ended job's `status` shows these: the
    metrics tail it reads for a running job fills with a later job's lines (a resume in the same run dir), and
    a job's CKPT read from it went back (journey seed 7015: 45, then 30)."""
    step: Optional[int] = None
    checkpoint: Optional[int] = None
    for row in metrics:
        if row.get("job") not in (None, job):
            continue
        saved = row.get("checkpoint_step")
        if isinstance(saved, int) and not isinstance(saved, bool) and not row.get("staged"):
            checkpoint = saved if checkpoint is None else max(checkpoint, saved)
        if "event" not in row and isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool):
            step = row["step"]
    noted = read_state(rd.last_checkpoint)
    if noted.get("job") == job and isinstance(noted.get("step"), int):
        checkpoint = max(checkpoint or 0, noted["step"])
    found = {"step": step, "checkpoint_step": checkpoint}
    return {k: v for k, v in found.items() if v is not None}
