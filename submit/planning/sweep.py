"""Sweeps: `--sweep key=v1,v2,...` (repeatable: the grid of all combinations) -> one Slurm job array.

Every combination is planned and validated like a job of its own before anything is
submitted. All tasks share the array's resources (one sbatch script); each task
gets its own run dir, `RUN_DIR/tasks/N`, with its own spec.json, logs and metrics,
and the script points MESHRUN_RUN_DIR at it from SLURM_ARRAY_TASK_ID. Pure.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Optional, Sequence

from meshrun.submit.config.cluster import ClusterProfile
from meshrun.submit.core.plan import Plan, Task
from meshrun.submit.errors import InputError
from meshrun.submit.planning.plan import SchedulerCheck, plan_file

# One array is one shape: keys that change the sbatch script itself cannot be swept.
_FIXED = ("name", "resources", "code")
MAX_TASKS = 10000


def parse(sweeps: Sequence[str]) -> list[tuple[tuple[str, str], ...]]:
    """['a=1,2', 'b=x,y'] -> [(('a','1'),('b','x')), (('a','1'),('b','y')), ...] (the grid, in order)."""
    axes: list[list[tuple[str, str]]] = []
    seen: set[str] = set()
    for item in sweeps:
        if not item.isprintable():
            # Refused whole, before any message repeats the value raw (escape sequences, bidi overrides).
            raise InputError(
                "--sweep", item, "newlines and control characters are not allowed in a sweep; use plain text"
            )
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError("--sweep", item, "use KEY=V1,V2,..., e.g. --sweep train.lr=1e-3,3e-4")
        if key.split(".")[0] in _FIXED:
            raise InputError(
                "--sweep",
                item,
                f"{key} shapes the whole job array; sweep {', '.join(_FIXED)} with separate submissions",
            )
        if key in seen:
            raise InputError("--sweep", item, f"{key} is swept twice; give all its values in one --sweep")
        seen.add(key)
        choices = [v for v in values.split(",")]
        if not all(v.strip() for v in choices):
            raise InputError("--sweep", item, "a value is empty; separate values with single commas")
        axes.append([(key, v) for v in choices])
    grid = [tuple(combo) for combo in itertools.product(*axes)]
    if len(grid) > MAX_TASKS:
        raise InputError("--sweep", len(grid), f"at most {MAX_TASKS} tasks per sweep; sweep fewer values")
    return grid


def plan_sweep(
    path: Path,
    cluster: ClusterProfile,
    overrides: Sequence[str],
    sweeps: Sequence[str],
    home: str,
    run_dir: Optional[str] = None,
    scheduler_check: Optional[SchedulerCheck] = None,
) -> Plan:
    """The array's plan: task 0's job as the base (the script's resources), with every task planned (each with
    the scheduler's own checks, as plan_file)."""
    grid = parse(sweeps)
    base = plan_file(
        path, cluster, [*overrides, *_sets(grid[0])], run_dir=run_dir, home=home, scheduler_check=scheduler_check
    )
    tasks = tuple(
        _task(path, cluster, overrides, combo, index, base, home, scheduler_check) for index, combo in enumerate(grid)
    )
    return dataclasses.replace(base, tasks=tasks)


def _sets(combo: tuple[tuple[str, str], ...]) -> list[str]:
    return [f"{key}={value}" for key, value in combo]


def _task(
    path: Path,
    cluster: ClusterProfile,
    overrides: Sequence[str],
    combo: tuple[tuple[str, str], ...],
    index: int,
    base: Plan,
    home: str,
    scheduler_check: Optional[SchedulerCheck],
) -> Task:
    run_dir = f"{base.run_dir}/tasks/{index}"
    try:
        plan = plan_file(
            path, cluster, [*overrides, *_sets(combo)], run_dir=run_dir, home=home, scheduler_check=scheduler_check
        )
    except InputError as exc:
        label = " ".join(_sets(combo))
        raise InputError(f"--sweep {label}: {exc.key}", exc.value, exc.fix) from None
    # Checkpoints of the tasks must not share a folder (the planner would name it after "N").
    base_run = base.run_spec.run
    info = dataclasses.replace(
        plan.run_spec.run,
        checkpoint_dir=f"{base_run.checkpoint_dir}/task-{index}",
        scratch_dir=f"{base_run.scratch_dir}/task-{index}" if base_run.scratch_dir else "",
    )
    return Task(
        index=index,
        overrides=combo,
        run_dir=run_dir,
        run_spec=dataclasses.replace(plan.run_spec, run=info),
        spec_hash=plan.spec_hash,
    )
