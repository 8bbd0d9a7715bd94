"""`meshrun plan --mesh`: count each rank's model-state bytes on the real, sharded model, on this machine.

Torch-free glue: the counting (launcher/probes/meshcount.py: the real model on the meta device, split by the
real parallel code in a fake world of the job's size) needs torch, which the caller's side never
imports. So it runs in a subprocess of the job's interpreter, gets the resolved JobSpec as JSON on stdin,
and answers one JSON line; this module turns that into the planner's StageBytes (meshrun.submit.planning.estimate), so
the two answers compare field by field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Sequence

from meshrun.launcher.contract.exitcodes import EXIT_INPUT
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.modelshape import StageBytes
from meshrun.launcher.contract.spec.schema import to_plain
from meshrun.submit.errors import ClusterError, InputError, InternalError

TIMEOUT_S = 600.0
"""A 8,192-rank 70B count takes seconds; minutes mean something is wrong."""


def argv(python: str) -> list[str]:
    """The command that counts: the job's interpreter running meshrun.launcher.probes.meshcount."""
    return [python, "-m", "meshrun.launcher.probes.meshcount"]


def run(spec: JobSpec, python: str = sys.executable, timeout: float = TIMEOUT_S) -> list[StageBytes]:
    """Per pipeline stage, the bytes one rank holds, counted on the real model split for the spec's layout.

    Bad input the counter finds (a layout it cannot build) is an InputError naming the key; a counter
    that cannot run or breaks is a ClusterError / InternalError with its last line.
    """
    try:
        done = subprocess.run(
            argv(python), input=json.dumps(to_plain(spec)), capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        raise InputError("python", python, "no such interpreter: give the Python that has torch") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"the mesh dry run ({' '.join(argv(python))}) took over {timeout:.0f} s; stopped") from None
    if done.returncode == EXIT_INPUT:
        raise _input_error(done.stdout, done.stderr)
    if done.returncode != 0:
        raise _failure(python, done.stderr)
    return parse(done.stdout)


def parse(stdout: str) -> list[StageBytes]:
    """StageBytes from meshrun.launcher.probes.meshcount's JSON line (the last line of its output)."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
        return [
            StageBytes(int(s["stage"]), int(s["params"]), int(s["grads"]), int(s["optimizer"])) for s in data["stages"]
        ]
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise InternalError(
            f"meshrun.launcher.probes.meshcount printed {stdout[-200:]!r}, not its JSON ({exc})"
        ) from None


def _input_error(stdout: str, stderr: str) -> InputError:
    """The counter's bad input again as an InputError: its JSON names the key, value and fix."""
    try:
        found: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])["error"]
        return InputError(str(found["key"]), found["value"], str(found["fix"]))
    except (ValueError, IndexError, KeyError, TypeError):
        return InputError("spec", _last_line(stderr), "the mesh dry run refused it")


def _failure(python: str, stderr: str) -> MeshCheckError:
    last = _last_line(stderr)
    if "No module named 'torch'" in stderr:
        return MeshCheckError(f"the mesh dry run needs torch in {python} ({last}); install meshrun there")
    return MeshCheckError(f"the mesh dry run failed: {last}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


class MeshCheckError(ClusterError):
    """The counter could not run here (no torch in that interpreter) or failed: exit 1, with its last line."""


AGREEMENT = 0.01
"""The planner and the count agree when each of a stage's three figures is within 1% of the count."""

FIELDS = ("params", "grads", "optimizer")


def summary(spec: JobSpec, python: str = sys.executable) -> dict[str, Any]:
    """`meshrun plan --mesh`'s "mesh" object: per stage the counted bytes beside the planner's, the largest
    relative difference, whether all agree within AGREEMENT, and the dry run's wall time."""
    from meshrun.submit.planning.estimate import model_state_bytes

    started = time.perf_counter()
    counted = run(spec, python)
    seconds = time.perf_counter() - started
    stages = []
    for mine, planned in zip(counted, model_state_bytes(spec)):
        diff = max((_relative(getattr(planned, f), getattr(mine, f)) for f in FIELDS), key=abs)
        row: dict[str, Any] = {"stage": mine.stage, **{f: getattr(mine, f) for f in FIELDS}}
        row.update(planned={f: getattr(planned, f) for f in FIELDS}, difference=round(diff, 6))
        stages.append(row)
    agrees = all(abs(row["difference"]) <= AGREEMENT for row in stages)
    return {"world_size": spec.world_size, "stages": stages, "agrees": agrees, "seconds": round(seconds, 3)}


def _relative(planned: int, counted: int) -> float:
    """The planner's error relative to the count, signed (negative: the planner says less)."""
    return (planned - counted) / counted if counted else float(planned != 0)


def lines(mesh: dict[str, Any]) -> list[str]:
    """`summary` for a person: a line of verdict, then per stage the counted GiB and the planner's difference."""
    verdict = "agrees with" if mesh["agrees"] else "DIFFERS from"
    head = (
        f"mesh dry run ({mesh['world_size']:,} ranks, real model split in a fake world, {mesh['seconds']:.1f} s): "
        f"{verdict} the plan (within {AGREEMENT:.0%})"
    )
    stages = [StageBytes(row["stage"], *(row[f] for f in FIELDS)) for row in mesh["stages"]]
    rows = table(stages)
    rows[0] += "  planner"
    for i, row in enumerate(mesh["stages"], start=1):
        rows[i] += f"  {row['difference']:+.2%}" if row["difference"] else "  same"
    return [head, *("  " + r for r in rows)]


def table(stages: Sequence[StageBytes]) -> list[str]:
    """Human lines: per stage, params, grads, optimizer and their sum per rank (GiB, or MiB when small)."""
    largest = max((s.params + s.grads + s.optimizer for s in stages), default=0)
    unit, size = ("GiB", 1024**3) if largest >= 1024**3 else ("MiB", 1024**2)
    rows = [f"{'stage':>5}  {'params':>9}  {'grads':>9}  {'optimizer':>9}  {'total':>9}  ({unit} per rank)"]
    for s in stages:
        total = s.params + s.grads + s.optimizer
        rows.append(
            f"{s.stage:>5}  {s.params / size:9.2f}  {s.grads / size:9.2f}  {s.optimizer / size:9.2f}  "
            f"{total / size:9.2f}"
        )
    return rows
