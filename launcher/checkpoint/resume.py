"""Which checkpoint a (re)started job resumes from, with a crash-loop guard. Torch-free.

Every start that resumes from checkpoint S (or from scratch) counts one attempt in
`resume-attempts.json` beside the checkpoints; a new committed checkpoint clears the
count. A checkpoint that started MAX_ATTEMPTS runs without any new checkpoint (a
corrupt file, a deterministic crash after it) is quarantined — its marker moves
aside, so it is never loaded again — and the job falls back to the previous one.
When nothing is left to fall back to, the job gives up instead of burning the
allocation in a requeue loop. Only the coordinator (rank 0) decides; it broadcasts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract import private
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import ATTEMPTS_FILE

MAX_ATTEMPTS = 2
SCRATCH = "scratch"
"""The attempts key of a start with no checkpoint."""
QUARANTINE_MARKER = "meshrun-quarantined.json"


@dataclass(frozen=True)
class Choice:
    step: Optional[int]
    """The checkpoint step to load; None starts from scratch."""
    gave_up: bool = False
    """Every candidate failed MAX_ATTEMPTS times: stop, do not requeue."""
    note: str = ""
    """What happened, for the log."""


def read_attempts(root: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads((Path(root) / ATTEMPTS_FILE).read_text()).items()}
    except (FileNotFoundError, ValueError):
        return {}


def write_attempts(root: Path, attempts: dict[str, int]) -> None:
    path = Path(root) / ATTEMPTS_FILE
    private.make_private_dir(path.parent)
    tmp = path.with_name(f".{ATTEMPTS_FILE}.tmp")
    private.write_private(tmp, json.dumps(attempts, sort_keys=True))
    os.replace(tmp, path)


def quarantine(root: Path, step: int, reason: str) -> None:
    """Unmark a checkpoint (marker renamed, never deleted: a person may want to look)."""
    path = ckptdir.step_dir(root, step)
    marker = path / ckptdir.MARKER
    if marker.is_file():
        os.replace(marker, path / QUARANTINE_MARKER)
    private.write_private(path / "QUARANTINED.txt", reason + "\n")


def choose(root: Path, requested: Optional[int] = None) -> Choice:
    """Pick the checkpoint to start from, counting this attempt (call on the coordinator only).

    `requested` (checkpoint.resume_step) names an exact step, which must be complete;
    it bypasses the guard's fallback but not its count.
    """
    attempts = read_attempts(root)
    if requested is not None:
        path = ckptdir.resolve(root, requested)  # raises CheckpointError if incomplete
        assert path is not None
        return _count(root, attempts, requested, f"resuming from the requested step {requested}")
    notes: list[str] = []
    for step in reversed(ckptdir.complete_steps(root)):
        if attempts.get(str(step), 0) < MAX_ATTEMPTS:
            return _count(root, attempts, step, "; ".join(notes + [f"resuming from step {step}"]))
        quarantine(root, step, f"{MAX_ATTEMPTS} runs resumed from it and none saved a newer checkpoint")
        notes.append(f"step {step} quarantined after {MAX_ATTEMPTS} failed resumes")
    if attempts.get(SCRATCH, 0) < MAX_ATTEMPTS and not notes:
        return _count(root, attempts, None, "no checkpoint yet: starting from scratch")
    return Choice(
        step=None,
        gave_up=True,
        note="; ".join(
            notes
            + [
                "crash loop: no checkpoint left that has not failed "
                f"{MAX_ATTEMPTS} times; giving up instead of requeueing"
            ]
        ),
    )


def _count(root: Path, attempts: dict[str, int], step: Optional[int], note: str) -> Choice:
    key = SCRATCH if step is None else str(step)
    attempts[key] = attempts.get(key, 0) + 1
    write_attempts(root, attempts)
    return Choice(step=step, note=note)


def progress_made(root: Path) -> None:
    """A new checkpoint committed (or training finished): past failures no longer count."""
    if read_attempts(root):
        write_attempts(root, {})
